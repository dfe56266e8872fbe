"""``MixtureDataModule`` + ``PhaseScheduler`` under real 2-process DDP on CPU (gloo), default Trainer flags.

Runs go through ``tests/scripts/train_record.py`` in subprocesses (``Trainer(accelerator="cpu",
devices=2, strategy="ddp")``). Three sources as in ``tests/test_mixture.py``: source ``i`` holds token
values from ``i * 10**6``, so a row's first token names its source and window. 5 rows per rank, so a
global batch of 10 on 2 ranks holds [5, 3, 2] rows of a, b, c, and [0, 3, 7] from the phase at step 5
on (which also halves the LR). One uninterrupted 2-rank run of 10 steps writes a checkpoint at step 3,
before the phase change; it is resumed past the change on the same 2 ranks and on 1 rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from datamodules import MixtureComponent, MixtureDataModule, SamplePlan, TokenShardSource
from datamodules.mixture import mixture_probabilities
from datamodules.plan.sample_plan import Segment
from tests.distributed_support import Run, assert_positions_consumed_once, train_record
from tests.support import make_mixture_shards

SEQ_LEN, BATCH, SEED, LR = 4, 5, 3, 0.01  # BATCH rows per rank; LR of RecordingModel's SGD
NAMES = ("a", "b", "c")
SIZES = {"a": 400, "b": 120, "c": 30}  # windows per source
BASE = {"a": 0.5, "b": 0.3, "c": 0.2}
PHASE_STEP, LR_SCALE = 5, 0.5
PHASES = [{"start_step": PHASE_STEP, "dataset_weights": {"a": 0.0, "c": 0.7}, "lr_scale": LR_SCALE}]
ANNEALED = {**BASE, **PHASES[0]["dataset_weights"]}
STEPS, K = 10, 3  # the checkpoint at step K is taken before the phase change
ID = 10**6


def probabilities(weights: dict[str, float]) -> tuple[float, ...]:
    return mixture_probabilities([weights[n] for n in NAMES], 1.0)


def counts(weights: dict[str, float], global_batch: int, block: int = 0) -> list[int]:
    """Rows per source of a segment's ``block``-th global batch under ``weights``."""
    return Segment(0, global_batch, probabilities(weights)).counts(np.array([block]))[0].tolist()


def sample(start: int) -> tuple[int, int]:
    """(source, window) of a row, from its first token."""
    return start // ID, start % ID // SEQ_LEN


def step_counts(run: Run, ranks: int) -> dict[int, list[int]]:
    """Rows per source of every step, summed over the ranks."""
    out: dict[int, np.ndarray] = {}
    for rank in range(ranks):
        for record in run.records(rank):
            rows = np.bincount([sample(s)[0] for s in record["starts"]], minlength=len(NAMES))
            out[record["step"]] = out.get(record["step"], 0) + rows
    return {step: rows.tolist() for step, rows in sorted(out.items())}


def consumed(
    run: Run, dp_size: int, *, first_step: int = 0, first_position: int = 0, before_step: int | None = None
) -> dict[int, tuple[int, int]]:
    """``{plan position: (source, window)}`` of every row trained, from the rank-slicing contract."""
    out: dict[int, tuple[int, int]] = {}
    for rank in range(dp_size):
        for record in run.records(rank):
            if before_step is not None and record["step"] >= before_step:
                continue
            first = first_position + (record["step"] - first_step) * BATCH * dp_size + rank * BATCH
            for offset, start in enumerate(record["starts"]):
                assert first + offset not in out, f"position {first + offset} trained twice"
                out[first + offset] = sample(start)
    return out


def planned(plan: SamplePlan):
    """``n -> [(source, window)]`` of the plan's first ``n`` positions."""
    return lambda n: list(zip(*(a.tolist() for a in plan.locate(np.arange(n))), strict=True))


def lrs(run: Run, rank: int) -> dict[int, float]:
    return {int(step): lr for step, lr in run.info(rank)["lr_by_step"].items()}


def expected_lrs(steps: range) -> dict[int, float]:
    return {s: LR * (LR_SCALE if s >= PHASE_STEP else 1.0) for s in steps}


@pytest.fixture(scope="module")
def shard_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_mixture_shards(tmp_path_factory.mktemp("mixture"), SIZES, SEQ_LEN, ID)


def train(shard_dirs: dict[str, Path], root: Path, devices: int, resume: Path | None = None) -> Run:
    mixture = ",".join(f"{n}={shard_dirs[n]}:{BASE[n]}" for n in NAMES)
    args = ["--mixture", mixture, "--phases", json.dumps(PHASES), "--seq-len", str(SEQ_LEN)]
    args += ["--batch-size", str(BATCH), "--seed", str(SEED), "--max-steps", str(STEPS), "--devices", str(devices)]
    args += ["--strategy", "ddp" if devices > 1 else "auto", "--every-n-steps", str(K)]
    if resume is not None:
        assert resume.is_file(), f"no checkpoint {resume}"
        args += ["--resume", str(resume)]
    return train_record(args, root)


