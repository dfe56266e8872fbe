"""Interleaved documents packed several a row by a token budget that counts each image's
placeholders: every row within its budget and image cap, each document placed whole and as it is
alone, each once per pass on 2 ranks x 2 workers, exact and elastic resume, a model's loss on a packed
row equal to its loss on the documents one by one, documents that cannot be packed by the policy."""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from datamodules import ImageTextDataModule
from datamodules.storage.node_arrays import is_mapped
from examples.tiny_vlm import TinyInterleavedVLM
from tests.distributed_support import train_record
from tests.support import fit_records, row_digest, sample_digests
from tests.vision.image_data import tokenizer_for
from tests.vision.test_interleaved import IMAGE_TOKEN, SIDE, color, datamodule, obelics, png

ROW = 192  # tokens a packed row
CAP = 10  # images a row


def random_documents(count: int, seed: int = 0) -> list[list]:
    """Documents of 1 to 12 words between 0 to 5 images (one of ten, one of none), images numbered in order."""
    rng = random.Random(seed)
    words = "red blue circle square page shows the a picture of".split()
    documents, image = [], 0
    for i in range(count):
        document: list = []
        for _ in range(10 if i == 3 else 0 if i == 0 else rng.randint(1, 5)):
            if rng.random() < 0.7 or not document or not isinstance(document[-1], str):
                document.append(" ".join(rng.choices(words, k=rng.randint(1, 12))))
            document.append(image % 200)
            image += 1
        documents.append(document + [f"end {i}"])
    return documents


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tokenizer_for(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def documents() -> list[list]:
    return random_documents(60)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, documents: list[list]) -> Path:
    return obelics(tmp_path_factory.mktemp("docs"), documents)


def packed(path: Path, tokenizer: str, **kw: object) -> ImageTextDataModule:
    options = {"pack_sequences": True, "max_text_len": ROW, "batch_size": 2, "max_images_per_row": CAP, **kw}
    return datamodule(path, tokenizer, **options)


def alone(path: Path, tokenizer: str, **kw: object) -> ImageTextDataModule:
    return datamodule(path, tokenizer, max_text_len=ROW, batch_size=1, **kw)


def raw_rows(dm: ImageTextDataModule, rows: np.ndarray, passes: np.ndarray) -> dict:
    keys = np.zeros(len(rows), dtype=np.uint64)
    return dm._train.to_batch(dm._train.fetch(np.asarray(rows), keys, np.asarray(passes)))


def one_document(dm: ImageTextDataModule, index: int) -> dict:
    """Document ``index`` alone, unpacked: its tokens (no padding), labels and pixels."""
    batch = dm._train.to_batch(dm._train.fetch(np.array([index]), np.zeros(1, dtype=np.uint64)))
    n = int(batch["attention_mask"].sum())
    return {"input_ids": batch["input_ids"][0, :n], "labels": batch["labels"][0, :n], "pixels": batch["pixel_values"]}


def test_rows_hold_whole_documents_within_the_budget_and_cap_each_once_a_pass(
    saved: Path, tokenizer: str, documents: list[list]
) -> None:
    dm, single = packed(saved, tokenizer), alone(saved, tokenizer)
    train = dm._train
    rows = len(train)
    assert train.left_out == 0
    # Measured on every core, then back to one thread before any worker forks.
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    # The per-document tables are the node's, mapped: a rank or worker holds none of its own.
    assert all(is_mapped(a) for a in (train.kept, train.lengths, train.images))
    for pass_ in (0, 1):
        batch = raw_rows(dm, np.arange(rows), np.full(rows, pass_))
        placed = train.documents(np.arange(rows), np.full(rows, pass_))
        assert sorted(np.concatenate(placed).tolist()) == list(range(len(documents)))  # each once a pass
        images = 0
        for r, members in enumerate(placed):
            ids, labels, doc_ids = batch["input_ids"][r], batch["labels"][r], batch["document_ids"][r]
            at = 0
            for d, index in enumerate(members.tolist()):
                own = one_document(single, index)
                n = len(own["input_ids"])
                # Placed whole, its tokens (placeholders counted) and labels as it is alone: no label
                # crosses into the next document, none is on a placeholder.
                assert torch.equal(ids[at : at + n], own["input_ids"])
                assert torch.equal(labels[at : at + n], own["labels"])
                assert (doc_ids[at : at + n] == d).all() and batch["position_ids"][r, at : at + n].tolist() == list(
                    range(n)
                )
                mine = batch["pixel_values"][images : images + len(own["pixels"])]
                assert torch.equal(mine, own["pixels"])  # its images, in order, at its turn
                images += len(own["pixels"])
                at += n
            assert at <= ROW and (doc_ids[at:] == -1).all() and (labels[at:] == -100).all()
            assert int(batch["image_counts"][r]) == sum(len(one_document(single, i)["pixels"]) for i in members)
            assert batch["image_counts"][r] <= CAP
        assert images == len(batch["pixel_values"]) == batch["image_counts"].sum()
        assert (
            batch["image_sample_index"].tolist()
            == torch.repeat_interleave(torch.arange(rows), batch["image_counts"]).tolist()
        )
    # The rows change between passes, their number does not.
    first, second = (train.documents(np.arange(rows), np.full(rows, p)) for p in (0, 1))
    assert [d.tolist() for d in first] != [d.tolist() for d in second]
    # Vision tokens are counted: the rows would overflow by text alone.
    text_only = [len(single._train.text.tokenizer(single._train.text.render(single._train._row(i)[0]))["input_ids"])
                 for i in range(len(documents))]  # fmt: skip
    assert sum(text_only) < sum(train.lengths)


