"""WebDataset tar shards read by member (``path="webdataset"``): the samples webdataset's own reader and
``datasets``' webdataset builder give, the batches the same images give through an imagefolder, and
every awkward shard handled as the bad-sample policy says."""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path

import datasets
import pytest
import torch

from datamodules import ImageTextDataModule
from datamodules.plan.bad_samples import BadSample
from datamodules.storage.range_reader import ChangedDuringRun
from datamodules.storage.tar_index import shard_locations
from datamodules.vision.webdataset_rows import WebDatasetRows, indexed_shards
from tests.storage.tar_data import tar_of
from tests.support import RecordingModel, fit_records, quiet_trainer
from tests.vision.image_data import caption, encoded, image_folder, picture, tokenizer_for
from tests.vision.webdataset_data import ChangeAfterStep, captions_rewritten, resized, shards_of_folder

wds = pytest.importorskip("webdataset")

SIZE, TEXT_LEN, TOKENS = 16, 40, 4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tokenizer_for(tmp_path_factory.mktemp("tok"))


def make_dm(tokenizer: str, path: str, cache: Path, **kwargs: object) -> ImageTextDataModule:
    options = {
        "max_text_len": TEXT_LEN,
        "batch_size": 4,
        "tokenizer": tokenizer,
        "num_image_tokens": TOKENS,
        "image_size": SIZE,
    }
    if path == "webdataset":
        options.update(image_field="jpg;png", text_field="txt", prompt_field="json:question")
        options["load_kwargs"] = {"cache_dir": str(cache)}
    return ImageTextDataModule(path, **{**options, **kwargs})


def rows_of(shards: str, fields: dict[str, str], media: tuple[str, ...], tmp_path: Path) -> WebDatasetRows:
    return WebDatasetRows(indexed_shards(shards, str(tmp_path / "idx"), None, False), fields, media)


def batches(dm: ImageTextDataModule, epochs: int = 1) -> list[dict]:
    dm.prepare_data()
    dm.setup("fit")
    return [batch for _ in range(epochs) for batch in dm.train_dataloader()]


def test_samples_are_webdatasets_own_and_datasets_builders_own(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "images", 10)
    pattern = shards_of_folder(folder, tmp_path / "shards", per_shard=4)
    rows = rows_of(pattern, {"jpg;png": "jpg;png", "txt": "txt"}, ("jpg;png",), tmp_path)
    theirs = list(wds.WebDataset(pattern, shardshuffle=False))
    assert len(rows) == len(theirs) == 10
    for i, sample in enumerate(theirs):
        image = sample.get("jpg", sample.get("png"))
        assert rows.describe(i).endswith(f":{sample['__key__']}")
        assert rows[i]["jpg;png"]["bytes"] == image and rows[i]["txt"] == sample["txt"].decode()
    # datasets' builder wants one set of fields in every sample: the images under one key.
    pattern = shards_of_folder(folder, tmp_path / "one-key", per_shard=4, image_key="img")
    rows = rows_of(pattern, {"img": "img", "q": "json:question"}, ("img",), tmp_path)
    builder = datasets.load_dataset("webdataset", data_files={"train": shard_locations(pattern)}, split="train")
    assert len(builder) == len(rows) == 10
    for i, row in enumerate(builder):
        assert rows[i]["img"]["bytes"] == row["img"] and rows[i]["q"] == row["json"]["question"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_same_images_give_the_same_batches_as_through_an_imagefolder(
    tmp_path: Path, tokenizer: str, num_workers: int
) -> None:
    folder = image_folder(tmp_path / "images", 14)
    pattern = shards_of_folder(folder, tmp_path / "shards", per_shard=5)
    want = batches(make_dm(tokenizer, "imagefolder", tmp_path, prompt_field="question",
                           load_kwargs={"data_dir": str(folder)}, num_workers=num_workers), 2)  # fmt: skip
    got = batches(make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=pattern, num_workers=num_workers), 2)
    assert len(want) == len(got) == 6
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_keys_follow_webdatasets_rule_with_members_in_any_order(tmp_path: Path) -> None:
    png, jpg = encoded(picture(1, (20, 20)), "PNG"), encoded(picture(2, (20, 20)), "JPEG")
    shard = tar_of(
        tmp_path / "awkward.tar",
        [
            ("dir.v2/a.b/x.txt", b"first"),  # dots in folder names: the key is up to the last part's first dot
            ("dir.v2/a.b/x.PNG", png),  # the field is lowercased
            ("dir.v2/a.b/x.jpg", jpg),  # two images: the first of image_field's choices wins
            ("__meta__", b"skipped"),  # webdataset's metadata member: not a sample
            ("y.seg.txt", b"second"),  # field "seg.txt"
            ("y.jpg", jpg),
            ("noextension", b"skipped too"),
        ],
    )
    rows = rows_of(str(shard), {"i": "jpg;png", "t": "txt;seg.txt"}, ("i",), tmp_path)
    theirs = list(wds.WebDataset(str(shard), shardshuffle=False))
    assert [rows.describe(i).rsplit(":", 1)[1] for i in range(len(rows))] == [s["__key__"] for s in theirs]
    assert [s["__key__"] for s in theirs] == ["dir.v2/a.b/x", "y"]
    assert rows[0] == {"i": {"bytes": jpg, "path": f"{shard}:dir.v2/a.b/x.jpg"}, "t": "first"}
    assert rows[1]["t"] == "second"
    rows = rows_of(str(shard), {"i": "png;jpg", "t": "txt"}, ("i",), tmp_path)
    assert rows[0]["i"]["bytes"] == png
    with pytest.raises(BadSample, match="it has no .txt member"):
        rows[1]