@pytest.fixture(scope="module")
def reference(shard_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Uninterrupted on 2 ranks; its step-K checkpoint is what the resumed runs start from."""
    return train(shard_dirs, tmp_path_factory.mktemp("reference"), devices=2)


@pytest.fixture(scope="module")
def ddp_resumed(shard_dirs: dict[str, Path], reference: Run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(shard_dirs, tmp_path_factory.mktemp("ddp_resumed"), devices=2, resume=reference.checkpoint(K))


@pytest.fixture(scope="module")
def elastic_resumed(shard_dirs: dict[str, Path], reference: Run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(shard_dirs, tmp_path_factory.mktemp("elastic_resumed"), devices=1, resume=reference.checkpoint(K))


@pytest.fixture(scope="module")
def fresh_plan(shard_dirs: dict[str, Path]) -> SamplePlan:
    """The plan of a fresh run with a global batch of 10, from a standalone DataModule."""
    components = [MixtureComponent(n, BASE[n], TokenShardSource(str(shard_dirs[n]))) for n in NAMES]
    datamodule = MixtureDataModule(components, seq_len=SEQ_LEN, batch_size=2 * BATCH, seed=SEED)
    datamodule.set_phase_weights([(0, {}), (PHASE_STEP, PHASES[0]["dataset_weights"])])
    datamodule.setup("fit")
    datamodule.train_dataloader()
    return datamodule.plan


def test_ddp_ranks_switch_weights_at_the_phase_step_and_every_global_batch_holds_exact_counts(
    reference: Run, fresh_plan: SamplePlan
) -> None:
    assert counts(BASE, 2 * BATCH) == [5, 3, 2] and counts(ANNEALED, 2 * BATCH) == [0, 3, 7]
    for rank in range(2):
        assert [r["step"] for r in reference.records(rank)] == list(range(STEPS)), f"rank {rank} skipped a step"
        # Source "a" has weight 0 from the phase on: no rank draws it after switching.
        after_phase = [sample(s)[0] for r in reference.records(rank) if r["step"] >= PHASE_STEP for s in r["starts"]]
        assert 0 not in after_phase, f"rank {rank} drew source 'a' after the phase change"
        assert lrs(reference, rank) == expected_lrs(range(STEPS)), f"rank {rank}: LR scale not switched at the phase"
    expected = {s: counts(BASE if s < PHASE_STEP else ANNEALED, 2 * BATCH) for s in range(STEPS)}
    assert step_counts(reference, ranks=2) == expected
    # Row by row, each rank's slice of each global batch is the plan's, with the phase's segment
    # starting exactly at step 5's first position: no rank switched early or late.
    assert [(s.first_position, s.block_size, s.probabilities) for s in fresh_plan.segments] == [
        (0, 10, probabilities(BASE)),
        (PHASE_STEP * 10, 10, probabilities(ANNEALED)),
    ]
    assert_positions_consumed_once([consumed(reference, dp_size=2)], STEPS * 2 * BATCH, planned(fresh_plan))


def test_elastic_resume_on_1_rank_across_the_phase_change_consumes_every_position_once(
    reference: Run, elastic_resumed: Run, fresh_plan: SamplePlan
) -> None:
    info = elastic_resumed.info(0)
    assert (info["dp_size"], info["global_step"]) == (1, STEPS)
    steps = range(K, STEPS)
    assert [r["step"] for r in elastic_resumed.records(0)] == list(steps)
    # After the resume a global batch is 5 rows: 2.5 / 1.5 / 1 of a, b, c, then 0 / 1.5 / 3.5 from step 5
    # exactly, each batch the floor or ceiling of every share.
    assert step_counts(elastic_resumed, ranks=1) == {
        s: counts(BASE, BATCH, s - K) if s < PHASE_STEP else counts(ANNEALED, BATCH, s - PHASE_STEP) for s in steps
    }
    assert [counts(BASE, BATCH, b) for b in range(2)] == [[2, 2, 1], [3, 1, 1]]
    assert lrs(elastic_resumed, 0) == expected_lrs(steps)

    before = consumed(reference, dp_size=2, before_step=K)
    after = consumed(elastic_resumed, dp_size=1, first_step=K, first_position=K * 2 * BATCH)
    total = K * 2 * BATCH + (STEPS - K) * BATCH
    assert info["positions_consumed"] == total
    # Positions trained by the 2-rank run keep their 10-row blocks; from the resume position on, blocks
    # of 5 with the counts active at each step.
    resumed_plan = SamplePlan(
        fresh_plan.sources,
        seed=SEED,
        segments=(
            Segment(0, 2 * BATCH, probabilities(BASE)),
            Segment(K * 2 * BATCH, BATCH, probabilities(BASE)),
            Segment(K * 2 * BATCH + (PHASE_STEP - K) * BATCH, BATCH, probabilities(ANNEALED)),
        ),
    )
    assert_positions_consumed_once([before, after], total, planned(resumed_plan))
    # Independently of the plan: no source finishes a pass in these 65 rows, so no sample may repeat.
    trained = list(before.values()) + list(after.values())
    assert len(set(trained)) == len(trained) == total, "a sample was trained twice"
    assert planned(resumed_plan)(K * 2 * BATCH) == planned(fresh_plan)(K * 2 * BATCH)


def test_ddp_resume_across_the_phase_change_is_exact(reference: Run, ddp_resumed: Run) -> None:
    for rank in range(2):
        before = [r for r in reference.records(rank) if r["step"] < K]
        assert before + ddp_resumed.records(rank) == reference.records(rank), f"rank {rank} diverged after the resume"
        assert lrs(ddp_resumed, rank) == expected_lrs(range(K, STEPS))