def test_a_models_loss_on_a_packed_row_equals_its_loss_on_the_documents_one_by_one(saved: Path, tokenizer: str) -> None:
    torch.manual_seed(0)
    # 4 placeholders an image: the model's 2 x 2 patches of 8 pixels.
    dm, single = packed(saved, tokenizer, num_image_tokens=4), alone(saved, tokenizer, num_image_tokens=4)
    vocab = len(single._train.text.tokenizer)
    image_id = single._train.text.image_token_id
    model = TinyInterleavedVLM(vocab, 32, 2, 2, ROW, SIDE, 8, image_id).eval()
    rows = np.arange(len(dm._train))
    batch = dm.on_after_batch_transfer(raw_rows(dm, rows, np.zeros(len(rows), dtype=np.int64)), 0)
    with torch.no_grad():
        logits = model(batch)
        packed_losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), reduction="none"
        ).view(len(rows), ROW)
        checked = 0
        for r, members in enumerate(dm._train.documents(rows, np.zeros(len(rows), dtype=np.int64))):
            at = 0
            for index in members.tolist():
                one = single.on_after_batch_transfer(
                    single._train.to_batch(single._train.fetch(np.array([index]), np.zeros(1, dtype=np.uint64))), 0
                )
                n = int(one["attention_mask"].sum())
                theirs = torch.nn.functional.cross_entropy(model(one)[0, :n], one["labels"][0, :n], reduction="none")
                torch.testing.assert_close(packed_losses[r, at : at + n], theirs, atol=1e-5, rtol=1e-4)
                at += n
                checked += 1
        assert checked == len(dm._train.kept)
        # Attention kept within documents by the positions: without them, the loss differs.
        mixed = model({**batch, "position_ids": torch.arange(ROW).expand(len(rows), ROW)})
        assert not torch.allclose(mixed, logits, atol=1e-3)


def test_a_document_over_the_budget_alone_is_refused_at_setup_or_left_out_and_counted(
    tmp_path: Path, tokenizer: str
) -> None:
    documents = random_documents(12, seed=3)
    documents[5] = ["long " * 250, 0, "text"]  # more than a row
    path = obelics(tmp_path, documents)
    with pytest.raises(ValueError, match=r"docs:train row 5: it takes \d+ tokens, more than a row's 192.*1 over the"):
        packed(path, tokenizer, max_images_per_row=None)
    dm = packed(path, tokenizer, max_images_per_row=None, on_bad_sample="skip")
    assert dm._train.left_out == 1
    rows = np.arange(len(dm._train))
    placed = np.concatenate(dm._train.documents(rows, np.zeros(len(rows), dtype=np.int64)))
    assert sorted(placed.tolist()) == [i for i in range(12) if i != 5]  # never silently shifted: 5 alone is out


