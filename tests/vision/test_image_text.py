"""ImageTextDataModule: batches of pixels, tokens and shifted answer-only labels, through the sample plan."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torchvision.transforms import v2
from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

from datamodules import ImageTextDataModule, ImageTextSource, MixtureComponent, MixtureDataModule
from datamodules.vision.images import CLIP_MEAN, CLIP_STD, BadSample, ResizeImage, read_image
from datamodules.vision.prompt_labels import PromptAnswerLabels
from tests.support import RecordingModel, fit_records, quiet_trainer
from tests.vision.image_data import BROKEN, caption, encoded, image_folder, metadata, tokenizer_for

SIZE, TEXT_LEN, TOKENS = 16, 40, 4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tokenizer_for(tmp_path_factory.mktemp("tok"))


def make_dm(folder: Path, tokenizer: str | None, path: str = "imagefolder", **kwargs) -> ImageTextDataModule:
    """A DataModule over ``path``: by default the imagefolder ``folder``."""
    options = {
        "max_text_len": TEXT_LEN,
        "batch_size": 4,
        "tokenizer": tokenizer,
        "num_image_tokens": TOKENS,
        "image_size": SIZE,
        "prompt_field": "question",
        "load_kwargs": {"data_dir": str(folder)} if path == "imagefolder" else {},
    }
    return ImageTextDataModule(path, **{**options, **kwargs})


def ready(dm: ImageTextDataModule) -> ImageTextDataModule:
    dm.prepare_data()
    dm.setup("fit")
    return dm


def reference_pixels(path: Path, size: int = SIZE) -> torch.Tensor:
    """Full decode, shorter side to ``size``, center crop, CLIP normalization: torchvision alone."""
    image = v2.functional.pil_to_tensor(Image.open(path).convert("RGB"))
    image = v2.functional.center_crop(v2.functional.resize(image, size, antialias=True), size)
    return v2.functional.normalize(image.float() / 255, CLIP_MEAN, CLIP_STD)


def test_a_batch_masks_prompt_placeholders_and_padding_and_labels_the_next_answer_token(
    tmp_path: Path, tokenizer: str
) -> None:
    folder = image_folder(tmp_path / "images", 12)
    dm = ready(make_dm(folder, tokenizer, batch_size=6))
    loaded = next(iter(dm.train_dataloader()))
    assert loaded["pixel_values"].dtype == torch.uint8, "pixels cross the loader as bytes"
    batch = dm.on_after_batch_transfer(loaded, 0)  # what the Trainer calls once the batch is on the device
    assert batch["pixel_values"].dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(tokenizer)
    placeholder, eos = tok.pad_token_id, tok.eos_token_id
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "pixel_values": (6, 3, SIZE, SIZE),
        "input_ids": (6, TEXT_LEN),
        "labels": (6, TEXT_LEN),
        "attention_mask": (6, TEXT_LEN),
        "image_positions": (6, TOKENS),
    }
    rows = metadata(folder)
    expected = {}
    for row in rows:
        prompt = [placeholder] * TOKENS + tok(row["question"], add_special_tokens=False)["input_ids"]
        expected[tuple(prompt + tok(row["text"], add_special_tokens=False)["input_ids"] + [eos])] = (len(prompt), row)
    for ids, labels, mask, positions, pixels in zip(
        *(batch[k] for k in ("input_ids", "labels", "attention_mask", "image_positions", "pixel_values")), strict=True
    ):
        ids, labels = ids.tolist(), labels.tolist()
        (full, (prompt_len, row)) = next((f, v) for f, v in expected.items() if tuple(ids[: len(f)]) == f)
        n = len(full)
        assert ids[n:] == [placeholder] * (TEXT_LEN - n), "padding after the answer's EOS"
        assert mask.tolist() == [1] * n + [0] * (TEXT_LEN - n)
        assert positions.tolist() == list(range(TOKENS))
        # labels[t] is the token after t on the answer (its EOS included), -100 on prompt and padding.
        for t in range(TEXT_LEN):
            answer_target = prompt_len <= t + 1 < n
            assert labels[t] == (ids[t + 1] if answer_target else -100), f"position {t}"
        assert [label for label in labels if label != -100][-1] == eos
        assert all(labels[p] == -100 for p in positions.tolist())
        path = folder / row["file_name"]
        if path.suffix == ".png":  # a JPEG may be decoded at reduced scale (PIL's draft), a PNG never
            assert torch.allclose(pixels, reference_pixels(path), atol=1e-5)  # one fused multiply-add
        else:
            assert (pixels - reference_pixels(path)).abs().mean() < 0.1


def test_imagefolder_parquet_and_saved_datasets_give_identical_batches(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 8)
    rows = metadata(folder)
    table = datasets.Dataset.from_dict(
        {
            "image": [(folder / r["file_name"]).read_bytes() for r in rows],
            "text": [r["text"] for r in rows],
            "question": [r["question"] for r in rows],
        }
    ).cast_column("image", datasets.Image())
    table.to_parquet(tmp_path / "pairs.parquet")
    table.save_to_disk(tmp_path / "saved")
    kinds = {
        "imagefolder": make_dm(folder, tokenizer),
        "parquet": make_dm(folder, tokenizer, "parquet", data_files=str(tmp_path / "pairs.parquet")),
        "saved": make_dm(folder, tokenizer, str(tmp_path / "saved")),
    }
    batches = {name: list(ready(dm).train_dataloader()) for name, dm in kinds.items()}
    for name in ("parquet", "saved"):
        for ours, theirs in zip(batches["imagefolder"], batches[name], strict=True):
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_every_pil_mode_becomes_rgb_with_exif_rotation_and_transparency_on_white() -> None:
    red, blue = (255, 0, 0), (0, 0, 255)
    halves = Image.new("RGB", (40, 20), red)
    halves.paste(blue, (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise: the left (red) half on top
    rotated = read_image(encoded(halves, "PNG", exif=exif), None)
    assert rotated.size == (20, 40)
    assert rotated.getpixel((10, 2)) == red and rotated.getpixel((10, 37)) == blue

    sixteen = Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16))
    assert sixteen.mode == "I;16"
    assert read_image(encoded(sixteen, "PNG"), None).getpixel((0, 0)) == (156,) * 3  # 40000/65535, not clipped

    la = Image.new("LA", (4, 4), (0, 0))
    la.putpixel((0, 0), (10, 255))
    transparent = read_image(encoded(la, "PNG"), None)
    assert transparent.getpixel((1, 1)) == (255, 255, 255) and transparent.getpixel((0, 0)) == (10, 10, 10)

    palette = halves.convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    assert read_image(encoded(palette, "PNG"), None).getpixel((30, 10)) == blue
    cmyk = read_image(encoded(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"), None)
    assert np.abs(np.asarray(cmyk, dtype=int) - red).max() < 8
    assert read_image(encoded(Image.new("1", (4, 4), 1), "PNG"), None).getpixel((0, 0)) == (255, 255, 255)


def test_crop_mode_keeps_the_aspect_ratio_and_square_mode_squeezes_the_whole_image() -> None:
    wide = Image.new("RGB", (64, 32), (0, 0, 255))
    wide.paste((255, 0, 0), (0, 0, 12, 32))  # red on the left fifth: outside the center square
    crop = ResizeImage(16, "crop")(wide)
    square = ResizeImage(16, "square")(wide)
    assert crop.shape == square.shape == (3, 16, 16) and crop.dtype == torch.uint8
    assert crop[0].max() < 20, "the center crop holds no red"
    assert square[0, :, 0].min() > 230, "the squeezed image keeps its red left edge"


class PixelsModel(RecordingModel):
    """Records the pixels its steps see; its own ``on_after_batch_transfer`` marks the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.Tensor, bool]] = []

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        return {**batch, "marked": torch.ones(1)}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append(("train", batch["pixel_values"], "marked" in batch))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen.append(("val", batch["pixel_values"], "marked" in batch))