def test_missing_members_and_undecodable_images_follow_on_bad_sample(tmp_path: Path, tokenizer: str) -> None:
    good = [encoded(picture(i, (24, 24)), "PNG") for i in range(6)]
    members = []
    for i in range(6):
        if i != 2:  # sample 2 has no image
            members.append((f"s{i}.png", good[i] if i != 4 else b"not an image"))  # sample 4's is undecodable
        if i != 3:  # sample 3 has no caption
            members.append((f"s{i}.txt", caption(i).encode()))
    shard = tar_of(tmp_path / "bad.tar", members)
    common = {
        "image_field": "png",
        "text_field": "txt",
        "prompt_field": None,
        "batch_size": 2,
        "data_files": str(shard),
    }
    missing = r"webdataset:train sample .*bad\.tar:s2: it has no \.png member \(its members: \.txt\) \(on_bad"
    with pytest.raises(BadSample, match=missing):
        batches(make_dm(tokenizer, "webdataset", tmp_path / "idx", **common))
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", on_bad_sample="skip", **common)
    got = batches(dm)
    assert len(got) == 3 and all(len(b["input_ids"]) == 2 for b in got)
    assert sorted(dm.bad_samples.reasons) == [f"{'webdataset'}:train sample {shard}:s{i}" for i in (2, 3, 4)]


def fit(dm: ImageTextDataModule, max_steps: int, ckpt_dir: Path | None = None, resume: Path | None = None) -> list:
    return [(r["digest"], r["rows"]) for r in fit_records(dm, max_steps, ckpt_dir, resume)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_mid_epoch_and_across_the_epoch_end(tmp_path: Path, tokenizer: str, workers: int) -> None:
    folder = image_folder(tmp_path / "images", 20)
    pattern = shards_of_folder(folder, tmp_path / "shards", per_shard=7)

    def dm() -> ImageTextDataModule:
        return make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=pattern, num_workers=workers)

    uninterrupted = fit(dm(), 12)  # 5 steps per epoch: across two epoch boundaries
    stopped = fit(dm(), 7, ckpt_dir=tmp_path / "ckpt")
    for step in (3, 6):  # mid-epoch; the next epoch's first step
        resumed = fit(dm(), 12, resume=next((tmp_path / "ckpt").glob(f"*step={step}.ckpt")))
        assert stopped[:step] + resumed == uninterrupted


def test_clips_in_shards_give_the_same_batches_as_through_the_folder_layout(tmp_path: Path) -> None:
    from datamodules import VideoDataModule
    from examples.default_images import train_caption_tokenizer
    from tests.vision.video_data import video_caption, video_folder

    tokenizer = str(train_caption_tokenizer([video_caption(i) for i in range(20)], tmp_path / "tok", vocab_size=300))
    folder = video_folder(tmp_path / "videos", 8, broken={3: "corrupt"})
    rows = [json.loads(line) for line in (folder / "captions.jsonl").read_text().splitlines()]
    (tmp_path / "shards").mkdir()
    with wds.ShardWriter(str(tmp_path / "shards" / "clips-%04d.tar"), maxcount=3, verbose=0) as sink:
        for i, row in enumerate(rows):
            sink.write({"__key__": f"clip{i:03d}", "mp4": (folder / row["video"]).read_bytes(), "txt": row["text"]})
    common = {"max_text_len": 24, "batch_size": 2, "image_size": 16, "frame_options": {"fps": 2.0}, "max_frames": 4}

    def batches(dm: VideoDataModule) -> list[dict]:
        dm.prepare_data()
        dm.setup("fit")
        return list(dm.train_dataloader())

    want = batches(VideoDataModule(str(folder), tokenizer, **common))
    shards = VideoDataModule(
        str(tmp_path / "shards"),
        tokenizer,
        dataset_type="webdataset",
        layout_options={"index_cache_dir": str(tmp_path / "idx")},
        **common,
    )
    got = batches(shards)
    assert len(want) == len(got) == 4
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert list(shards.bad_samples.reasons) == [f"*.tar:train sample {tmp_path / 'shards' / 'clips-0001.tar'}:clip003"]


