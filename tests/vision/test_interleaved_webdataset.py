"""Interleaved documents in WebDataset tar shards: a sample's ``.json`` holds the order (OBELICS's
``texts`` and ``images`` lists, the images naming the sample's own image members), read by member as
webdataset's own reader reads the same shards; the batches equal those of the same documents saved as
a dataset, one a row and packed."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from datamodules import ImageTextDataModule
from tests.vision.image_data import tokenizer_for
from tests.vision.test_interleaved import DOCUMENTS, IMAGE_TOKEN, SIDE, obelics, png


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tokenizer_for(tmp_path_factory.mktemp("tok"))


def documents() -> list[list]:
    return [d + [f"page {i}"] for i, d in enumerate(DOCUMENTS * 3)]


def write_shards(out: Path, docs: list[list], bad: dict[int, dict] | None = None) -> str:
    """Each document a sample: ``.json`` with ``texts`` and ``images`` (``"<n>.png"`` or null at each
    position), and its images as members ``<n>.png``; 4 samples a shard."""
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(out / "docs-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i, doc in enumerate(docs):
            sample = {"__key__": f"doc{i:04d}"}
            texts, names = [], []
            for at, part in enumerate(doc):
                texts.append(part if isinstance(part, str) else None)
                names.append(None if isinstance(part, str) else f"{at}.png")
                if not isinstance(part, str):
                    sample[f"{at}.png"] = png(part)
            sample["json"] = {"texts": texts, "images": names, **(bad or {}).get(i, {})}
            sink.write(sample)
    return str(out / f"docs-{{0000..{(len(docs) - 1) // 4:04d}}}.tar")


def datamodule(path: str, tokenizer: str, **kw: object) -> ImageTextDataModule:
    options = {
        "tokenizer": tokenizer, "layout": "obelics", "image_token": IMAGE_TOKEN, "num_image_tokens": 3,
        "image_size": SIDE, "max_text_len": 80, "batch_size": 4, **kw,
    }  # fmt: skip
    dm = ImageTextDataModule(path, **options)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def tar_datamodule(pattern: str, tokenizer: str, tmp_path: Path, **kw: object) -> ImageTextDataModule:
    return datamodule(
        "webdataset", tokenizer, data_files=pattern, text_field="json:texts", image_field="json:images",
        load_kwargs={"cache_dir": str(tmp_path / "index")}, **kw,
    )  # fmt: skip


def test_the_shards_documents_as_webdatasets_reader_gives_them(tmp_path: Path, tokenizer: str) -> None:
    import webdataset as wds

    docs = documents()
    pattern = write_shards(tmp_path / "shards", docs)
    # webdataset's own reader: the key convention (key to the first dot, the rest the member's field).
    samples = list(wds.WebDataset(pattern, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in samples] == [f"doc{i:04d}" for i in range(len(docs))]
    texts, images = [], []
    for sample in samples:
        order = json.loads(sample["json"])
        texts.append(order["texts"])
        images.append([None if n is None else {"bytes": sample[n], "path": None} for n in order["images"]])
    # The documents as webdataset's reader gives them, saved as a dataset; and read by us from the shards.
    features = datasets.Features(
        {"texts": datasets.Sequence(datasets.Value("string")), "images": datasets.Sequence(datasets.Image())}
    )
    datasets.Dataset.from_dict({"texts": texts, "images": images}, features=features).save_to_disk(tmp_path / "ref")
    saved = tmp_path / "ref"
    ours = tar_datamodule(pattern, tokenizer, tmp_path)
    reference = datamodule(str(saved), tokenizer, text_field="texts", image_field="images")
    for a, b in zip(ours.train_dataloader(), reference.train_dataloader(), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_packed_documents_from_shards_equal_the_saved_ones(tmp_path: Path, tokenizer: str) -> None:
    docs = documents()
    pattern = write_shards(tmp_path / "shards", docs)
    saved = obelics(tmp_path, docs)
    packed = {"pack_sequences": True, "max_text_len": 128, "batch_size": 2}
    ours = tar_datamodule(pattern, tokenizer, tmp_path, **packed)
    reference = datamodule(str(saved), tokenizer, text_field="texts", image_field="images", **packed)
    assert len(ours._train) == len(reference._train)
    for a, b in zip(ours.train_dataloader(), reference.train_dataloader(), strict=True):
        for key in ("input_ids", "labels", "position_ids", "pixel_values", "image_counts"):
            assert torch.equal(a[key], b[key]), key


def test_a_json_naming_a_member_the_sample_lacks_is_a_bad_document(tmp_path: Path, tokenizer: str) -> None:
    docs = documents()
    pattern = write_shards(
        tmp_path / "shards", docs, bad={1: {"images": [None, "9.png", None, None, None, None, None]}}
    )
    with pytest.raises(Exception, match=r"doc0001: its json names member '9.png', which it does not have"):
        list(tar_datamodule(pattern, tokenizer, tmp_path, batch_size=12).train_dataloader())
    dm = tar_datamodule(pattern, tokenizer, tmp_path, batch_size=12, on_bad_sample="skip")
    list(dm.train_dataloader())
    assert len(dm.bad_samples.reasons) == 1
