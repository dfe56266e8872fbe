"""A processor whose image-token count depends on the image's size (Qwen2-VL: a token per 28 x 28
pixels after its own resize): each image's placeholders, its rows of patches and ``image_grid_thw``
equal the processor's own call on the same documents, one a row and packed by a budget that counts
them; image-text pairs refuse it."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from datamodules import ImageTextDataModule
from tests.vision.image_data import tokenizer_for
from tests.vision.test_interleaved import IMAGE_TOKEN, rendered

# A document: its parts in order, a text or the number of an image; image k is (30 + 23k) x (20 + 17k) pixels.
DOCUMENTS = [
    ["a picture of red", 0, "and blue", 1],
    [2, "picture 3 shows", 3, 4, "the end"],
    ["only text in this one"],
    [5, 6, 7, 8, 9, 10],
]


def image(k: int) -> Image.Image:
    pixels = np.random.default_rng(k).integers(0, 256, (20 + 17 * k, 30 + 23 * k, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(k: int) -> bytes:
    buffer = io.BytesIO()
    image(k).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The saved documents, and a Qwen2-VL processor (small pixel budget, our tokenizer) saved locally."""
    root = tmp_path_factory.mktemp("qwen")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_for(root / "tok"))
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 12),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
    )
    processor.save_pretrained(root / "processor")
    texts = [[p if isinstance(p, str) else None for p in d] for d in DOCUMENTS]
    images = [[None if isinstance(p, str) else {"bytes": png(p), "path": None} for p in d] for d in DOCUMENTS]
    features = datasets.Features(
        {"texts": datasets.Sequence(datasets.Value("string")), "images": datasets.Sequence(datasets.Image())}
    )
    datasets.Dataset.from_dict({"texts": texts, "images": images}, features=features).save_to_disk(root / "docs")
    return root / "docs", root / "processor"


def datamodule(setup: tuple[Path, Path], **kw: object) -> ImageTextDataModule:
    docs, processor = setup
    options = {"layout": "obelics", "text_field": "texts", "image_field": "images", "max_text_len": 160,
               "batch_size": 4, **kw}  # fmt: skip
    dm = ImageTextDataModule(str(docs), processor=str(processor), **options)
    dm.setup("fit")
    return dm


def theirs(processor: Qwen2VLProcessor, document: list) -> dict[str, torch.Tensor]:
    images = [image(k) for k in document if not isinstance(k, str)]
    return processor(text=rendered(document), images=images or None, return_tensors="pt")


def per_image(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The batch's rows of patches split image by image, by ``image_grid_thw``."""
    counts = batch["image_grid_thw"].prod(dim=1).tolist()
    return list(torch.split(batch["pixel_values"], counts))


def test_one_document_a_row_equals_the_processors_own_call_image_by_image(setup: tuple[Path, Path]) -> None:
    processor = Qwen2VLProcessor.from_pretrained(setup[1])
    counts = {k: int(theirs(processor, [k])["image_grid_thw"].prod()) // 4 for k in range(11)}
    assert len(set(counts.values())) > 3  # the images' token counts differ by size
    dm = datamodule(setup)
    (batch,) = list(dm.train_dataloader())
    images = per_image(batch)
    assert batch["pixel_values"].shape[1] == 1176  # 3 channels x 2 frames x 14 x 14
    for row in range(4):
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        document = next(d for d in DOCUMENTS if len(ids) - 1 == len(theirs(processor, d)["input_ids"][0]))
        own = theirs(processor, document)
        assert ids[:-1] == own["input_ids"][0].tolist()  # then our EOS
        mine = [i for i, r in enumerate(batch["image_sample_index"].tolist()) if r == row]
        if not mine:
            assert "pixel_values" not in own
            continue
        assert torch.equal(batch["image_grid_thw"][mine], own["image_grid_thw"])
        torch.testing.assert_close(torch.cat([images[i] for i in mine]), own["pixel_values"], rtol=0, atol=0)


def test_packed_rows_count_each_images_own_tokens_and_equal_the_processors_own(setup: tuple[Path, Path]) -> None:
    processor = Qwen2VLProcessor.from_pretrained(setup[1])
    dm = datamodule(setup, pack_sequences=True, max_text_len=256, batch_size=1)
    train = dm._train
    lengths = {int(i): int(n) for i, n in zip(train.kept, train.lengths, strict=True)}
    assert lengths == {i: len(theirs(processor, d)["input_ids"][0]) + 1 for i, d in enumerate(DOCUMENTS)}
    rows = np.arange(len(train))
    raw = train.fetch(rows, np.zeros(len(rows), dtype=np.uint64), np.zeros(len(rows), dtype=np.int64))
    batch = train.to_batch(raw)
    images = per_image(batch)
    seen = 0
    for r, members in enumerate(train.documents(rows, np.zeros(len(rows), dtype=np.int64))):
        at = 0
        for index in members.tolist():
            own = theirs(processor, DOCUMENTS[index])
            n = len(own["input_ids"][0])
            assert batch["input_ids"][r, at : at + n].tolist() == own["input_ids"][0].tolist()
            at += n + 1  # and EOS
            if "pixel_values" in own:
                count = len(own["image_grid_thw"])
                assert torch.equal(batch["image_grid_thw"][seen : seen + count], own["image_grid_thw"])
                assert torch.equal(torch.cat(images[seen : seen + count]), own["pixel_values"])
                seen += count
        assert at <= 256
    assert seen == len(batch["image_grid_thw"]) == 11


def test_image_text_pairs_refuse_a_processor_whose_count_depends_on_the_image(setup: tuple[Path, Path]) -> None:
    docs, processor = setup
    with pytest.raises(ValueError, match="image-text pairs need a fixed count"):
        dm = ImageTextDataModule(str(docs), processor=str(processor), image_field="images", text_field="texts",
                                 max_text_len=64, batch_size=2)  # fmt: skip
        dm.setup("fit")
    assert IMAGE_TOKEN == Qwen2VLProcessor.from_pretrained(processor).image_token  # ours: the tokenizer's
