"""HFTextDataModule(streaming=True): documents read by one (rank, worker) each, packed on the fly,
resumed token-exactly through ``Trainer.fit``."""

from __future__ import annotations

import itertools
import json
import logging
import random
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datamodules import HFTextDataModule
from datamodules.text.prepare import DocumentTokenizer
from datamodules.text.prepare_inputs import PrepareError
from datamodules.text.text_stream import TextStream
from examples.default_corpus import train_tokenizer
from tests.support import (
    RecordingModel,
    batch_digest,
    fit_in_a_plain_script,
    fit_records,
    quiet_trainer,
    real_rows,
)

_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
DOCS = [f"{i} " + " ".join(random.Random(i).choices(_WORDS, k=3 + i % 17)) for i in range(300)]
SEQ_LEN, BATCH = 8, 4


def trained_tokenizer(root: Path) -> str:
    (root / "corpus.txt").write_text("\n".join(DOCS))
    return str(train_tokenizer([root / "corpus.txt"], root / "tokenizer", vocab_size=300))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return trained_tokenizer(tmp_path_factory.mktemp("tok"))


def parquet(root: Path, files: int, row_group: int, docs: list[str] = DOCS) -> list[str]:
    """``docs`` over ``files`` parquet files of ``row_group``-row groups."""
    paths = []
    for i, part in enumerate(np.array_split(np.array(docs, dtype=object), files)):
        path = root / f"part{i}.parquet"
        pq.write_table(pa.table({"text": list(part)}), path, row_group_size=row_group)
        paths.append(str(path))
    return paths


def jsonl(root: Path, files: int, docs: list[str] = DOCS) -> list[str]:
    paths = []
    for i, part in enumerate(np.array_split(np.array(docs, dtype=object), files)):
        path = root / f"part{i}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        paths.append(str(path))
    return paths


def stream_dm(tokenizer: str, path: str = "parquet", data_files=None, **kwargs) -> HFTextDataModule:
    options = {"seq_len": SEQ_LEN, "batch_size": BATCH, "streaming": True, "shuffle_rows": 16}
    return HFTextDataModule(path, tokenizer, data_files=data_files, **{**options, **kwargs})


def stream_of(tmp_path: Path, tokenizer: str, layout: str) -> TextStream:
    if layout == "parquet, one file of 2 row groups":
        dm = stream_dm(tokenizer, data_files=parquet(tmp_path, 1, row_group=150))
    elif layout == "parquet, many small row groups":
        dm = stream_dm(tokenizer, data_files=parquet(tmp_path, 3, row_group=7))
    elif layout == "save_to_disk":
        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(tmp_path / "saved")
        dm = stream_dm(tokenizer, str(tmp_path / "saved"))
    else:
        dm = stream_dm(tokenizer, "json", data_files=jsonl(tmp_path, 5))
    return dm.build_stream()


@pytest.mark.parametrize(
    "layout", ["parquet, one file of 2 row groups", "parquet, many small row groups", "save_to_disk", "json files"]
)
def test_four_readers_read_every_document_exactly_once_per_pass(tmp_path: Path, tokenizer: str, layout: str) -> None:
    stream = stream_of(tmp_path, tokenizer, layout)  # 2 ranks x 2 workers
    for pass_ in (0, 1):
        read = [list(stream.documents(reader, 4, pass_)) for reader in range(4)]
        assert Counter(doc for docs in read for doc in docs) == Counter(DOCS)
        assert all(read)  # no idle reader: too few row groups are cut into row ranges
    assert list(stream.documents(0, 4, 0)) != list(stream.documents(0, 4, 1))  # each pass reshuffled


def test_a_reader_packs_its_documents_into_consecutive_windows(tmp_path: Path, tokenizer: str) -> None:
    stream = stream_of(tmp_path, tokenizer, "parquet, many small row groups")
    encode = DocumentTokenizer(tokenizer)
    expected = np.concatenate([encode(list(stream.documents(1, 4, p)))[0] for p in (0, 1)])
    batches = stream.read(1, 4, None)
    trained = np.concatenate([raw["tokens"][:, :-1].ravel() for raw, _ in (next(batches) for _ in range(40))])
    assert len(trained) < len(expected)  # into the second pass
    assert trained.tolist() == expected[: len(trained)].tolist()