def test_under_the_trainer_steps_see_normalized_pixels_and_the_models_own_transfer_hook_still_runs(
    tmp_path: Path, tokenizer: str
) -> None:
    folder = image_folder(tmp_path / "images", 12)
    model = PixelsModel()
    dm = make_dm(folder, tokenizer, val_fraction=0.25)
    quiet_trainer(max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=2).fit(
        model, datamodule=dm
    )
    fresh = ready(make_dm(folder, tokenizer, val_fraction=0.25))
    expected = [fresh.on_after_batch_transfer(b, 0)["pixel_values"] for b in fresh.train_dataloader()][:2]
    assert [kind for kind, _, _ in model.seen] == ["train", "train", "val"]
    assert all(marked for _, _, marked in model.seen), "the model's hook runs after ours"
    assert all(px.dtype == torch.float32 and px.min() < 0 for _, px, _ in model.seen), "normalized (CLIP mean/std)"
    assert all(torch.equal(px, want) for (_, px, _), want in zip(model.seen, expected, strict=False))


def test_a_user_transform_replaces_ours(tmp_path: Path, tokenizer: str) -> None:
    transform = v2.Compose([v2.PILToTensor(), v2.Resize((SIZE, SIZE), antialias=True), v2.ToDtype(torch.float32)])
    folder = image_folder(tmp_path / "images", 8)
    batch = next(iter(ready(make_dm(folder, tokenizer, transform=transform)).train_dataloader()))
    assert batch["pixel_values"].min() >= 0 and batch["pixel_values"].max() > 1, "float output is kept as it is"
    wrong = v2.Compose([v2.PILToTensor(), v2.Resize((SIZE + 1, SIZE + 1))])
    with pytest.raises(ValueError, match=r"returned shape \(3, 17, 17\); a tensor \[3, 16, 16\]"):
        next(iter(ready(make_dm(folder, tokenizer, transform=wrong)).train_dataloader()))


