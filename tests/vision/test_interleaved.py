"""Interleaved documents (OBELICS and MMC4 rows): one row a document, each image's run of placeholders
exactly where the document places it, labels on text tokens only, the images of a batch in order in
``pixel_values``; equal to a ``transformers`` processor's own output; bad documents by the policy."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, LlavaProcessor

from datamodules import ImageTextDataModule
from examples.default_images import SPECIAL_TOKENS
from tests.support import fit_records
from tests.vision.image_data import tokenizer_for
from tests.vision.test_image_text import llava_processor

IMAGE_TOKEN = SPECIAL_TOKENS["image_token"]
SIDE = 16


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tokenizer_for(tmp_path_factory.mktemp("tok"))


def color(k: int) -> tuple[int, int, int]:
    return (10 * k % 256, 255 - 10 * k % 256, 128)


def png(k: int, size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color(k)).save(buffer, "PNG")
    return buffer.getvalue()


# A document: its parts in order, a text or the number of an image (a solid colour of its own).
DOCUMENTS = [
    ["picture 1 shows red only text here"],
    ["describe the picture", 0, "picture 2 shows", 1, 2, "blue"],
    [0 + 3, "picture 3 shows red", 4],
    [k for k in range(5, 15)],  # ten images, no text
]


def obelics(root: Path, documents: list[list], bad: dict[int, bytes] | None = None) -> Path:
    """A saved dataset of OBELICS rows (``texts`` and ``images`` lists, one set at each position)."""
    texts = [[p if isinstance(p, str) else None for p in doc] for doc in documents]
    images = [
        [None if isinstance(p, str) else {"bytes": (bad or {}).get(p, png(p)), "path": None} for p in doc]
        for doc in documents
    ]
    features = datasets.Features(
        {"texts": datasets.Sequence(datasets.Value("string")), "images": datasets.Sequence(datasets.Image())}
    )
    datasets.Dataset.from_dict({"texts": texts, "images": images}, features=features).save_to_disk(root / "docs")
    return root / "docs"


def datamodule(path: Path, tokenizer: str, **kw: object) -> ImageTextDataModule:
    options = {
        "tokenizer": tokenizer, "layout": "obelics", "text_field": "texts", "image_field": "images",
        "image_token": IMAGE_TOKEN, "num_image_tokens": 3, "image_size": SIDE, "max_text_len": 80,
        "batch_size": 4,
    }  # fmt: skip
    dm = ImageTextDataModule(str(path), **{**options, **kw})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def rendered(document: list, separator: str = "\n\n") -> str:
    out = ""
    for at, part in enumerate(document):
        if not isinstance(part, str):
            out += IMAGE_TOKEN
        else:
            out += (separator if at and isinstance(document[at - 1], str) else "") + part
    return out


def test_each_images_placeholders_sit_where_its_document_places_it_and_only_text_is_a_target(
    tmp_path: Path, tokenizer: str
) -> None:
    dm = datamodule(obelics(tmp_path, DOCUMENTS), tokenizer)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    (batch,) = list(dm.train_dataloader())
    seen = set()
    for row in range(4):
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        text = [t for t in ids[:-1] if t != image_id]
        document = next(
            d
            for d in DOCUMENTS
            if tok.decode(text)
            == tok.decode(tok(rendered(d).replace(IMAGE_TOKEN, ""), add_special_tokens=False)["input_ids"])
        )
        seen.add(DOCUMENTS.index(document))
        # The placeholders replace each image token of the rendered text, in place.
        theirs = tok(rendered(document), add_special_tokens=False)["input_ids"]
        widened = [u for t in theirs for u in ([t] * 3 if t == image_id else [t])] + [tok.eos_token_id]
        assert ids == widened
        assert ids.count(image_id) == 3 * sum(not isinstance(p, str) for p in document)
        # Labels: the next token where it is text (EOS included), never a placeholder, never padding.
        labels = batch["labels"][row].tolist()
        for t, label in enumerate(labels):
            follows = ids[t + 1] if t + 1 < len(ids) else None
            assert label == (follows if follows is not None and follows != image_id else -100)
        # Its images, in order, at the rows' turn.
        mine = batch["pixel_values"][batch["image_sample_index"] == row]
        expected = [p for p in document if not isinstance(p, str)]
        assert [tuple(img[:, SIDE // 2, SIDE // 2].tolist()) for img in mine] == [color(k) for k in expected]
    assert seen == {0, 1, 2, 3}
    assert batch["pixel_values"].shape == (15, 3, SIDE, SIDE) and batch["pixel_values"].dtype == torch.uint8
    assert batch["image_sample_index"].tolist() == sorted(batch["image_sample_index"].tolist())


def test_without_loss_before_the_first_image_the_text_before_it_is_no_target(tmp_path: Path, tokenizer: str) -> None:
    dm = datamodule(obelics(tmp_path, DOCUMENTS[1:3]), tokenizer, loss_before_first_image=False, batch_size=2)
    image_id = AutoTokenizer.from_pretrained(tokenizer).convert_tokens_to_ids(IMAGE_TOKEN)
    (batch,) = list(dm.train_dataloader())
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), strict=True):
        first = ids.index(image_id)
        assert all(label == -100 for label in labels[:first])  # "describe the picture" before image 0: no loss
        assert any(label != -100 for label in labels[first:])


def test_a_document_cut_at_max_text_len_keeps_only_the_images_whose_placeholders_fit(
    tmp_path: Path, tokenizer: str
) -> None:
    document = ["a", 0, "b", 1, "c"]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    before_second = len(tok(rendered(document[:3]), add_special_tokens=False)["input_ids"]) + 2  # 2 more for image 0
    dm = datamodule(obelics(tmp_path, [document] * 4), tokenizer, max_text_len=before_second + 2)  # image 1 cut
    (batch,) = list(dm.train_dataloader())
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert (batch["input_ids"] == image_id).sum(dim=1).tolist() == [3] * 4  # image 1's run would not fit whole
    assert batch["image_sample_index"].tolist() == [0, 1, 2, 3]
    assert all(tuple(img[:, SIDE // 2, SIDE // 2].tolist()) == color(0) for img in batch["pixel_values"])


def test_mmc4_rows_put_each_image_before_its_sentence(tmp_path: Path, tokenizer: str) -> None:
    rows = {
        "texts": [["first sentence", "second sentence", "third"]] * 4,
        "images": [[{"image": {"bytes": png(2), "path": None}, "matched_text_index": 2},
                    {"image": {"bytes": png(1), "path": None}, "matched_text_index": 0}]] * 4,
    }  # fmt: skip
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "mmc4")
    dm = datamodule(tmp_path / "mmc4", tokenizer, layout="mmc4")
    (batch,) = list(dm.train_dataloader())
    tok = AutoTokenizer.from_pretrained(tokenizer)
    expected = rendered([1, "first sentence", "second sentence", 2, "third"])
    ids = tok(expected, add_special_tokens=False)["input_ids"]
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    widened = [u for t in ids for u in ([t] * 3 if t == image_id else [t])] + [tok.eos_token_id]
    assert batch["input_ids"][0, : len(widened)].tolist() == widened
    assert [tuple(img[:, SIDE // 2, SIDE // 2].tolist()) for img in batch["pixel_values"][:2]] == [color(1), color(2)]


@pytest.mark.parametrize(
    ("layout", "rows", "reason"),
    [
        ("mmc4", {"texts": [["only one"]], "images": [[{"image": None, "path": "x.png", "matched_text_index": 3}]]},
         r"its image 0 has matched_text_index 3, not a sentence index in \[0, 1\)"),
        ("obelics", {"texts": [["text", None]], "images": [[None, {"bytes": b"not an image", "path": None}]]},
         r"not an image format PIL can read"),
        ("obelics", {"texts": [["text", "both"]], "images": [[None, {"bytes": png(0), "path": None}]]},
         r"its position 1 holds both a text and an image"),
        ("obelics", {"texts": [[f"holds {IMAGE_TOKEN} in its text"]], "images": [[None]]},
         "its text holds the image token"),
    ],
    ids=["image-index-out-of-range", "undecodable-image", "text-and-image-at-once", "image-token-in-text"],
)  # fmt: skip
def test_a_bad_document_raises_naming_it_or_is_replaced_and_counted(
    tmp_path: Path, tokenizer: str, layout: str, rows: dict, reason: str
) -> None:
    good = {"texts": [["a fine document", None]], "images": [[None, {"bytes": png(7), "path": None}]]}
    if layout == "mmc4":
        good = {"texts": [["a fine document"]], "images": [[{"image": {"bytes": png(7), "path": None},
                                                              "matched_text_index": 0}]]}  # fmt: skip
    table = {key: rows[key] + good[key] * 7 for key in rows}  # row 0 bad, 7 good
    datasets.Dataset.from_dict(table).save_to_disk(tmp_path / "bad")
    with pytest.raises(Exception, match=rf"row 0: {reason}"):
        list(datamodule(tmp_path / "bad", tokenizer, layout=layout, batch_size=8).train_dataloader())
    dm = datamodule(tmp_path / "bad", tokenizer, layout=layout, batch_size=8, on_bad_sample="skip")
    (batch,) = list(dm.train_dataloader())
    assert len(batch["input_ids"]) == 8 and len(dm.bad_samples.reasons) == 1
    assert (batch["image_sample_index"].bincount(minlength=8) == 1).all()  # every row a good document's image


def test_with_a_llava_processor_ids_and_pixels_equal_the_processors_own(tmp_path: Path, tokenizer: str) -> None:
    path = llava_processor(tmp_path, tokenizer)
    documents = DOCUMENTS[1:3] * 2
    dm = datamodule(obelics(tmp_path, documents), None, processor=str(path), num_image_tokens=None,
                    image_size=None, image_token=None, max_text_len=200)  # fmt: skip
    (batch,) = list(dm.train_dataloader())
    processor = LlavaProcessor.from_pretrained(path)
    for row in range(4):
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        document = next(d for d in documents if len(ids) - 1 == len(processor(
            text=rendered(d), images=[Image.open(io.BytesIO(png(k))) for k in d if not isinstance(k, str)],
        )["input_ids"][0]))  # fmt: skip
        images = [Image.open(io.BytesIO(png(k))).convert("RGB") for k in document if not isinstance(k, str)]
        theirs = processor(text=rendered(document), images=images, return_tensors="pt")
        assert ids[:-1] == theirs["input_ids"][0].tolist()  # then our EOS
        assert torch.equal(batch["pixel_values"][batch["image_sample_index"] == row], theirs["pixel_values"])


def test_interleaved_options_that_cannot_hold_are_refused_with_the_value(tmp_path: Path, tokenizer: str) -> None:
    common = {"tokenizer": tokenizer, "max_text_len": 32, "batch_size": 2, "num_image_tokens": 2}
    with pytest.raises(ValueError, match="layout must be one of"):
        ImageTextDataModule("x", layout="interleaved", **common)
    with pytest.raises(ValueError, match="layout='obelics' needs image_token"):
        ImageTextDataModule("x", layout="obelics", **common)
    with pytest.raises(ValueError, match="layout='mmc4' has no prompt"):
        ImageTextDataModule("x", layout="mmc4", prompt="describe", image_token=IMAGE_TOKEN, **common)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_with_documents_of_any_number_of_images(tmp_path: Path, tokenizer: str, workers: int) -> None:
    documents = [DOCUMENTS[i % 4] + [f"page {i}"] for i in range(10)]
    path = obelics(tmp_path, documents)

    def fit(max_steps: int, **kw: object) -> list[str]:
        dm = datamodule(path, tokenizer, batch_size=2, num_workers=workers)
        return [r["digest"] for r in fit_records(dm, max_steps, **kw)]

    uninterrupted = fit(12)  # 5 steps an epoch: across two epoch boundaries
    stopped = fit(5, ckpt_dir=tmp_path / "ckpt")
    resumed = fit(12, resume=next((tmp_path / "ckpt").glob("*step=3.ckpt")))
    assert stopped[:3] + resumed == uninterrupted