@pytest.mark.parametrize("layout", ["parquet, many small row groups", "json files"])
def test_two_workers_yield_their_readers_batches_in_turn(tmp_path: Path, tokenizer: str, layout: str) -> None:
    data = {"path": "json", "data_files": jsonl(tmp_path, 2)}
    if layout.startswith("parquet"):
        data = {"data_files": parquet(tmp_path, 3, row_group=7)}
    dm = stream_dm(tokenizer, num_workers=2, **data)
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    trained = [next(loader)["input_ids"] for _ in range(20)]
    stream = stream_dm(tokenizer, **data).build_stream()
    readers = [stream.read(worker, 2, None) for worker in (0, 1)]
    expected = [stream.to_batch(next(readers[i % 2])[0])["input_ids"] for i in range(20)]
    assert all((a == b).all() for a, b in zip(trained, expected, strict=True))


def fit(dm: HFTextDataModule, max_steps: int, ckpt_dir: Path | None = None, resume: Path | None = None) -> list[dict]:
    records = fit_records(dm, max_steps, ckpt_dir, resume, every=7, num_sanity_val_steps=0)
    return [{"step": r["step"], "digest": r["digest"]} for r in records]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("steps_per_epoch", [None, 5])
def test_resume_through_fit_trains_identical_batches(
    tmp_path: Path, tokenizer: str, workers: int, steps_per_epoch: int | None
) -> None:
    files = parquet(tmp_path, 2, row_group=20)

    def dm() -> HFTextDataModule:
        return stream_dm(tokenizer, data_files=files, num_workers=workers, steps_per_epoch=steps_per_epoch)

    uninterrupted = fit(dm(), 60)  # about two passes of each reader
    stopped = fit(dm(), 9, ckpt_dir=tmp_path / "ckpt")
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=7.ckpt")
    resumed = fit(dm(), 60, resume=checkpoint)
    assert stopped[:7] + resumed == uninterrupted


def read_resized(stream: TextStream, stages: list[tuple[int, list[int] | None]]) -> tuple[Counter, list[tuple]]:
    """Readers of ``stream`` in ``stages`` of ``(readers, batches each reads)``, the states dealt to the
    next stage's readers in between (``redeal``); the last stage reads until its work items are done.
    Returns the tokens trained (every batch's inputs, and the tokens the last readers hold, which the
    next batches would train) and the last readers' cursors."""
    trained: Counter = Counter()
    states: dict = {}
    for stage, (readers, batches) in enumerate(stages):
        if stage:
            states = stream.redeal(states, stages[stage - 1][0], readers)
        last = stage == len(stages) - 1
        for reader in range(readers):
            batches_read = stream.read(reader, readers, states.get(reader))
            for count in itertools.count(1):
                raw, states[reader] = next(batches_read)
                trained.update(raw["tokens"][:, :-1].ravel().tolist())
                if (batches is not None and count == batches[reader]) or (last and not len(states[reader]["work"])):
                    break
            if last:
                trained.update(states[reader]["tokens"].tolist())
    cursors = [tuple(int(states[r][k]) for k in ("pass", "unit", "block", "row")) for r in range(stages[-1][0])]
    return trained, cursors


def expected_tokens(stream: TextStream, readers: int, cursors: list[tuple]) -> Counter:
    """Every document's tokens once for each pass before the cursors' pass, and those of the documents
    each reader read in it."""
    (pass_,) = {cursor[0] for cursor in cursors}
    texts = DOCS * pass_
    for reader, cursor in enumerate(cursors):
        for where, text in stream._documents_from(reader, readers, (pass_, 0, 0, 0), [0]):
            texts.append(text)
            if where == cursor:
                break
    return Counter(DocumentTokenizer(stream.tokenizer)(texts)[0].tolist())


