"""HFTextDataModule(streaming=True) under real 2-process DDP on CPU (gloo), 2 DataLoader workers each,
over parquet files (row groups) and JSON-lines files (whole files): every rank trains exactly its
readers' batches, a resume from a checkpoint is token-exact, and a resume on 4 ranks (real processes)
or on 1 rank with 1 or 3 workers trains what the old readers had not, dealt to the new ones
(``TextStream.redeal``, whose exactness by the tokens trained test_hf_stream.py shows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from datamodules import HFTextDataModule
from tests.distributed_support import Run, train_record
from tests.support import RecordingModel, quiet_trainer, row_digest
from tests.text.test_hf_stream import BATCH, SEQ_LEN, jsonl, parquet, resumed_batches, trained_tokenizer

STEPS = 12


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return trained_tokenizer(tmp_path_factory.mktemp("tok"))


Data = tuple[str, list[str]]  # the load_dataset builder and the files


def ddp(root: Path, data: Data, tokenizer: str, *extra: str) -> Run:
    args = ["--hf-files", f"{data[0]}:{','.join(data[1])}", "--tokenizer", tokenizer, "--streaming", "--workers", "2"]
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--devices", "2", "--strategy", "ddp"]
    return train_record([*args, "--max-steps", str(STEPS), *extra], root)


def rows(run: Run, rank: int) -> list[list[str]]:
    return [record["rows"] for record in run.records(rank)]


def stream_dm(data: Data, tokenizer: str, **kwargs) -> HFTextDataModule:
    return HFTextDataModule(data[0], tokenizer, SEQ_LEN, BATCH, data_files=data[1], streaming=True, **kwargs)


def expected_rows(data: Data, tokenizer: str, rank: int) -> list[list[str]]:
    """Rank ``rank``'s batches, from its two readers (of 2 ranks x 2 workers) taken in turn."""
    stream = stream_dm(data, tokenizer).build_stream()
    readers = [stream.read(rank * 2 + worker, 4, None) for worker in (0, 1)]
    batches = [next(readers[i % 2])[0] for i in range(STEPS)]
    return [[row_digest(row) for row in stream.to_batch(raw)["input_ids"]] for raw in batches]


@pytest.fixture(scope="module", params=["parquet", "json"])
def first_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer: str
) -> tuple[Run, Data]:
    root = tmp_path_factory.mktemp("ddp_stream")
    # 12 row groups, or 6 files, for 4 readers.
    data = ("parquet", parquet(root, 3, row_group=25)) if request.param == "parquet" else ("json", jsonl(root, 6))
    return ddp(root / "run", data, tokenizer, "--every-n-steps", "4"), data


def test_each_ddp_rank_trains_its_own_readers_batches_in_turn(first_run: tuple[Run, Data], tokenizer: str) -> None:
    run, data = first_run
    for rank in (0, 1):
        assert rows(run, rank) == expected_rows(data, tokenizer, rank)
    assert not set(map(tuple, rows(run, 0))) & set(map(tuple, rows(run, 1)))


def test_a_ddp_resume_trains_the_uninterrupted_batches(
    first_run: tuple[Run, Data], tokenizer: str, tmp_path: Path
) -> None:
    run, data = first_run
    resumed = ddp(tmp_path, data, tokenizer, "--resume", str(run.checkpoint(4)))
    for rank in (0, 1):
        assert rows(resumed, rank) == rows(run, rank)[4:]


def expected_after(run: Run, data: Data, tokenizer: str, ranks: int, workers: int) -> list[list[list[str]]]:
    """Each rank's rows after resuming ``run``'s step-4 checkpoint on ``ranks`` x ``workers`` (``redeal``)."""
    stream = stream_dm(data, tokenizer).build_stream()
    batches = resumed_batches(stream, run.checkpoint(4), ranks, workers, STEPS - 4)
    return [[[row_digest(row) for row in batch["input_ids"]] for batch in rank] for rank in batches]


def test_a_ddp_checkpoint_resumes_on_four_ranks_with_its_readers_work_dealt_to_them(
    first_run: tuple[Run, Data], tokenizer: str, tmp_path: Path
) -> None:
    run, data = first_run
    args = ["--hf-files", f"{data[0]}:{','.join(data[1])}", "--tokenizer", tokenizer, "--streaming", "--workers", "0"]
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--devices", "4", "--strategy", "ddp"]
    resumed = train_record([*args, "--max-steps", str(STEPS), "--resume", str(run.checkpoint(4))], tmp_path)
    assert [rows(resumed, rank) for rank in range(4)] == expected_after(run, data, tokenizer, 4, 1)


@pytest.mark.parametrize("workers", [0, 3])
def test_a_ddp_checkpoint_resumes_on_one_rank_with_its_readers_work_dealt_to_it(
    first_run: tuple[Run, Data], tokenizer: str, workers: int
) -> None:
    run, data = first_run
    dm = stream_dm(data, tokenizer, num_workers=workers)
    model = RecordingModel()
    quiet_trainer(max_steps=STEPS, num_sanity_val_steps=0).fit(model, datamodule=dm, ckpt_path=run.checkpoint(4))
    assert [[record["rows"] for record in model.records]] == expected_after(run, data, tokenizer, 1, max(1, workers))
