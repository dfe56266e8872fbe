"""Interleaved documents and conversations with images mixed by weight (``MixtureDataModule``), one a
row and packed: every row (every packed document) is its source's own with its own images in order,
both sources in the batches, resume exact; mixes that cannot hold are refused naming why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import ImageTextSource, MixtureComponent, MixtureDataModule
from tests.support import fit_records, row_digest
from tests.vision.image_data import tokenizer_for
from tests.vision.test_image_conversations import CONVERSATIONS, numbered, save
from tests.vision.test_image_text import llava_processor
from tests.vision.test_interleaved import DOCUMENTS, obelics

SEQ = 256


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    tokenizer = tokenizer_for(root / "tok")
    documents = [d + [f"page {i}"] for i, d in enumerate(DOCUMENTS * 5)]
    return {
        "processor": llava_processor(root, tokenizer),
        "docs": obelics(root, documents),
        "chats": save(root, *numbered(distinct(CONVERSATIONS * 5))),
    }


def distinct(conversations: list[list[dict]]) -> list[list[dict]]:
    """The conversations, each opening with a text of its own (so each has tokens of its own)."""
    out = []
    for i, conversation in enumerate(conversations):
        first = {**conversation[0], "content": [{"type": "text", "text": f"chat {i}"}, *conversation[0]["content"]]}
        out.append([first, *conversation[1:]])
    return out


def sources(data: dict[str, Path]) -> dict[str, ImageTextSource]:
    common = {"processor": str(data["processor"]), "image_field": "images"}
    return {
        "docs": ImageTextSource(str(data["docs"]), layout="obelics", text_field="texts", **common),
        "chats": ImageTextSource(str(data["chats"]), layout="chat", text_field="messages", **common),
    }


def mixture(data: dict[str, Path], pack: bool, **kw: object) -> MixtureDataModule:
    components = [MixtureComponent(name, 0.5, source) for name, source in sources(data).items()]
    dm = MixtureDataModule(components, seq_len=SEQ, batch_size=2, pack_sequences=pack, **kw)
    dm.setup("fit")
    return dm


def own_documents(data: dict[str, Path]) -> dict[str, tuple[str, torch.Tensor]]:
    """Each document's or conversation's tokens (digest) as its source alone gives it: its source and images."""
    out = {}
    for name, source in sources(data).items():
        samples, _ = source.build(SEQ, False)
        for index in range(len(samples)):
            batch = samples.to_batch(samples.fetch(np.array([index]), np.zeros(1, dtype=np.uint64)))
            n = int(batch["attention_mask"].sum())
            out[row_digest(batch["input_ids"][0, :n])] = (name, batch["pixel_values"])
    return out


@pytest.mark.parametrize("pack", [False, True], ids=["one-a-row", "packed"])
def test_every_document_in_a_mixed_batch_is_its_sources_own_with_its_images(data: dict[str, Path], pack: bool) -> None:
    own = own_documents(data)
    dm = mixture(data, pack)
    seen = {"docs": 0, "chats": 0}
    for batch in dm.train_dataloader():
        images = 0
        for row in range(len(batch["input_ids"])):
            ids = batch["input_ids"][row]
            if pack:
                documents = batch["document_ids"][row]
                spans = [ids[documents == d] for d in range(int(documents.max()) + 1)]
            else:
                spans = [ids[batch["attention_mask"][row].bool()]]
            expected = []
            for span in spans:
                name, pixels = own[row_digest(span)]  # a document of one source, whole
                seen[name] += 1
                expected.append(pixels)
            mine = batch["pixel_values"][batch["image_sample_index"] == row]
            assert torch.equal(mine, torch.cat(expected))  # its own images, in order
            images += len(mine)
        assert images == len(batch["pixel_values"])
    assert seen["docs"] > 0 and seen["chats"] > 0


def test_a_packed_mixture_resumes_exactly_with_workers(data: dict[str, Path], tmp_path: Path) -> None:
    def fit(max_steps: int, **kw: object) -> list[str]:
        return [r["digest"] for r in fit_records(mixture(data, True, num_workers=2), max_steps, **kw)]

    uninterrupted = fit(9)  # across an epoch's end: passes packed afresh
    stopped = fit(5, ckpt_dir=tmp_path / "ckpt", every=3)
    resumed = fit(9, resume=next((tmp_path / "ckpt").glob("*step=3.ckpt")))
    assert stopped[:3] + resumed == uninterrupted


def test_mixes_that_cannot_hold_are_refused_naming_why(data: dict[str, Path]) -> None:
    docs = sources(data)["docs"]
    pairs = ImageTextSource(str(data["docs"]), processor=str(data["processor"]), text_field="texts",
                            image_field="images")  # fmt: skip
    dm = MixtureDataModule([MixtureComponent("docs", 0.5, docs), MixtureComponent("pairs", 0.5, pairs)],
                           seq_len=SEQ, batch_size=2)  # fmt: skip
    with pytest.raises(ValueError, match="interleaved documents and conversations mix with each other only"):
        dm.setup("fit")