def test_a_random_user_transform_draws_the_same_values_with_any_worker_count(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 8)
    augment = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(SIZE, antialias=True)])

    def epochs(workers: int, seed: int) -> list[dict[tuple, torch.Tensor]]:
        """Per epoch, each sample's pixels by its tokens."""
        torch.manual_seed(seed)  # the global seed (a worker's seed derives from it) does not matter
        dm = ready(make_dm(folder, tokenizer, transform=augment, num_workers=workers, batch_size=4))
        return [
            {
                tuple(ids): px
                for b in dm.train_dataloader()
                for ids, px in zip(b["input_ids"].tolist(), b["pixel_values"], strict=True)
            }
            for _ in range(2)
        ]

    first, again = epochs(0, 1), epochs(2, 2)
    for ours, theirs in zip(first, again, strict=True):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(not torch.equal(first[0][k], first[1][k]) for k in first[0]), "a new pass draws new crops"


def llava_processor(root: Path, tokenizer: str) -> Path:
    """A LLaVA processor (CLIP image processor, our tokenizer, a chat template), made from a config."""
    template = (
        "{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %} {% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer),
        patch_size=8,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        chat_template=template,
    )
    processor.save_pretrained(root / "processor")
    return root / "processor"


def test_with_a_processor_pixels_and_prompt_tokens_equal_the_processors_own(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 8)
    path = llava_processor(tmp_path, tokenizer)
    dm = ready(make_dm(folder, None, processor=str(path), num_image_tokens=None, image_size=None, batch_size=8))
    batch = next(iter(dm.train_dataloader()))
    processor = LlavaProcessor.from_pretrained(path)
    assert batch["image_positions"].shape == (8, 16)  # (32 / 8) ** 2 patches
    by_caption = {r["text"]: r for r in metadata(folder)}
    for ids, labels, pixels in zip(batch["input_ids"], batch["labels"], batch["pixel_values"], strict=True):
        answer = processor.tokenizer.decode([t for t in labels.tolist() if t != -100][:-1])
        row = by_caption[answer]
        image = Image.open(folder / row["file_name"]).convert("RGB")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["question"]}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        theirs = processor(images=image, text=text, return_tensors="pt")
        assert torch.equal(pixels, theirs["pixel_values"][0])
        prompt = theirs["input_ids"][0].tolist()
        assert ids[: len(prompt)].tolist() == prompt
        assert (labels[: len(prompt) - 1] == -100).all()


# The traps of the systems this replaces, each a test.


def test_labels_come_from_separate_tokenization_where_a_string_search_would_find_no_answer(tokenizer: str) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    prompt, answer = "describe the pic", "ture 3 shows red"
    joint = tok(prompt + answer, add_special_tokens=False)["input_ids"]
    alone = tok(answer, add_special_tokens=False)["input_ids"]
    # The trap is real here: the answer's own tokens do not occur in the joint tokenization.
    assert not any(joint[i : i + len(alone)] == alone for i in range(len(joint)))
    labels = PromptAnswerLabels(tok, "t", 32, TOKENS, tok.pad_token_id)
    out, bad = labels.encode([prompt], [answer])
    assert not bad
    assert [t for t in out["labels"][0].tolist() if t != -100] == alone + [tok.eos_token_id]