@pytest.mark.parametrize("layout", ["parquet, many small row groups", "json files"])
@pytest.mark.parametrize(
    "stages",
    [
        [(4, [3, 5, 2, 7]), (1, None)],
        [(4, [3, 5, 2, 7]), (3, None)],
        [(2, [6, 1]), (4, None)],
        [(4, [3, 5, 2, 7]), (3, [2, 4, 1]), (2, None)],
    ],
    ids=["4 to 1", "4 to 3", "2 to 4", "4 to 3 to 2"],
)
def test_readers_changed_mid_pass_read_every_document_once(
    tmp_path: Path, tokenizer: str, layout: str, stages: list
) -> None:
    stream = stream_of(tmp_path, tokenizer, layout)
    trained, cursors = read_resized(stream, stages)
    assert trained == expected_tokens(stream, stages[-1][0], cursors)
    # The new readers begin their own passes after every pass the old ones had begun.
    assert {cursor[0] for cursor in cursors} == {len(stages) - 1}


def stream_state(checkpoint: Path) -> dict:
    """The stream state a checkpoint holds."""
    import torch

    saved = torch.load(checkpoint, weights_only=False)
    (state,) = [value["stream"] for value in saved.values() if isinstance(value, dict) and "stream" in value]
    return state


def resumed_batches(stream: TextStream, checkpoint: Path, ranks: int, workers: int, steps: int) -> list[list[dict]]:
    """Each rank's batches after resuming ``checkpoint`` on ``ranks`` x ``workers``: its readers' states dealt
    by ``redeal``, read in turn from the one whose batch comes next."""
    state = stream_state(checkpoint)
    if state["unit_parts"]:
        stream.cut_units(state["unit_parts"])
    readers = ranks * workers
    states = stream.redeal(state["readers"], state["ranks"] * state["workers"], readers)
    batches = []
    for rank in range(ranks):
        mine = [stream.read(rank * workers + w, readers, states.get(rank * workers + w)) for w in range(workers)]
        first = state["batches"] % workers
        batches.append([stream.to_batch(next(mine[(first + i) % workers])[0]) for i in range(steps)])
    return batches


@pytest.mark.parametrize("workers", [0, 3])
def test_a_checkpoint_of_other_workers_resumes_with_its_readers_work_dealt_to_these(
    tmp_path: Path, tokenizer: str, workers: int
) -> None:
    files = parquet(tmp_path, 2, row_group=20)
    fit(stream_dm(tokenizer, data_files=files, num_workers=2), 7, ckpt_dir=tmp_path / "ckpt")
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=7.ckpt")
    resumed = fit(stream_dm(tokenizer, data_files=files, num_workers=workers), 20, resume=checkpoint)
    stream = stream_dm(tokenizer, data_files=files).build_stream()
    (expected,) = resumed_batches(stream, checkpoint, 1, max(1, workers), 13)
    assert [r["digest"] for r in resumed] == [batch_digest(batch) for batch in expected]


def test_more_readers_than_units_after_a_change_is_refused_naming_both(tmp_path: Path, tokenizer: str) -> None:
    files = jsonl(tmp_path, 2)  # 2 files: 2 units
    fit(stream_dm(tokenizer, "json", data_files=files, num_workers=2), 7, ckpt_dir=tmp_path / "ckpt")
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=7.ckpt")
    message = (
        r"read by 1 ranks x 2 workers and cannot be dealt to 1 x 3: the stream has 2 units \(files, row groups "
        r"or row ranges\) for 3 readers; use fewer ranks or workers"
    )
    with pytest.raises(ValueError, match=message):
        fit(stream_dm(tokenizer, "json", data_files=files, num_workers=3), 10, resume=checkpoint)


def test_the_stream_state_holds_every_reader_and_a_changed_stream_is_refused(tmp_path: Path, tokenizer: str) -> None:
    files = parquet(tmp_path, 2, row_group=20)
    dm = stream_dm(tokenizer, data_files=files)
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    for _ in range(3):
        next(loader)
    state = dm.state_dict()["stream"]
    assert (state["ranks"], state["workers"], state["batches"], list(state["readers"])) == (1, 1, 3, [0])
    other = stream_dm(tokenizer, data_files=files, seed=1)
    other.setup("fit")
    with pytest.raises(ValueError, match="the stream differs from the checkpoint's"):
        other.load_state_dict(dm.state_dict())


