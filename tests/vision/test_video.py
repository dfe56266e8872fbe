"""VideoDataModule: frames sampled by policy and decoded by seeking, text as in image-text, through the plan."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from torchvision.transforms import v2
from transformers import AutoTokenizer

from datamodules import MixtureComponent, MixtureDataModule, VideoDataModule, VideoSource
from datamodules.vision.images import CLIP_MEAN, CLIP_STD, BadSample
from examples.default_images import train_caption_tokenizer
from tests.support import RecordingModel, fit_records, quiet_trainer
from tests.vision.video_data import clip_seconds, encode_clip, nearest_reference, video_caption, video_folder

SIZE, TEXT_LEN, TOKENS, FRAMES = 16, 24, 2, 6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tok")
    texts = [f"{video_caption(i)} describe the clip" for i in range(200)]
    return str(train_caption_tokenizer(texts, root / "tokenizer", vocab_size=300))


def make_dm(root: Path, tokenizer: str, **kwargs) -> VideoDataModule:
    options = {
        "max_text_len": TEXT_LEN,
        "batch_size": 4,
        "image_size": SIZE,
        "frame_options": {"fps": 2.0},
        "max_frames": FRAMES,
        "num_video_tokens": TOKENS,
        "prompt": "describe the clip",
    }
    return VideoDataModule(str(root), tokenizer, **{**options, **kwargs})


def ready(dm: VideoDataModule) -> VideoDataModule:
    dm.prepare_data()
    dm.setup("fit")
    return dm


def reference_frames(path: Path, timestamps: np.ndarray) -> torch.Tensor:
    """The decode-everything reference's nearest frames, resized, cropped, CLIP-normalized."""
    frames = []
    for picture in nearest_reference(path, timestamps):
        image = torch.from_numpy(picture).permute(2, 0, 1)
        image = v2.functional.center_crop(v2.functional.resize(image, SIZE, antialias=True), SIZE)
        frames.append(v2.functional.normalize(image.float() / 255, CLIP_MEAN, CLIP_STD))
    return torch.stack(frames)


def clip_of(batch_row: list[int], tok) -> int:
    """Which clip a row of input ids holds (its caption says ``clip N``)."""
    return int(tok.decode([t for t in batch_row if t != tok.pad_token_id]).split("clip ")[1].split()[0])