def test_validation_shards_by_split_are_evaluated_once_and_held_out_fractions_are_disjoint(
    tmp_path: Path, tokenizer: str
) -> None:
    folder = image_folder(tmp_path / "images", 24)
    train = shards_of_folder(folder, tmp_path / "train", per_shard=8)
    held = image_folder(tmp_path / "held", 6)
    val = shards_of_folder(held, tmp_path / "val", per_shard=4)
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files={"train": train, "validation": val},
                 val_split="validation")  # fmt: skip
    batches(dm)
    real = [int(ok) for b in dm.val_dataloader() for ok in (b["labels"] != -100).any(1).tolist()]
    assert sum(real) == 6
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=train, val_fraction=0.25)
    trained = {tuple(r) for b in batches(dm) for r in b["input_ids"].tolist()}
    validated = {tuple(r) for b in dm.val_dataloader() for r in b["input_ids"].tolist()}
    assert len(trained) == 16 and not trained & validated  # 18 training samples: whole steps of 4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"path='webdataset' reads the tar shards named by data_files"),
        ({"data_files": "x.tar", "val_split": "validation"}, r"split 'validation': data_files names one set of shards"),
        ({"data_files": {"train": "x.tar"}, "val_split": "validation"}, r"data_files has no split 'validation'"),
        (
            {"data_files": "x.tar", "load_kwargs": {"data_dir": "x"}},
            r"takes data_files and load_kwargs 'cache_dir' .* got load_kwargs \['data_dir'\]",
        ),
    ],
)
def test_bad_webdataset_options_are_refused_at_construction(tokenizer: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ImageTextDataModule("webdataset", max_text_len=8, batch_size=2, tokenizer=tokenizer, num_image_tokens=0,
                            **options)  # fmt: skip


def test_a_pattern_that_matches_no_shard_is_one_line_at_setup(tmp_path: Path, tokenizer: str) -> None:
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=str(tmp_path / "none-*.tar"))
    with pytest.raises(ValueError, match=r"tar shard pattern '.*none-\*\.tar' matches no file"):
        batches(dm)
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=str(tmp_path / "missing.tar"))
    with pytest.raises(ValueError, match=r"tar shard .*missing\.tar does not exist"):
        batches(dm)


def test_compressed_shards_are_read_from_a_copy_decompressed_once_when_allowed(tmp_path: Path, tokenizer: str) -> None:
    import gzip

    folder = image_folder(tmp_path / "images", 8)
    pattern = shards_of_folder(folder, tmp_path / "shards", per_shard=4)
    for shard in shard_locations(pattern):
        Path(f"{shard}.gz").write_bytes(gzip.compress(Path(shard).read_bytes()))
    want = batches(make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=pattern))
    compressed = f"{pattern}.gz"
    with pytest.raises(ValueError, match=r"gzip-compressed tar: .* or allow_compressed_tar=True"):
        batches(make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=compressed))
    allowed = {"cache_dir": str(tmp_path / "idx"), "allow_compressed_tar": True}
    got = batches(make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=compressed, load_kwargs=allowed))
    assert len(want) == len(got) == 2
    for a, b in zip(want, got, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_onto_changed_shards_is_refused(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 12)
    pattern = shards_of_folder(folder, tmp_path / "shards", per_shard=6)

    def dm() -> ImageTextDataModule:
        return make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=pattern)

    fit(dm(), 3, ckpt_dir=tmp_path / "ckpt")
    first = Path(shard_locations(pattern)[0])
    with tarfile.open(first) as tar:
        kept = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()[:-3]]  # one sample fewer
    tar_of(first, kept)
    with pytest.raises(ValueError, match="the data plan differs from the checkpoint's"):
        fit(dm(), 6, resume=next((tmp_path / "ckpt").glob("*.ckpt")))


def four_shards(tmp_path: Path) -> tuple[str, list[Path]]:
    """24 samples in 4 shards of 6: their pattern and paths."""
    pattern = shards_of_folder(image_folder(tmp_path / "images", 24), tmp_path / "shards", per_shard=6)
    return pattern, [Path(location) for location in shard_locations(pattern)]