def test_more_workers_than_stream_shards_warns_of_the_idle_ones_and_duplicates_nothing(
    tmp_path: Path, tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    dm = stream_dm(tokenizer, "json", data_files=jsonl(tmp_path, 1, DOCS[:40]), num_workers=2)
    dm.setup("fit")
    with caplog.at_level(logging.WARNING, "datamodules.plan.stream"):
        batches = iter(dm.train_dataloader())
        trained = np.concatenate([next(batches)["input_ids"].numpy().ravel() for _ in range(40)])
    assert "idle: rank 0 worker 1" in caplog.text
    # Worker 0 alone reads the one file, pass after pass; worker 1 reads nothing (no duplicate).
    encode = DocumentTokenizer(tokenizer)
    passes = np.concatenate([encode(list(dm._stream.stream.documents(0, 2, p)))[0] for p in range(4)])
    assert len(trained) > len(encode(DOCS[:40])[0])  # past the first pass
    assert trained.tolist() == passes[: len(trained)].tolist()


# Bad input: each a clear error at setup, or naming the row that is read


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk", "json"])
def test_a_text_field_that_is_not_a_column_lists_the_columns(tmp_path: Path, tokenizer: str, layout: str) -> None:
    table = {"body": DOCS[:10]}
    if layout == "parquet":
        pq.write_table(pa.table(table), tmp_path / "d.parquet")
        dm = stream_dm(tokenizer, data_files=str(tmp_path / "d.parquet"))
    elif layout == "save_to_disk":
        datasets.Dataset.from_dict(table).save_to_disk(tmp_path / "saved")
        dm = stream_dm(tokenizer, str(tmp_path / "saved"))
    else:
        (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[:10]))
        dm = stream_dm(tokenizer, "json", data_files=str(tmp_path / "d.jsonl"))
    with pytest.raises(ValueError, match=r"has no column 'text'; columns are \['body'\]"):
        dm.setup("fit")


def test_a_null_text_names_the_row_and_the_argument_that_skips_it(tmp_path: Path, tokenizer: str) -> None:
    pq.write_table(pa.table({"text": ["a", "b", None, "c"] * 10}), tmp_path / "d.parquet", row_group_size=8)
    dm = stream_dm(tokenizer, data_files=str(tmp_path / "d.parquet"), shuffle_rows=100)
    dm.setup("fit")
    skip = "on_bad_row='skip' counts and skips such rows"
    with pytest.raises(ValueError, match=rf"d.parquet row group \d row 2: text field 'text' is null; {skip}$"):
        next(iter(dm.train_dataloader()))


def test_an_empty_split_is_an_error(tmp_path: Path, tokenizer: str) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(PrepareError, match="no documents in split 'train' of 'parquet'"):
        stream_dm(tokenizer, data_files=str(tmp_path / "empty.parquet")).setup("fit")


def test_an_endless_stream_without_max_steps_is_an_error_before_training(tmp_path: Path, tokenizer: str) -> None:
    dm = stream_dm(tokenizer, data_files=parquet(tmp_path, 1, row_group=50))
    with pytest.raises(ValueError, match=r"needs Trainer\(max_steps=N\), or steps_per_epoch=N"):
        quiet_trainer(max_epochs=1).fit(RecordingModel(), datamodule=dm)


def held_out_stream(tmp_path: Path, tokenizer: str, layout: str) -> TextStream:
    tmp_path.mkdir()
    if layout == "parquet":
        data = {"data_files": parquet(tmp_path, 3, row_group=7)}
    else:
        data = {"path": "json", "data_files": jsonl(tmp_path, 5)}
    return stream_dm(tokenizer, val_fraction=0.1, test_fraction=0.05, **data).build_stream()


def test_a_stream_holds_out_the_same_documents_however_it_is_cut_and_its_readers_never_read_them(
    tmp_path: Path, tokenizer: str
) -> None:
    streams = {layout: held_out_stream(tmp_path / layout, tokenizer, layout) for layout in ("parquet", "json")}
    held = {
        layout: {role: stream.held_out_documents(role) for role in ("validation", "test")}
        for layout, stream in streams.items()
    }
    # The same documents from 45 parquet row groups as from 5 JSON files: chosen by their text alone.
    assert {role: Counter(docs) for role, docs in held["parquet"].items()} == {
        role: Counter(docs) for role, docs in held["json"].items()
    }
    validation, test = held["parquet"]["validation"], held["parquet"]["test"]
    assert not set(validation) & set(test)
    assert 10 <= len(validation) <= 50 and 3 <= len(test) <= 30  # 10% and 5% of 300 documents
    trained = Counter(DOCS) - Counter(validation) - Counter(test)
    for stream in streams.values():
        for readers in (1, 4):  # one process, or 2 ranks x 2 workers
            for pass_ in (0, 1):
                read = Counter(doc for r in range(readers) for doc in stream.documents(r, readers, pass_))
                assert read == trained


