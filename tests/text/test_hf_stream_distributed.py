"""HFTextDataModule(streaming=True) under real 2-process DDP on CPU (gloo), 2 DataLoader workers each:
every rank trains exactly its readers' batches, a resume from a checkpoint is token-exact, and a
resume on 4 ranks (real processes) or on 1 rank with 1 or 3 workers trains what the old readers had
not, dealt to the new ones (``TextStream.redeal``, whose exactness test_hf_stream.py shows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from datamodules import HFTextDataModule
from tests.distributed_support import Run, train_record
from tests.support import RecordingModel, quiet_trainer, row_digest
from tests.text.test_hf_stream import BATCH, SEQ_LEN, parquet, resumed_batches, trained_tokenizer

STEPS = 12


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return trained_tokenizer(tmp_path_factory.mktemp("tok"))


def ddp(root: Path, files: list[str], tokenizer: str, *extra: str) -> Run:
    args = ["--hf-parquet", ",".join(files), "--tokenizer", tokenizer, "--streaming", "--workers", "2"]
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--devices", "2", "--strategy", "ddp"]
    return train_record([*args, "--max-steps", str(STEPS), *extra], root)


def rows(run: Run, rank: int) -> list[list[str]]:
    return [record["rows"] for record in run.records(rank)]


def expected_rows(files: list[str], tokenizer: str, rank: int) -> list[list[str]]:
    """Rank ``rank``'s batches, from its two readers (of 2 ranks x 2 workers) taken in turn."""
    stream = HFTextDataModule("parquet", tokenizer, SEQ_LEN, BATCH, data_files=files, streaming=True).build_stream()
    readers = [stream.read(rank * 2 + worker, 4, None) for worker in (0, 1)]
    batches = [next(readers[i % 2])[0] for i in range(STEPS)]
    return [[row_digest(row) for row in stream.to_batch(raw)["input_ids"]] for raw in batches]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory, tokenizer: str) -> tuple[Run, list[str]]:
    root = tmp_path_factory.mktemp("ddp_stream")
    files = parquet(root, 3, row_group=25)  # 12 row groups for 4 readers
    return ddp(root / "run", files, tokenizer, "--every-n-steps", "4"), files


def test_each_ddp_rank_trains_its_own_readers_batches_in_turn(first_run: tuple[Run, list[str]], tokenizer: str) -> None:
    run, files = first_run
    for rank in (0, 1):
        assert rows(run, rank) == expected_rows(files, tokenizer, rank)
    assert not set(map(tuple, rows(run, 0))) & set(map(tuple, rows(run, 1)))


def test_a_ddp_resume_trains_the_uninterrupted_batches(
    first_run: tuple[Run, list[str]], tokenizer: str, tmp_path: Path
) -> None:
    run, files = first_run
    resumed = ddp(tmp_path, files, tokenizer, "--resume", str(run.checkpoint(4)))
    for rank in (0, 1):
        assert rows(resumed, rank) == rows(run, rank)[4:]


def expected_after(run: Run, files: list[str], tokenizer: str, ranks: int, workers: int) -> list[list[list[str]]]:
    """Each rank's rows after resuming ``run``'s step-4 checkpoint on ``ranks`` x ``workers`` (``redeal``)."""
    stream = HFTextDataModule("parquet", tokenizer, SEQ_LEN, BATCH, data_files=files, streaming=True).build_stream()
    batches = resumed_batches(stream, run.checkpoint(4), ranks, workers, STEPS - 4)
    return [[[row_digest(row) for row in batch["input_ids"]] for batch in rank] for rank in batches]


def test_a_ddp_checkpoint_resumes_on_four_ranks_with_its_readers_work_dealt_to_them(
    first_run: tuple[Run, list[str]], tokenizer: str, tmp_path: Path
) -> None:
    run, files = first_run
    args = ["--hf-parquet", ",".join(files), "--tokenizer", tokenizer, "--streaming", "--workers", "0"]
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--devices", "4", "--strategy", "ddp"]
    resumed = train_record([*args, "--max-steps", str(STEPS), "--resume", str(run.checkpoint(4))], tmp_path)
    assert [rows(resumed, rank) for rank in range(4)] == expected_after(run, files, tokenizer, 4, 1)


@pytest.mark.parametrize("workers", [0, 3])
def test_a_ddp_checkpoint_resumes_on_one_rank_with_its_readers_work_dealt_to_it(
    first_run: tuple[Run, list[str]], tokenizer: str, workers: int
) -> None:
    run, files = first_run
    dm = HFTextDataModule("parquet", tokenizer, SEQ_LEN, BATCH, data_files=files, streaming=True, num_workers=workers)
    model = RecordingModel()
    quiet_trainer(max_steps=STEPS, num_sanity_val_steps=0).fit(model, datamodule=dm, ckpt_path=run.checkpoint(4))
    assert [[record["rows"] for record in model.records]] == expected_after(run, files, tokenizer, 1, max(1, workers))