def fit_with(dm: ImageTextDataModule, change: ChangeAfterStep) -> None:
    """Two epochs (12 steps) of a fit during which ``change`` changes a shard: every shard is read after it."""
    quiet_trainer(max_steps=12, callbacks=[change]).fit(RecordingModel(), datamodule=dm)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_rewritten_in_place_under_a_run_stops_it_naming_the_shard(
    tmp_path: Path, tokenizer: str, workers: int
) -> None:
    pattern, shards = four_shards(tmp_path)
    last = shards[-1]
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=pattern, on_bad_sample="skip",
                 num_workers=workers)  # fmt: skip
    # The same size and the same tar headers, other captions: the file's mtime says it changed.
    change = ChangeAfterStep(2, lambda: last.write_bytes(captions_rewritten(last)))
    with pytest.raises(ChangedDuringRun, match=rf"{re.escape(str(last))} changed during the run: .* mtime_ns"):
        fit_with(dm, change)
    assert not dm.bad_samples.reasons  # not a bad sample skipped: the run stopped


def test_a_shard_replaced_by_another_with_its_size_and_mtime_kept_is_caught_by_its_tar_headers(
    tmp_path: Path, tokenizer: str
) -> None:
    pattern, shards = four_shards(tmp_path)
    last = shards[-1]

    def replace() -> None:  # another shard's bytes in its place, its times restored (as cp -p or rsync -t do)
        stat = last.stat()
        last.write_bytes(resized(shards[0].read_bytes(), stat.st_size))
        os.utime(last, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=pattern, on_bad_sample="skip")
    message = rf"{re.escape(str(last))} changed during the run: the tar header at byte \d+ is no longer the one of"
    with pytest.raises(ChangedDuringRun, match=message):
        fit_with(dm, ChangeAfterStep(2, replace))


def test_a_field_no_sample_has_says_why_in_skip_mode_too(tmp_path: Path, tokenizer: str) -> None:
    pattern = shards_of_folder(image_folder(tmp_path / "images", 8), tmp_path / "shards", per_shard=4, image_key="jpg")
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=pattern, image_field="jpeg",
                 on_bad_sample="skip")  # fmt: skip
    why = r"it has no \.jpeg member \(its members: \.jpg, \.json, \.txt\); and its 16 replacements are all bad"
    with pytest.raises(BadSample, match=why):
        batches(dm)


def test_an_empty_tar_among_good_shards_is_logged(
    tmp_path: Path, tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    pattern = shards_of_folder(image_folder(tmp_path / "images", 8), tmp_path / "shards", per_shard=4)
    empty = tar_of(tmp_path / "empty.tar", [])
    dm = make_dm(tokenizer, "webdataset", tmp_path / "idx", data_files=[pattern, str(empty)])
    assert len(batches(dm)) == 2  # the good shards' 8 samples
    assert f"1 of 3 tar shards hold no sample: {empty}" in caplog.text


def test_a_clip_shard_rewritten_under_a_run_stops_it_naming_the_shard(tmp_path: Path) -> None:
    from datamodules import VideoDataModule
    from examples.default_images import train_caption_tokenizer
    from tests.vision.video_data import video_caption, video_folder

    tokenizer = str(train_caption_tokenizer([video_caption(i) for i in range(8)], tmp_path / "tok", vocab_size=300))
    folder = video_folder(tmp_path / "videos", 8)
    rows = [json.loads(line) for line in (folder / "captions.jsonl").read_text().splitlines()]
    (tmp_path / "shards").mkdir()
    with wds.ShardWriter(str(tmp_path / "shards" / "clips-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i, row in enumerate(rows):
            sink.write({"__key__": f"clip{i:03d}", "mp4": (folder / row["video"]).read_bytes(), "txt": row["text"]})
    last = tmp_path / "shards" / "clips-0001.tar"
    dm = VideoDataModule(str(tmp_path / "shards"), tokenizer, dataset_type="webdataset", on_broken_clip="mask",
                         layout_options={"index_cache_dir": str(tmp_path / "idx")}, max_text_len=24, batch_size=2,
                         image_size=16, frame_options={"fps": 2.0}, max_frames=4)  # fmt: skip
    change = ChangeAfterStep(1, lambda: last.write_bytes(captions_rewritten(last)))
    with pytest.raises(ChangedDuringRun, match=rf"{re.escape(str(last))} changed during the run"):
        quiet_trainer(max_steps=8, callbacks=[change]).fit(RecordingModel(), datamodule=dm)  # two epochs of 4