def test_a_stream_validates_on_every_held_out_document_once(tmp_path: Path, tokenizer: str) -> None:
    files = parquet(tmp_path, 3, row_group=7)
    dm = stream_dm(tokenizer, data_files=files, val_fraction=0.1, num_workers=2)
    dm.setup("fit")
    windows = [batch["input_ids"][real_rows(batch)] for batch in dm.val_dataloader()]  # padding rows aside
    held = dm.build_stream().held_out_documents("validation")
    expected = DocumentTokenizer(tokenizer)(held)[0].tolist()
    validated = [token for rows in windows for row in rows.tolist() for token in row]
    assert validated == expected[: len(validated)] and len(expected) - len(validated) < SEQ_LEN + 1


def test_a_fraction_that_holds_out_no_document_is_an_error_at_setup(tmp_path: Path, tokenizer: str) -> None:
    dm = stream_dm(tokenizer, data_files=parquet(tmp_path, 1, row_group=50), val_fraction=1e-9)
    with pytest.raises(ValueError, match=r"val_fraction=1e-09 holds out no document of 'parquet': use a larger"):
        dm.setup("fit")


def test_empty_texts_are_skipped_and_on_bad_row_skip_skips_nulls(
    tmp_path: Path, tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    texts = [None if i % 7 == 3 else ("" if i % 5 == 0 else d) for i, d in enumerate(DOCS[:60])]
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=20)
    dm = stream_dm(tokenizer, data_files=str(tmp_path / "d.parquet"), on_bad_row="skip")
    stream = dm.build_stream()
    read = list(stream.documents(0, 1, 0))
    assert sorted(read) == sorted(t for t in texts if t)
    with caplog.at_level(logging.INFO):
        for _ in zip(range(40), stream.read(0, 1, None), strict=False):
            pass
    skipped = sum(1 for t in texts if not t)
    assert f"stream reader 0 skipped {skipped} empty texts or rows without text in pass 0" in caplog.text


def test_a_dropped_loader_is_freed_at_once_and_its_workers_with_it(tmp_path: Path, tokenizer: str) -> None:
    # Freed by its reference count, not by the cycle collector: a reference cycle through the loader
    # once had the collector close the workers' queues before their shutdown, and each worker waited
    # out torch's 5 s join (10 s for every dropped loader).
    import gc
    import multiprocessing
    import weakref

    dm = stream_dm(tokenizer, data_files=parquet(tmp_path, 2, row_group=20), num_workers=2, steps_per_epoch=5)
    dm.setup("fit")
    loader = dm.train_dataloader()
    for _ in range(2):
        assert len(list(loader)) == 5
    workers = [p for p in multiprocessing.active_children() if p.is_alive()]
    assert len(workers) == 2
    freed = weakref.ref(loader)
    gc.disable()
    try:
        del loader, dm
        assert freed() is None
        assert not any(w.is_alive() for w in workers)
    finally:
        gc.enable()


def test_fit_on_a_stream_shows_its_data_summary_in_a_plain_script(tmp_path: Path, tokenizer: str) -> None:
    files = parquet(tmp_path, 3, row_group=50)
    options = "seq_len=8, batch_size=4, streaming=True, num_workers=2"
    shown, table = fit_in_a_plain_script(
        f"HFTextDataModule('parquet', {tokenizer!r}, data_files={files!r}, {options})", 5
    )
    assert "HFTextDataModule: a stream, endless epochs of 4 samples (batch_size 4 x 1 data-parallel ranks" in shown
    assert table[0] == ["Source", "Data", "Readers", "Idle readers", "Samples in max_steps=5", "Tokens in max_steps=5"]
    assert table[1] == [
        "0",
        "train",
        "6 row groups of 3 parquet files, 300 rows",
        "2 (1 ranks x 2 workers)",
        "0",
        "20",
        "160",
    ]