def test_a_batch_holds_the_policys_frames_equal_to_the_reference_and_answer_only_labels(
    tmp_path: Path, tokenizer: str
) -> None:
    root = video_folder(tmp_path / "videos", 8)
    dm = ready(make_dm(root, tokenizer))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    prompt = tok("describe the clip", add_special_tokens=False)["input_ids"]
    loaded = next(iter(dm.train_dataloader()))
    assert loaded["pixel_values"].dtype == torch.uint8, "frames cross the loader as bytes"
    batch = dm.on_after_batch_transfer(loaded, 0)  # what the Trainer calls once the batch is on the device
    assert batch["pixel_values"].shape == (4, FRAMES, 3, SIZE, SIZE) and batch["pixel_values"].dtype == torch.float32
    assert batch["frame_mask"].shape == batch["timestamps"].shape == (4, FRAMES)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, TEXT_LEN)
    for b in range(4):
        ids = batch["input_ids"][b].tolist()
        clip = clip_of(ids[TOKENS + len(prompt) :], tok)
        fps = 10 + (clip % 2) * 5
        seconds = round(clip_seconds(clip) * fps) / fps  # whole frames
        n = min(max(round(seconds * 2.0), 1), FRAMES)  # the uniform policy at 2 frames per second
        expected = np.linspace(0, seconds - 1 / fps, n)
        assert batch["frame_mask"][b].tolist() == [True] * n + [False] * (FRAMES - n)
        np.testing.assert_allclose(batch["timestamps"][b, :n].numpy(), expected, atol=1e-5)
        # The reference at the batch's own timestamps (float64): a policy's time can fall midway
        # between two frames, where a microsecond decides.
        reference = reference_frames(root / "clips" / f"{clip:03d}.mp4", batch["timestamps"][b, :n].numpy())
        torch.testing.assert_close(batch["pixel_values"][b, :n], reference, rtol=0, atol=1e-5)
        assert batch["video_positions"][b].tolist() == list(range(TOKENS))
        answer = tok(video_caption(clip), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        start = TOKENS + len(prompt)
        assert ids[:start] == [tok.pad_token_id] * TOKENS + prompt
        assert ids[start : start + len(answer)] == answer
        labels = batch["labels"][b].tolist()
        # labels[t] = input_ids[t + 1] on the answer (EOS included), -100 on prompt, placeholders, padding.
        assert labels[start - 1 : start - 1 + len(answer)] == answer
        assert set(labels[: start - 1] + labels[start - 1 + len(answer) :]) == {-100}


def webvid_layout(root: Path, count: int) -> Path:
    """The same clips as ``video_folder``'s, in WebVid's layout: ``<id[:3]>/<id>.mp4`` and a CSV."""
    lines = ["videoid,name,duration"]
    for i in range(count):
        videoid = f"10{i:03d}"
        (root / videoid[:3]).mkdir(parents=True, exist_ok=True)
        (root / videoid[:3] / f"{videoid}.mp4").write_bytes(
            (root.parent / "videos" / "clips" / f"{i:03d}.mp4").read_bytes()
        )
        lines.append(f'{videoid},"{video_caption(i)}",PT00H00M0{int(clip_seconds(i))}S')
    (root / "results.csv").write_text("\n".join(lines) + "\n")
    return root


def test_webvid_folder_and_hf_layouts_read_the_same_clips_alike(tmp_path: Path, tokenizer: str) -> None:
    folder = video_folder(tmp_path / "videos", 8)
    webvid = webvid_layout(tmp_path / "webvid", 8)
    rows = [json.loads(line) for line in (folder / "captions.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list([{"path": r["video"], "caption": r["text"]} for r in rows]).save_to_disk(tmp_path / "hf")

    def batches(dm: VideoDataModule) -> list[dict]:
        return [{k: v for k, v in b.items()} for b in ready(dm).train_dataloader()]

    ours = batches(make_dm(folder, tokenizer))
    for dm in (
        make_dm(webvid, tokenizer, dataset_type="webvid", manifest="results.csv"),
        make_dm(
            folder,
            tokenizer,
            dataset_type="hf",
            manifest=str(tmp_path / "hf"),
            layout_options={"video_field": "path", "text_field": "caption"},
        ),  # fmt: skip
    ):
        theirs = batches(dm)
        assert len(theirs) == len(ours) == 2
        for a, b in zip(ours, theirs, strict=True):
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


@pytest.mark.parametrize("path", ["../outside.mp4", "/etc/passwd", "clips/../../outside.mp4"])
def test_a_manifest_path_leaving_data_root_is_refused_at_setup(tmp_path: Path, tokenizer: str, path: str) -> None:
    root = video_folder(tmp_path / "videos", 4)
    rows = (root / "captions.jsonl").read_text().splitlines()
    rows[2] = json.dumps({"video": path, "text": "escape"})
    (root / "captions.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=rf"row 2: video path '{path}' leaves data_root"):
        ready(make_dm(root, tokenizer))


BROKEN = {1: "empty", 2: "corrupt", 5: "audio", 6: "cut"}


def test_clips_whose_audio_outlasts_or_stops_before_the_video_train_normally(tmp_path: Path, tokenizer: str) -> None:
    root = video_folder(tmp_path / "videos", 4)
    for i, extra in enumerate([0.1, 0.3, -0.4, 0.0]):  # audio this much longer than the clip's video
        seconds = clip_seconds(i)
        encode_clip(root / "clips" / f"{i:03d}.mp4", seconds, 10, size=(40, 30), audio_seconds=seconds + extra)
    dm = ready(make_dm(root, tokenizer))
    batch = next(iter(dm.train_dataloader()))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    for b in range(4):
        clip = clip_of(batch["input_ids"][b, TOKENS:].tolist(), tok)
        n = min(max(round(clip_seconds(clip) * 2.0), 1), FRAMES)
        assert batch["frame_mask"][b].tolist() == [True] * n + [False] * (FRAMES - n), clip
        assert batch["timestamps"][b, n - 1] == pytest.approx(clip_seconds(clip) - 0.1)  # the last video frame
    assert dm.bad_samples.replacements == 0


def test_broken_clips_are_masked_with_no_loss_and_counted(tmp_path: Path, tokenizer: str) -> None:
    root = video_folder(tmp_path / "videos", 8, broken=BROKEN)
    dm = ready(make_dm(root, tokenizer, batch_size=8, seed=3))
    batch = next(iter(dm.train_dataloader()))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    masked = ~batch["frame_mask"].any(1)
    assert int(masked.sum()) == len(BROKEN)
    assert (batch["labels"][masked] == -100).all() and (batch["labels"][~masked] != -100).any(1).all()
    assert batch["pixel_values"].shape == (8, FRAMES, 3, SIZE, SIZE)  # every sample keeps its shape
    kept = {clip_of(row[TOKENS:], tok) for row in batch["input_ids"][~masked].tolist()}
    assert kept == set(range(8)) - set(BROKEN)
    assert sorted(dm.bad_samples.reasons) == [f"captions.jsonl:train row {i} (clips/{i:03d}.mp4)" for i in BROKEN]
    assert dm.bad_samples.replacements == len(BROKEN)


@pytest.mark.parametrize("row", sorted(BROKEN))
def test_on_broken_clip_raise_names_the_row_and_file(tmp_path: Path, tokenizer: str, row: int) -> None:
    root = video_folder(tmp_path / "videos", 8, broken={row: BROKEN[row]})
    dm = ready(make_dm(root, tokenizer, batch_size=8, on_broken_clip="raise"))
    with pytest.raises(
        BadSample, match=rf"row {row} \(clips/{row:03d}\.mp4\): .*{row:03d}\.mp4.*on_broken_clip='mask'"
    ):
        next(iter(dm.train_dataloader()))


def fit(dm: VideoDataModule, max_steps: int, ckpt_dir: Path | None = None, resume: Path | None = None) -> list:
    return [r["digest"] for r in fit_records(dm, max_steps, ckpt_dir, resume)]


@pytest.mark.parametrize("accuracy", ["exact", "keyframe"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_with_random_frame_offsets_and_masked_clips(
    tmp_path: Path, tokenizer: str, workers: int, accuracy: str
) -> None:
    root = video_folder(tmp_path / "videos", 16, broken={3: "corrupt", 10: "cut"})

    def dm(num_workers: int = workers) -> VideoDataModule:
        return make_dm(
            root, tokenizer, frame_sampling="fixed_count", frame_options={"num_frames": 3, "random_offset": True},
            num_workers=num_workers, frame_accuracy=accuracy,
        )  # fmt: skip

    uninterrupted = fit(dm(), 10)  # 4 steps per epoch: across two epoch boundaries
    stopped = fit(dm(), 5, ckpt_dir=tmp_path / "ckpt")
    resumed = fit(dm(), 10, resume=next((tmp_path / "ckpt").glob("*step=3.ckpt")))  # mid-epoch
    assert stopped[:3] + resumed == uninterrupted
    if workers:
        assert fit(dm(0), 10) == uninterrupted, "workers 0 and 2 differ"
    first, second = (ready(dm(0)).train_dataloader() for _ in range(2))
    one = next(iter(first))
    assert torch.equal(one["timestamps"], next(iter(second))["timestamps"])
    if accuracy == "exact":
        assert len({tuple(t.tolist()) for t in one["timestamps"]}) == 4, "offsets differ between clips"
    else:  # the clips' keyframes' own times: every 5 frames at 10 or 15 fps, so multiples of 1/2 or 1/3 s
        times = one["timestamps"][one["frame_mask"]].numpy()
        assert len(times) and all(np.isclose(t * 2, round(t * 2)) or np.isclose(t * 3, round(t * 3)) for t in times)


def test_a_held_out_fraction_is_disjoint_and_a_val_manifest_is_evaluated_once(tmp_path: Path, tokenizer: str) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    root = video_folder(tmp_path / "videos", 20)
    dm = ready(make_dm(root, tokenizer, val_fraction=0.2))
    train = {clip_of(r[TOKENS:], tok) for b in dm.train_dataloader() for r in b["input_ids"].tolist()}
    val = [
        clip_of(r[TOKENS:], tok)
        for b in dm.val_dataloader()
        for r, real in zip(b["input_ids"].tolist(), (b["labels"] != -100).any(1), strict=True)
        if real
    ]
    assert len(val) == len(set(val)) == 4 and len(train) == 16 and not train & set(val)
    rows = (root / "captions.jsonl").read_text().splitlines()
    (root / "train.jsonl").write_text("\n".join(rows[:14]) + "\n")
    (root / "val.jsonl").write_text("\n".join(rows[14:]) + "\n")
    dm = ready(make_dm(root, tokenizer, manifest="train.jsonl", val_manifest="val.jsonl"))
    batches = list(dm.val_dataloader())
    assert [tuple(b["pixel_values"].shape) for b in batches] == [(4, FRAMES, 3, SIZE, SIZE)] * 2
    real = [
        clip_of(r[TOKENS:], tok)
        for b in batches
        for r, ok in zip(b["input_ids"].tolist(), (b["labels"] != -100).any(1), strict=True)
        if ok
    ]
    assert sorted(real) == list(range(14, 20))


def test_two_video_sources_mix_with_exact_counts_in_every_batch(tmp_path: Path, tokenizer: str) -> None:
    a, b = video_folder(tmp_path / "a", 12), video_folder(tmp_path / "b", 12)
    common = {"image_size": SIZE, "max_frames": FRAMES, "num_video_tokens": TOKENS, "frame_options": {"fps": 2.0}}
    sources = {"a": VideoSource(str(a), tokenizer, prompt="describe the clip", **common),
               "b": VideoSource(str(b), tokenizer, prompt="what happens", **common)}  # fmt: skip
    dm = ready(
        MixtureDataModule([MixtureComponent(n, w, sources[n]) for n, w in (("a", 0.7), ("b", 0.3))], TEXT_LEN, 10)
    )
    prompt_b = AutoTokenizer.from_pretrained(tokenizer)("what happens", add_special_tokens=False)["input_ids"]
    expected = (7, 3)  # 0.7 and 0.3 of every global batch of 10
    for batch in dm.train_dataloader():
        from_b = sum(row[TOKENS : TOKENS + len(prompt_b)] == prompt_b for row in batch["input_ids"].tolist())
        assert (10 - from_b, from_b) == expected


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"dataset_type": "youtube"}, r"dataset_type must be one of \['folder', 'hf', 'webdataset', 'webvid'\]"),
        ({"on_broken_clip": "skip"}, "on_broken_clip must be one of \\('mask', 'raise'\\), got 'skip'"),
        ({"frame_sampling": "random"}, "frame_sampling must be one of"),
        ({"layout_options": {"videoid_column": "id"}}, "does not take layout_options \\['videoid_column'\\]"),
        ({"image_size": 0}, "image_size"),
        ({"val_fraction": 0.2, "val_manifest": "val.jsonl"}, "not both"),
    ],
)
def test_bad_options_are_refused_at_construction(tmp_path: Path, tokenizer: str, option: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_dm(tmp_path, tokenizer, **option)


def test_a_missing_manifest_or_column_is_one_clear_error_at_setup(tmp_path: Path, tokenizer: str) -> None:
    root = video_folder(tmp_path / "videos", 4)
    with pytest.raises(ValueError, match="video manifest nothing.jsonl \\(folder layout\\) is not a file"):
        ready(make_dm(root, tokenizer, manifest="nothing.jsonl"))
    with pytest.raises(ValueError, match="has no column 'clip'; columns are \\['video', 'text'\\]"):
        ready(make_dm(root, tokenizer, layout_options={"video_key": "clip"}))


def test_a_test_manifest_and_a_test_fraction_are_evaluated_once_by_trainer_test(tmp_path: Path, tokenizer: str) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    root = video_folder(tmp_path / "videos", 20)
    rows = (root / "captions.jsonl").read_text().splitlines()
    (root / "train.jsonl").write_text("\n".join(rows[:14]) + "\n")
    (root / "test.jsonl").write_text("\n".join(rows[14:]) + "\n")

    def clips(loader: object) -> list[int]:
        return [
            clip_of(r[TOKENS:], tok)
            for b in loader
            for r, ok in zip(b["input_ids"].tolist(), (b["labels"] != -100).any(1), strict=True)
            if ok
        ]

    dm = ready(make_dm(root, tokenizer, manifest="train.jsonl", test_manifest="test.jsonl"))
    assert sorted(clips(dm.test_dataloader())) == list(range(14, 20))
    held = ready(make_dm(root, tokenizer, val_fraction=0.2, test_fraction=0.1))
    val, test = clips(held.val_dataloader()), clips(held.test_dataloader())
    train = {clip_of(r[TOKENS:], tok) for b in held.train_dataloader() for r in b["input_ids"].tolist()}
    assert len(val) == 4 and len(test) == 2 and not (set(val) & set(test)) and not train & (set(val) | set(test))
    model = RecordingModel()
    quiet_trainer().test(model, datamodule=make_dm(root, tokenizer, val_fraction=0.2, test_fraction=0.1))
    assert len(model.test_rows) == 2


def test_a_process_that_decoded_video_starts_a_mixtures_workers_from_a_forkserver(
    tmp_path: Path, tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datamodules.vision import video_decoding

    common = {"image_size": SIZE, "max_frames": FRAMES, "num_video_tokens": TOKENS, "frame_options": {"fps": 2.0}}
    sources = [MixtureComponent(n, 0.5, VideoSource(str(video_folder(tmp_path / n, 4)), tokenizer, **common))
               for n in "ab"]  # fmt: skip
    for dm in (
        ready(MixtureDataModule(sources, TEXT_LEN, 2, num_workers=1)),
        ready(make_dm(tmp_path / "a", tokenizer)),
    ):
        dm.num_workers = 1
        monkeypatch.setattr(video_decoding, "_DECODED_IN", None)  # nothing decoded in this process yet
        assert dm.spawn_reasons() == [] and dm.train_dataloader().multiprocessing_context is None  # forked
        dm.num_workers = 0
        next(iter(dm.train_dataloader()))  # decoded in this process
        dm.num_workers = 1
        assert dm.spawn_reasons() == [
            "this process has decoded video with PyAV, whose FFmpeg threads and locks a fork copies"
        ]
        assert dm.train_dataloader().multiprocessing_context.get_start_method() == "forkserver"