def test_truncation_cuts_the_answer_never_the_placeholders(tokenizer: str) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    prompt = tok("describe the picture", add_special_tokens=False)["input_ids"]
    answer = caption(7)
    length = TOKENS + len(prompt) + 3
    out, bad = PromptAnswerLabels(tok, "t", length, TOKENS, tok.pad_token_id).encode(["describe the picture"], [answer])
    assert not bad
    ids, labels = out["input_ids"][0].tolist(), out["labels"][0].tolist()
    assert ids[:TOKENS] == [tok.pad_token_id] * TOKENS and out["image_positions"][0].tolist() == list(range(TOKENS))
    assert ids[TOKENS:] == prompt + tok(answer, add_special_tokens=False)["input_ids"][:3]
    assert labels[-4:] == ids[-3:] + [-100], "the kept answer tokens are targets; the cut one has no label"
    out, bad = PromptAnswerLabels(tok, "t", TOKENS + 4, TOKENS, tok.pad_token_id).encode(
        ["describe the picture in many more words than fit"], [answer]
    )
    assert "leaving no room for the answer in max_text_len=8" in bad[0]


def test_a_caption_alone_labels_every_token_after_its_first(tokenizer: str) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    out, _ = PromptAnswerLabels(tok, "t", 16, 0, tok.pad_token_id).encode([""], ["picture 3 shows"])
    answer = tok("picture 3 shows", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert out["input_ids"][0, : len(answer)].tolist() == answer
    assert out["labels"][0].tolist() == answer[1:] + [-100] * (16 - len(answer) + 1)


def test_image_tokens_are_never_targets(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 8, prompts=False)
    dm = ready(make_dm(folder, tokenizer, prompt_field=None, image_token="<image>", batch_size=8))
    batch = next(iter(dm.train_dataloader()))
    image_id = AutoTokenizer.from_pretrained(tokenizer).convert_tokens_to_ids("<image>")
    assert (batch["input_ids"][:, :TOKENS] == image_id).all()
    assert not (batch["labels"] == image_id).any()
    # Without a prompt the last placeholder predicts the caption's first token; the others take no loss.
    assert (batch["labels"][:, : TOKENS - 1] == -100).all()
    assert (batch["labels"][:, TOKENS - 1] == batch["input_ids"][:, TOKENS]).all()


def test_a_truncated_jpeg_is_refused_even_where_pil_is_told_to_load_truncated_images(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(BadSample, match="truncated or corrupt"):
        read_image(BROKEN["truncated JPEG"](), None)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True, "the caller's setting is left as it was"


# Bad samples: raise naming the file, or skip deterministically with a count.

BAD_ROWS = {3: "truncated JPEG", 4: "zero-byte file", 6: "text named .png"}  # odd rows are .jpg, even .png


@pytest.mark.parametrize("kind", sorted(set(BAD_ROWS.values())))
def test_a_bad_image_raises_naming_its_row_and_file(tmp_path: Path, tokenizer: str, kind: str) -> None:
    row = next(r for r, k in BAD_ROWS.items() if k == kind)
    folder = image_folder(tmp_path / "images", 8, bad={row: BROKEN[kind]()})
    dm = ready(make_dm(folder, tokenizer, batch_size=8))
    with pytest.raises(BadSample, match=rf"row {row} \(image .*{row:04d}\.\w+\): .*on_bad_sample='skip'"):
        next(iter(dm.train_dataloader()))


def fit(dm: ImageTextDataModule, max_steps: int, ckpt_dir: Path | None = None, resume: Path | None = None) -> list:
    return [(r["digest"], r["rows"]) for r in fit_records(dm, max_steps, ckpt_dir, resume)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_and_skipped_samples_are_replaced_alike_in_every_run(
    tmp_path: Path, tokenizer: str, workers: int
) -> None:
    folder = image_folder(tmp_path / "images", 20, bad={row: BROKEN[kind]() for row, kind in BAD_ROWS.items()})

    def dm(num_workers: int = workers) -> ImageTextDataModule:
        return make_dm(folder, tokenizer, on_bad_sample="skip", num_workers=num_workers)

    uninterrupted_dm = dm()
    uninterrupted = fit(uninterrupted_dm, 12)  # 5 steps per epoch: across two epoch boundaries
    stopped = fit(dm(), 5, ckpt_dir=tmp_path / "ckpt")
    resumed = fit(dm(), 12, resume=next((tmp_path / "ckpt").glob("*step=3.ckpt")))  # mid-epoch
    assert stopped[:3] + resumed == uninterrupted
    assert fit(dm(), 12) == uninterrupted, "a second run differs"
    if workers:
        assert fit(dm(0), 12) == uninterrupted, "workers 0 and 2 differ"
    bad = uninterrupted_dm.bad_samples
    assert sorted(bad.reasons) == [
        f"imagefolder:train row {r} (image {folder / f'{r:04d}'}.{'jpg' if r % 2 else 'png'})" for r in sorted(BAD_ROWS)
    ]
    # Every batch is whole: each bad sample was replaced, never dropped.
    assert all(len(rows) == 4 for _, rows in uninterrupted)
    assert bad.replacements >= 3 * 2  # each bad row once per epoch, in two epochs and a bit (a stand-in may be bad too)
    shown = repr(bad)
    assert shown.startswith(f"BadSampleLog(3 bad samples met {bad.replacements} times: 3 in imagefolder:train; e.g. ")


def test_a_held_out_fraction_is_disjoint_from_training_and_evaluated_once(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 40)
    dm = ready(make_dm(folder, tokenizer, val_fraction=0.25))
    train = [r for b in dm.train_dataloader() for r in map(tuple, b["input_ids"].tolist())]
    val = [
        r
        for b in dm.val_dataloader()
        for r, real in zip(map(tuple, b["input_ids"].tolist()), (b["labels"] != -100).any(1), strict=True)
        if real
    ]
    assert len(val) == len(set(val)) == 10 and len(set(train)) == 28  # 30 training rows: whole steps of 4
    assert not set(train) & set(val)
    again = ready(make_dm(folder, tokenizer, val_fraction=0.25, seed=5))
    assert [r for b in again.val_dataloader() for r in map(tuple, b["input_ids"].tolist())][: len(val)] == val, (
        "the held-out rows do not depend on the training seed"
    )


def test_a_validation_split_is_evaluated_once_with_fixed_shapes(tmp_path: Path, tokenizer: str) -> None:
    image_folder(tmp_path / "images" / "train", 12)
    image_folder(tmp_path / "images" / "validation", 6)
    dm = ready(make_dm(tmp_path / "images", tokenizer, val_split="validation"))
    batches = list(dm.val_dataloader())
    assert [tuple(b["input_ids"].shape) for b in batches] == [(4, TEXT_LEN)] * 2
    real = torch.cat([(b["labels"] != -100).any(1) for b in batches])
    assert real.tolist() == [True] * 6 + [False] * 2, "two padding rows (no loss) fill the last batch"


def test_two_image_text_sources_mix_with_exact_counts_in_every_batch(tmp_path: Path, tokenizer: str) -> None:
    a = image_folder(tmp_path / "a", 20)
    b = image_folder(tmp_path / "b", 20, prompts=False)
    common = {"tokenizer": tokenizer, "num_image_tokens": TOKENS, "image_size": SIZE}
    sources = {
        "a": ImageTextSource("imagefolder", prompt_field="question", load_kwargs={"data_dir": str(a)}, **common),
        "b": ImageTextSource("imagefolder", prompt="caption it", load_kwargs={"data_dir": str(b)}, **common),
    }
    dm = ready(
        MixtureDataModule([MixtureComponent(n, w, sources[n]) for n, w in (("a", 0.7), ("b", 0.3))], TEXT_LEN, 10)
    )
    prompt_b = AutoTokenizer.from_pretrained(tokenizer)("caption it", add_special_tokens=False)["input_ids"]
    expected = (7, 3)  # 0.7 and 0.3 of every global batch of 10
    for batch in dm.train_dataloader():
        from_b = sum(row[TOKENS : TOKENS + len(prompt_b)] == prompt_b for row in batch["input_ids"].tolist())
        assert (10 - from_b, from_b) == expected


# Bad input: each a clear error at construction or setup.


def test_a_missing_image_or_text_column_lists_the_columns(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 4)
    with pytest.raises(ValueError, match=r"has no column 'caption'; columns are \['image', 'text', 'question'\]"):
        ready(make_dm(folder, tokenizer, text_field="caption"))
    with pytest.raises(ValueError, match=r"has no column 'picture'"):
        ready(make_dm(folder, tokenizer, image_field="picture"))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"image_size": 0}, r"image_size must be a positive integer, got 0"),
        ({"image_size": -3}, r"image_size must be a positive integer, got -3"),
        ({"resize_mode": "stretch"}, r"resize_mode must be one of \('square', 'crop'\), got 'stretch'"),
        ({"on_bad_sample": "ignore"}, r"on_bad_sample must be one of \('raise', 'skip'\), got 'ignore'"),
        ({"num_image_tokens": None}, r"num_image_tokens is needed without a processor"),
        ({"tokenizer": None}, r"give a tokenizer"),
        ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\), got 1.0"),
        ({"max_text_len": 0}, r"max_text_len must be a positive integer, got 0"),
        ({"val_split": "train"}, r"val_split 'train' is the training split: it would validate on the training rows"),
    ],
)
def test_bad_options_are_refused_at_construction(tmp_path: Path, tokenizer: str, option: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_dm(tmp_path, **{"tokenizer": tokenizer, **option})


def test_max_text_len_shorter_than_the_prompt_plus_one_answer_token_is_refused_at_setup(
    tmp_path: Path, tokenizer: str
) -> None:
    folder = image_folder(tmp_path / "images", 4)
    with pytest.raises(
        ValueError, match=r"max_text_len=4 is shorter than the prompt \(4 tokens .* use max_text_len >= 5"
    ):
        ready(make_dm(folder, tokenizer, max_text_len=4))


def test_a_prompt_too_long_for_max_text_len_is_a_bad_sample(tmp_path: Path, tokenizer: str) -> None:
    folder = image_folder(tmp_path / "images", 8)
    dm = ready(make_dm(folder, tokenizer, max_text_len=TOKENS + 2, batch_size=8))
    with pytest.raises(BadSample, match=r"row \d+ .*leaving no room for the answer in max_text_len=6"):
        next(iter(dm.train_dataloader()))


def test_a_tokenizer_that_cannot_be_loaded_is_one_line(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "images", 4)
    with pytest.raises(ValueError, match=r"^tokenizer '.*nowhere' does not exist$"):
        make_dm(folder, str(tmp_path / "nowhere"))  # at construction
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^cannot load tokenizer '.*empty'") as err:
        ready(make_dm(folder, str(tmp_path / "empty")))
    assert "\n" not in str(err.value)


def real_input_rows(loader: object) -> list[tuple[int, ...]]:
    return [
        r
        for b in loader
        for r, real in zip(map(tuple, b["input_ids"].tolist()), (b["labels"] != -100).any(1), strict=True)
        if real
    ]


def test_a_test_fraction_is_disjoint_from_validation_and_training_and_trainer_test_reads_it_once(
    tmp_path: Path, tokenizer: str
) -> None:
    folder = image_folder(tmp_path / "images", 40)
    dm = ready(make_dm(folder, tokenizer, val_fraction=0.25, test_fraction=0.1))
    val, test = real_input_rows(dm.val_dataloader()), real_input_rows(dm.test_dataloader())
    train = set(map(tuple, (r for b in dm.train_dataloader() for r in b["input_ids"].tolist())))
    assert len(val) == len(set(val)) == 10 and len(test) == len(set(test)) == 4
    assert not (set(val) & set(test)) and not (train & (set(val) | set(test)))
    # Adding a test split leaves the validation rows where they were.
    assert real_input_rows(ready(make_dm(folder, tokenizer, val_fraction=0.25)).val_dataloader()) == val
    model = RecordingModel()
    quiet_trainer().test(model, datamodule=make_dm(folder, tokenizer, val_fraction=0.25, test_fraction=0.1))
    assert len(model.test_rows) == len(set(model.test_rows)) == 4


@pytest.mark.parametrize(
    "option", [{"resize_mode": "square"}, {"resize_mode": "crop"}, {"add_bos": True}, {"mean": (0.5, 0.5, 0.5)}]
)
def test_options_a_processor_decides_are_refused_with_it(tmp_path: Path, tokenizer: str, option: dict) -> None:
    path = llava_processor(tmp_path, tokenizer)
    with pytest.raises(ValueError, match=rf"\['{next(iter(option))}'\] cannot be combined with processor"):
        make_dm(tmp_path, None, processor=str(path), num_image_tokens=None, image_size=None, **option)