def test_an_undecodable_image_refuses_its_document_or_leaves_its_room_padding_counted(
    tmp_path: Path, tokenizer: str
) -> None:
    documents = random_documents(12, seed=4)
    broken = next(i for i, d in enumerate(documents) if any(not isinstance(p, str) for p in d))
    image = next(p for p in documents[broken] if not isinstance(p, str))
    path = obelics(tmp_path, documents, bad={image: b"not an image"})
    with pytest.raises(Exception, match=rf"row {broken}: .*not an image format PIL can read"):
        list(packed(path, tokenizer).train_dataloader())
    dm = packed(path, tokenizer, on_bad_sample="skip")
    rows = np.arange(len(dm._train))
    batch = raw_rows(dm, rows, np.zeros(len(rows), dtype=np.int64))
    row = next(r for r, m in enumerate(dm._train.documents(rows, np.zeros(len(rows), dtype=np.int64))) if broken in m)
    members = dm._train.documents(rows, np.zeros(len(rows), dtype=np.int64))[row].tolist()
    assert int(batch["document_ids"][row].max()) == len(members) - 2  # one document fewer in its row
    assert dm._train.bad_samples.replacements == 1 and list(dm._train.bad_samples.reasons) == [
        f"{path}:train row {broken}"
    ]
    # Every other image is still there, in order.
    expected = [color(p) for i in np.concatenate(dm._train.documents(rows, np.zeros(len(rows), dtype=np.int64)))
                if i != broken for p in documents[i] if not isinstance(p, str)]  # fmt: skip
    assert [tuple(img[:, SIDE // 2, SIDE // 2].tolist()) for img in batch["pixel_values"]] == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_across_passes(saved: Path, tokenizer: str, tmp_path: Path, workers: int) -> None:
    def fit(max_steps: int, **kw: object) -> list[str]:
        dm = packed(saved, tokenizer, num_workers=workers)
        return [r["digest"] for r in fit_records(dm, max_steps, **kw)]

    steps = len(packed(saved, tokenizer)._train) // 2
    uninterrupted = fit(steps + 4)  # into the second pass, packed afresh
    stopped = fit(5, ckpt_dir=tmp_path / "ckpt", every=3)
    resumed = fit(steps + 4, resume=next((tmp_path / "ckpt").glob("*step=3.ckpt")))
    assert stopped[:3] + resumed == uninterrupted


def planned(dm: ImageTextDataModule, positions: int) -> Counter:
    """Digests of the documents in the rows the plan puts at positions ``[0, positions)``."""
    dm.train_dataloader()
    _, rows, passes = dm.plan.locate_in_passes(np.arange(positions))
    batch = raw_rows(dm, rows, passes)
    return Counter(sample_digests(batch, torch.ones(len(rows), dtype=torch.bool)))


def train_ddp(path: Path, tokenizer: str, root: Path, devices: int, **kw: object):
    args = ["--interleaved", str(path), "--tokenizer", tokenizer, "--seq-len", str(ROW), "--batch-size", "2"]
    args += ["--workers", "2", "--devices", str(devices), "--strategy", "ddp" if devices > 1 else "auto"]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return train_record(args, root)


def test_two_ddp_ranks_with_two_workers_train_each_document_once_a_pass_and_resume_on_one(
    saved: Path, tokenizer: str, tmp_path: Path
) -> None:
    reference = packed(saved, tokenizer, max_images_per_row=CAP)
    rows = len(reference._train)
    single = alone(saved, tokenizer)
    every_document = Counter(row_digest(one_document(single, i)["input_ids"]) for i in range(len(single._train)))
    assert planned(reference, rows) == every_document  # a pass: each document once
    run = train_ddp(saved, tokenizer, tmp_path / "two", devices=2, max_epochs=1)
    steps = rows // 4
    assert len(run.records(0)) == len(run.records(1)) == steps
    assert Counter(run.rows(0) + run.rows(1)) == planned(reference, steps * 4)
    # Elastic: 2 ranks to step 3, then 1 rank to the epoch's end: each planned position trained once.
    stopped = train_ddp(saved, tokenizer, tmp_path / "stop", devices=2, max_steps=4, every_n_steps=3)
    resumed = train_ddp(saved, tokenizer, tmp_path / "one", devices=1, max_epochs=1, resume=stopped.checkpoint(3))
    trained = stopped.rows(0, before_step=3) + stopped.rows(1, before_step=3) + resumed.rows(0)
    assert Counter(trained) == planned(reference, resumed.info(0)["positions_consumed"])


def test_packing_options_that_cannot_hold_are_refused_with_the_value(tmp_path: Path, tokenizer: str) -> None:
    common = {"tokenizer": tokenizer, "max_text_len": 32, "batch_size": 2, "num_image_tokens": 2}
    with pytest.raises(ValueError, match="max_images_per_row is for packed interleaved documents"):
        ImageTextDataModule("x", max_images_per_row=4, **common)
    unpacked = ImageTextDataModule(str(obelics(tmp_path / "one", [["a", 0]] * 4)), layout="obelics",
                                   image_token=IMAGE_TOKEN, text_field="texts", image_field="images",
                                   max_images_per_row=4, **common)  # fmt: skip
    with pytest.raises(ValueError, match="max_images_per_row=4 caps packed rows: it needs pack_sequences=True"):
        unpacked.setup("fit")
    with pytest.raises(ValueError, match="max_images_per_row must be"):
        ImageTextDataModule("x", layout="obelics", image_token=IMAGE_TOKEN, max_images_per_row=0, **common)
    folder = obelics(tmp_path, [["a", 0, "b", 1]] * 4)
    pairs = ImageTextDataModule(str(folder), image_field="images", text_field="texts", pack_sequences=True, **common)
    with pytest.raises(ValueError, match="image-text pairs are not packed"):
        pairs.setup("fit")
    with pytest.raises(ValueError, match=r"row 0: .*more than max_images=1.*4 too many images"):
        packed(folder, tokenizer, max_images=1, max_images_per_row=None)
    with pytest.raises(ValueError, match=r"row 0: .*more than max_images_per_row=1.*4 over the row's image cap"):
        packed(folder, tokenizer, max_images=2, max_images_per_row=1)


def test_an_image_index_out_of_range_is_refused_at_setup_naming_it_or_left_out_counted(
    tmp_path: Path, tokenizer: str
) -> None:
    good = [{"image": {"bytes": png(1), "path": None}, "matched_text_index": 0}]
    rows = {
        "texts": [["a sentence", "another"]] * 8,
        "images": [good] * 3 + [[{"image": {"bytes": png(2), "path": None}, "matched_text_index": 5}]] + [good] * 4,
    }
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "mmc4")
    with pytest.raises(ValueError, match=r"mmc4:train row 3: its image 0 has matched_text_index 5.*1 malformed"):
        packed(tmp_path / "mmc4", tokenizer, layout="mmc4", max_text_len=24, batch_size=1)
    dm = packed(tmp_path / "mmc4", tokenizer, layout="mmc4", on_bad_sample="skip", max_text_len=24, batch_size=1)
    rows_ = np.arange(len(dm._train))
    placed = np.concatenate(dm._train.documents(rows_, np.zeros(len(rows_), dtype=np.int64)))
    assert dm._train.left_out == 1 and sorted(placed.tolist()) == [0, 1, 2, 4, 5, 6, 7]


def measure_as_rank(local_rank: int, path: str, tokenizer: str, cache: str, start: object, out: object) -> None:
    """Build the packed documents as node-local rank ``local_rank`` of 2 (chunks of 8 documents),
    once both processes are ready; put the chunks it measured and the lengths it mapped in ``out``."""
    import os
    import time
    from types import SimpleNamespace

    os.environ["XDG_CACHE_HOME"] = cache
    from datamodules import ImageTextSource
    from datamodules.plan.parallelism import Job
    from datamodules.vision import interleaved_rows

    interleaved_rows._CHUNK = 8
    measure = interleaved_rows.InterleavedRows._measure

    def slowly(self: object, first: int, stop: int) -> dict:  # a slow tokenizer: 50 ms a chunk
        time.sleep(0.05)
        return measure(self, first, stop)

    interleaved_rows.InterleavedRows._measure = slowly
    source = ImageTextSource(path, tokenizer=tokenizer, layout="obelics", text_field="texts", image_field="images",
                             image_token=IMAGE_TOKEN, num_image_tokens=3, image_size=SIDE)  # fmt: skip
    trainer = SimpleNamespace(
        strategy=object(), world_size=2, global_rank=local_rank, local_rank=local_rank, num_nodes=1
    )
    source.build(ROW, False, Job(trainer))  # the tokenizer and dataset loaded once before: both start together
    start.wait()
    train, _ = source.build(ROW, True, Job(trainer))
    out.put((local_rank, train.measured_here, train.lengths.tolist()))


def test_the_ranks_of_a_node_measure_different_chunks_and_map_each_others(tmp_path: Path, tokenizer: str) -> None:
    import multiprocessing

    path = obelics(tmp_path, random_documents(200, seed=5))
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(2), context.Queue()
    args = (str(path), tokenizer, str(tmp_path / "cache"), start, out)
    processes = [context.Process(target=measure_as_rank, args=(rank, *args)) for rank in range(2)]
    for process in processes:
        process.start()
    found = dict((rank, (chunks, lengths)) for rank, chunks, lengths in (out.get(timeout=120) for _ in range(2)))
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    chunks = {rank: set(measured) for rank, (measured, _) in found.items()}
    assert chunks[0] and chunks[1] and not chunks[0] & chunks[1]  # each chunk measured once, by one of them
    assert chunks[0] | chunks[1] == set(range(25))  # 200 documents, chunks of 8
    assert found[0][0][0] == 0 and found[1][0][0] == 12  # each starts at its own share of the 25
    alone = packed(path, tokenizer)  # one process, its own cache: the same lengths
    assert found[0][1] == found[1][1] == alone._train.lengths.tolist()
