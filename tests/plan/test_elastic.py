"""Elastic resume onto more ranks, off the new run's grid: no padding row, no position lost or repeated.

Real runs (``tests/scripts/train_record.py``, gloo on CPU, default Trainer flags). A run on 1 rank is
stopped at a step whose position is not a multiple of the 2-rank global batch, then resumed on 2 ranks.

Token shards: 172 windows of 32 tokens, 4 per rank; 11 steps on 1 rank end at position 44. An epoch
is 43 steps on 1 rank (positions [0, 172)) and 21 on 2 (168 positions). The resumed epoch ends where
the checkpoint's does, rounded up to whole 2-rank steps: 16 steps, [44, 172); the next epoch starts at
172. Nothing is padded, nothing skipped.

Mixture: sources of 100,020 / 50,021 / 3,007 tokens (3,125 / 1,563 / 93 windows of 32), weights
0.5 / 0.25 / 0.25, phases at steps 12 and 30, 4 rows per rank, ``accumulate_grad_batches=2``, 2
workers. 13 steps on 1 rank (global batch 8) end at position 104; on 2 ranks a global batch is 16.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from datamodules import SamplePlan, TokenShardDataModule
from datamodules.mixture import mixture_probabilities
from datamodules.plan.sample_plan import PlannedSource, Segment
from tests.distributed_support import Run, assert_positions_consumed_once, train_record
from tests.support import make_token_shards

SEQ_LEN, BATCH = 32, 4
WINDOWS, STOP = 172, 11  # 11 steps on 1 rank: position 44


def micro_batches(run: Run, dp_size: int, first_position: int) -> Iterator[tuple[int, int, dict]]:
    """``(global micro-batch, first position of this rank's rows, record)`` of every batch trained:
    micro-batch ``i`` after the resume covers ``first_position + i * BATCH * dp_size`` on."""
    for rank in range(dp_size):
        for i, record in enumerate(run.records(rank)):
            yield i, first_position + (i * dp_size + rank) * BATCH, record


def consumed(run: Run, dp_size: int, first_position: int, sample) -> dict[int, object]:
    """``{plan position: sample(row start)}`` of every row the run trained; a position trained twice fails."""
    out: dict[int, object] = {}
    for _, first, record in micro_batches(run, dp_size, first_position):
        assert len(record["starts"]) == BATCH, "a padding row was trained"
        for offset, start in enumerate(record["starts"]):
            assert first + offset not in out, f"position {first + offset} trained twice"
            out[first + offset] = sample(start)
    return out


# Token shards ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_token_shards(tmp_path_factory.mktemp("shards"), WINDOWS * SEQ_LEN + 1, shard_tokens=1000)


def train_shards(shards: Path, root: Path, *args: str) -> Run:
    base = ["--data", str(shards), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH)]
    return train_record([*base, *args], root)


@pytest.fixture(scope="module")
def one_rank(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """1 rank, a checkpoint at step 11 (position 44), "killed" at step 13."""
    return train_shards(shards, tmp_path_factory.mktemp("one_rank"), "--max-steps", "13", "--every-n-steps", str(STOP))


@pytest.fixture(scope="module")
def window_at(shards: Path):
    datamodule = TokenShardDataModule(shards, seq_len=SEQ_LEN, batch_size=BATCH)
    datamodule.setup("fit")
    datamodule.train_dataloader()
    return lambda n: datamodule.plan.locate(np.arange(n))[1].tolist()


@pytest.mark.parametrize(
    ("limit", "workers", "end"),
    [(("--max-steps", "51"), 0, 44 + 40 * 8), (("--max-steps", "51"), 2, 364), (("--max-epochs", "1"), 0, WINDOWS)],
    ids=["max_steps-workers0", "max_steps-workers2", "max_epochs-workers0"],
)
def test_token_shards_resumed_on_more_ranks_train_every_position_once_without_padding(
    one_rank: Run, shards: Path, window_at, tmp_path: Path, limit: tuple[str, str], workers: int, end: int
) -> None:
    devices = ["--devices", "2", "--strategy", "ddp", "--workers", str(workers)]
    resumed = train_shards(shards, tmp_path, *limit, *devices, "--resume", str(one_rank.checkpoint(STOP)))
    window = lambda start: start // SEQ_LEN  # noqa: E731 (a row's first token is its window's offset)
    before = {p: window(s) for p, s in enumerate(s for r in one_rank.records(0)[:STOP] for s in r["starts"])}
    after = consumed(resumed, 2, STOP * BATCH, window)
    # Exactly plan positions [44, end) after the resume: as an uninterrupted 1-rank run of ``end`` samples.
    assert sorted(after) == list(range(STOP * BATCH, end))
    assert_positions_consumed_once([before, after], end, window_at)
    assert resumed.info(0)["positions_consumed"] == resumed.info(1)["positions_consumed"] == end
    if limit[0] == "--max-epochs":  # one epoch: every window exactly once, as on 1 rank
        assert sorted([*before.values(), *after.values()]) == list(range(WINDOWS))


# Mixture with phases ------------------------------------------------------------------------------

MIX_TOKENS = {"web": 100_020, "code": 50_021, "math": 3_007}
MIX_WEIGHTS = {"web": 0.5, "code": 0.25, "math": 0.25}
PHASES = [
    {"start_step": 12, "dataset_weights": {"web": 0.2, "math": 0.6}},
    {"start_step": 30, "dataset_weights": {"web": 0.0, "code": 0.1, "math": 0.9}},
]
MIX_STOP, MIX_STEPS, MIX_RESTART = 13, 38, 20  # 1 rank to 13; 2 ranks 13 -> 38; the 2-rank checkpoint at 20
ID = 10**6  # source s holds token values from s * ID


def probabilities(phase: int) -> tuple[float, ...]:
    weights = {**MIX_WEIGHTS, **(PHASES[phase - 1]["dataset_weights"] if phase else {})}
    return mixture_probabilities([weights[n] for n in MIX_TOKENS], 1.0)


@pytest.fixture(scope="module")
def mixture_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture")
    return {
        name: make_token_shards(root / name, tokens, shard_tokens=20_000, first_value=i * ID)
        for i, (name, tokens) in enumerate(MIX_TOKENS.items())
    }


def train_mixture(dirs: dict[str, Path], root: Path, *args: str) -> Run:
    mixture = ",".join(f"{n}={dirs[n]}:{w}" for n, w in MIX_WEIGHTS.items())
    base = ["--mixture", mixture, "--phases", json.dumps(PHASES), "--seq-len", str(SEQ_LEN)]
    base += ["--batch-size", str(BATCH), "--accumulate", "2", "--workers", "2"]
    return train_record([*base, *args], root)


@pytest.fixture(scope="module")
def mixture_one_rank(mixture_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("mixture_one_rank")
    return train_mixture(mixture_dirs, root, "--max-steps", "15", "--every-n-steps", str(MIX_STOP))


@pytest.fixture(scope="module")
def mixture_two_ranks(
    mixture_dirs: dict[str, Path], mixture_one_rank: Run, tmp_path_factory: pytest.TempPathFactory
) -> Run:
    root = tmp_path_factory.mktemp("mixture_two_ranks")
    ddp = ["--devices", "2", "--strategy", "ddp", "--every-n-steps", str(MIX_RESTART)]
    resume = ["--resume", str(mixture_one_rank.checkpoint(MIX_STOP))]
    return train_mixture(mixture_dirs, root, "--max-steps", str(MIX_STEPS), *ddp, *resume)


@pytest.fixture(scope="module")
def mixture_plan(mixture_dirs: dict[str, Path]) -> SamplePlan:
    """The plan the resumed run follows: blocks of 8 up to position 104, of 16 after it."""
    sizes = {name: (tokens - 1) // SEQ_LEN for name, tokens in MIX_TOKENS.items()}
    sources = tuple(PlannedSource(name, n, "") for name, n in sizes.items())
    resume = MIX_STOP * 8
    segments = (
        Segment(0, 8, probabilities(0)),
        Segment(12 * 8, 8, probabilities(1)),
        Segment(resume, 16, probabilities(1)),
        Segment(resume + (30 - MIX_STOP) * 16, 16, probabilities(2)),
    )
    return SamplePlan(sources, seed=0, segments=segments)


def row_sample(start: int) -> tuple[int, int]:
    return start // ID, start % ID // SEQ_LEN


def test_a_mixture_resumed_on_more_ranks_continues_the_plan_with_every_global_batch_whole(
    mixture_one_rank: Run, mixture_two_ranks: Run, mixture_plan: SamplePlan
) -> None:
    resume = MIX_STOP * 8
    before = consumed(mixture_one_rank, 1, 0, row_sample)
    before = {p: sample for p, sample in before.items() if p < resume}
    after = consumed(mixture_two_ranks, 2, resume, row_sample)
    end = resume + (MIX_STEPS - MIX_STOP) * 16
    assert sorted(after) == list(range(resume, end))

    def planned(n: int) -> list[tuple[int, int]]:
        sources, windows = mixture_plan.locate(np.arange(n))
        return list(zip(sources.tolist(), windows.tolist(), strict=True))

    assert_positions_consumed_once([before, after], end, planned)
    # Every global batch after the resume holds 16 rows with the counts its block is due, each the
    # floor or ceiling of its share; the counts so far are the plan's.
    per_step: dict[int, np.ndarray] = {}
    for _, _, record in micro_batches(mixture_two_ranks, 2, resume):
        rows = np.bincount([row_sample(s)[0] for s in record["starts"]], minlength=3)
        per_step[record["step"]] = per_step.get(record["step"], 0) + rows
    assert sorted(per_step) == list(range(MIX_STOP, MIX_STEPS))
    for step, rows in per_step.items():
        position = resume + (step - MIX_STOP) * 16
        due = mixture_plan.samples_drawn(position + 16) - mixture_plan.samples_drawn(position)
        assert rows.tolist() == due.tolist(), f"step {step}"
        shares = np.array(probabilities(0 if step < 12 else 1 if step < 30 else 2)) * 16
        assert (np.floor(shares) <= rows).all() and (rows <= np.ceil(shares)).all(), f"step {step}"
    cumulative = sum(per_step.values()) + np.bincount([s for s, _ in before.values()], minlength=3)
    assert cumulative.tolist() == mixture_plan.samples_drawn(end).tolist()


def test_a_mixture_resumed_mid_phase_on_2_ranks_repeats_the_uninterrupted_run(
    mixture_dirs: dict[str, Path], mixture_two_ranks: Run, tmp_path: Path
) -> None:
    """2-process DDP, accumulate_grad_batches=2, 2 workers: a stop at step 20 (mid phase) resumes exactly."""
    ddp = ["--devices", "2", "--strategy", "ddp", "--max-steps", str(MIX_STEPS)]
    resumed = train_mixture(mixture_dirs, tmp_path, *ddp, "--resume", str(mixture_two_ranks.checkpoint(MIX_RESTART)))
    for rank in range(2):
        expected = [r for r in mixture_two_ranks.records(rank) if r["step"] >= MIX_RESTART]
        assert [r["digest"] for r in resumed.records(rank)] == [r["digest"] for r in expected], f"rank {rank}"


SMALL = {"web": 60 * SEQ_LEN + 1, "code": 30 * SEQ_LEN + 1, "math": 10 * SEQ_LEN + 1}  # 100 windows


def test_a_mixture_resumed_on_more_ranks_with_max_epochs_ends_its_epoch_on_whole_global_batches(
    tmp_path: Path,
) -> None:
    """100 windows, weights 0.5 / 0.25 / 0.25, no workers: an epoch is 12 steps of 8 on 1 rank. Stopped at
    step 5 (position 40) and resumed on 2 ranks (global batch 16) with max_epochs=1: the epoch ends at 96
    rounded up to whole steps, [40, 104), every global batch of 16 with its due counts."""
    dirs = {
        name: make_token_shards(tmp_path / name, tokens, first_value=i * ID)
        for i, (name, tokens) in enumerate(SMALL.items())
    }
    mixture = ",".join(f"{n}={dirs[n]}:{w}" for n, w in MIX_WEIGHTS.items())
    base = ["--mixture", mixture, "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--accumulate", "2"]
    stopped = train_record([*base, "--max-steps", "7", "--every-n-steps", "5"], tmp_path / "stopped")
    ddp = ["--devices", "2", "--strategy", "ddp", "--max-epochs", "1", "--resume", str(stopped.checkpoint(5))]
    resumed = train_record([*base, *ddp], tmp_path / "resumed")
    after = consumed(resumed, 2, 40, row_sample)
    assert sorted(after) == list(range(40, 104))
    # Two micro-batches a step, aligned with the blocks of 16: the optimizer steps at every block's end.
    assert [r["step"] for r in resumed.records(0)] == [5 + i // 2 for i in range(8)]
    sizes = {name: (tokens - 1) // SEQ_LEN for name, tokens in SMALL.items()}
    sources = tuple(PlannedSource(name, n, "") for name, n in sizes.items())
    plan = SamplePlan(sources, segments=(Segment(0, 8, probabilities(0)), Segment(40, 16, probabilities(0))))
    before = {p: s for p, s in consumed(stopped, 1, 0, row_sample).items() if p < 40}
    planned = lambda n: list(zip(*(a.tolist() for a in plan.locate(np.arange(n))), strict=True))  # noqa: E731
    assert_positions_consumed_once([before, after], 104, planned)
    assert resumed.info(0)["positions_consumed"] == resumed.info(1)["positions_consumed"] == 104
