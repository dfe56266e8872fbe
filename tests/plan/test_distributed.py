"""Real multi-process runs on CPU (gloo) of ``TokenShardDataModule`` under Lightning's default flags.

DDP runs go through ``tests/scripts/train_record.py`` in subprocesses: Lightning's ``ddp`` strategy
re-launches ``sys.argv`` for the other ranks, so it must never start inside the pytest process.
ModelParallel and FSDP need GPUs to train; ``tests/scripts/mesh_ranks.py`` checks their rank
resolution in a real 4-process gloo group instead.

Sizes: 64 windows of 8 tokens, 4 windows per rank per step, so one epoch is 8 steps on 2 ranks and
16 steps on 1 rank. Shard tokens equal their stream offset, so a batch row's first token divided by
the sequence length is the window index.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from datamodules import TokenShardDataModule
from tests.distributed_support import (
    SCRIPTS,
    Run,
    assert_positions_consumed_once,
    free_port,
    launch_env,
    run_processes,
    train_record,
)
from tests.support import make_token_shards

SEQ_LEN, BATCH = 8, 4
WINDOWS = 64
STEPS_PER_EPOCH = WINDOWS // (2 * BATCH)  # on 2 ranks


def train(
    shards: Path,
    root: Path,
    *,
    devices: int = 1,
    num_nodes: int = 1,
    strategy: str = "auto",
    max_steps: int | None = None,
    max_epochs: int | None = None,
    workers: int = 0,
    every_n_steps: int | None = None,
    resume: Path | None = None,
    storage_options: dict | None = None,
    kill_worker: str | None = None,
    failing_ranks: int = 0,
) -> Run:
    """Fit ``RecordingModel`` with every data-loading flag of the Trainer at its default."""
    args = ["--storage-options", json.dumps(storage_options)] if storage_options else []
    args += ["--data", str(shards), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--workers", str(workers)]
    args += ["--devices", str(devices), "--strategy", strategy]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    if max_epochs is not None:
        args += ["--max-epochs", str(max_epochs)]
    if every_n_steps is not None:
        args += ["--every-n-steps", str(every_n_steps)]
    if resume is not None:
        assert resume.is_file(), f"no checkpoint {resume}"
        args += ["--resume", str(resume)]
    if kill_worker is not None:
        args += ["--kill-worker", kill_worker]
    return train_record(args, root, num_nodes=num_nodes, failing_ranks=failing_ranks)


def windows(record: dict) -> list[int]:
    return [start // SEQ_LEN for start in record["starts"]]


def rank_windows(run: Run, rank: int, before_step: int | None = None) -> list[int]:
    return [w for r in run.records(rank) if before_step is None or r["step"] < before_step for w in windows(r)]


def consumed(
    run: Run, dp_size: int, *, first_step: int = 0, first_position: int = 0, before_step: int | None = None
) -> dict[int, int]:
    """``{plan position: window}`` of every row the run trained, from the rank-slicing contract.

    Global batch ``s`` covers positions ``first_position + (s - first_step) * BATCH * dp_size`` on;
    rank ``r`` reads the ``BATCH`` positions from ``r * BATCH`` within it. A position trained twice
    fails here.
    """
    out: dict[int, int] = {}
    for rank in range(dp_size):
        for record in run.records(rank):
            if before_step is not None and record["step"] >= before_step:
                continue
            first = first_position + (record["step"] - first_step) * BATCH * dp_size + rank * BATCH
            for offset, window in enumerate(windows(record)):
                assert first + offset not in out, f"position {first + offset} trained twice"
                out[first + offset] = window
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_token_shards(tmp_path_factory.mktemp("shards"), WINDOWS * SEQ_LEN + 1, shard_tokens=97)


@pytest.fixture(scope="module")
def plan_windows(shards: Path):
    """The window the plan puts at each of the first ``n`` global positions."""
    datamodule = TokenShardDataModule(shards, seq_len=SEQ_LEN, batch_size=BATCH)
    datamodule.setup("fit")
    datamodule.train_dataloader()  # the plan of a fresh run
    return lambda n: datamodule.plan.locate(np.arange(n))[1].tolist()


@pytest.fixture(scope="module")
def ddp_epoch(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One epoch on 2 ranks: ``Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1)``."""
    return train(shards, tmp_path_factory.mktemp("ddp_epoch"), devices=2, strategy="ddp", max_epochs=1)


REFERENCE_STEPS = 20  # two and a half epochs on 2 ranks


@pytest.fixture(scope="module")
def ddp_reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """An uninterrupted 2-rank run of ``REFERENCE_STEPS`` steps."""
    return train(shards, tmp_path_factory.mktemp("ddp_reference"), devices=2, strategy="ddp", max_steps=REFERENCE_STEPS)


@pytest.fixture(scope="module")
def ddp_stopped(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A 2-rank run that checkpoints at step 3 (mid-epoch) and is "killed" 2 steps later."""
    root = tmp_path_factory.mktemp("ddp_stopped")
    return train(shards, root, devices=2, strategy="ddp", max_steps=5, every_n_steps=3)


def test_ddp_ranks_read_disjoint_windows_that_cover_the_epoch_once(ddp_epoch: Run) -> None:
    rank0, rank1 = rank_windows(ddp_epoch, 0), rank_windows(ddp_epoch, 1)
    assert len(ddp_epoch.records(0)) == len(ddp_epoch.records(1)) == STEPS_PER_EPOCH
    assert not set(rank0) & set(rank1), "two DDP ranks trained the same window"
    assert sorted(rank0 + rank1) == list(range(WINDOWS))


def test_ddp_ranks_read_their_slice_of_each_global_batch(ddp_epoch: Run, plan_windows) -> None:
    assert_positions_consumed_once([consumed(ddp_epoch, dp_size=2)], WINDOWS, plan_windows)


def test_ddp_trains_on_the_datamodule_sampler_not_a_lightning_replacement(ddp_epoch: Run) -> None:
    for rank in range(2):
        info = ddp_epoch.info(rank)
        assert info["loader_type"] == "PlanDataLoader"
        assert info["sampler_type"] == "PlanSampler"
        assert info["sampler_is_datamodule_sampler"], "Lightning replaced or wrapped the DataModule's sampler"
        assert info["batch_sampler"] is None
        assert (info["dp_rank"], info["dp_size"]) == (rank, 2)
        assert info["num_training_batches"] == STEPS_PER_EPOCH


def test_ddp_spawn_ships_the_datamodule_to_its_ranks_which_cover_the_epoch_once(
    shards: Path, tmp_path: Path, plan_windows
) -> None:
    # ddp_spawn pickles the Trainer, and the DataModule with it, into each rank's process.
    run = train(shards, tmp_path, devices=2, strategy="ddp_spawn", max_epochs=1)
    assert len(run.records(0)) == len(run.records(1)) == STEPS_PER_EPOCH
    assert_positions_consumed_once([consumed(run, dp_size=2)], WINDOWS, plan_windows)


def test_ddp_resume_mid_epoch_is_exact(ddp_reference: Run, ddp_stopped: Run, shards: Path, tmp_path: Path) -> None:
    k = 3
    resumed = train(
        shards,
        tmp_path / "resumed",
        devices=2,
        strategy="ddp",
        max_steps=REFERENCE_STEPS,
        resume=ddp_stopped.checkpoint(k),
    )
    for rank in range(2):
        before = [r for r in ddp_stopped.records(rank) if r["step"] < k]
        # The resumed run crosses two epoch boundaries (steps 8 and 16).
        assert before + resumed.records(rank) == ddp_reference.records(rank), f"rank {rank} diverged"


def test_ddp_resume_with_workers_is_exact(ddp_reference: Run, shards: Path, tmp_path: Path) -> None:
    k = 11  # in the second epoch; the resumed run crosses the boundary at step 16
    stopped = train(
        shards, tmp_path / "stopped", devices=2, strategy="ddp", workers=2, max_steps=k + 2, every_n_steps=k
    )
    resumed = train(
        shards,
        tmp_path / "resumed",
        devices=2,
        strategy="ddp",
        workers=2,
        max_steps=REFERENCE_STEPS,
        resume=stopped.checkpoint(k),
    )
    for rank in range(2):
        before = [r for r in stopped.records(rank) if r["step"] < k]
        reference = ddp_reference.records(rank)
        assert before == reference[:k], f"rank {rank}: 2 workers changed the order before any resume"
        assert before + resumed.records(rank) == reference, f"rank {rank} diverged after the resume"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_killed_by_sigkill_stops_every_ddp_rank_with_one_message_and_none_hangs(
    shards: Path, tmp_path: Path, rank: int
) -> None:
    # As the kernel's out-of-memory killer does, after step 3's batch; the rank notices at its next batch.
    run = train(
        shards, tmp_path, devices=2, strategy="ddp", max_steps=20, workers=2, kill_worker=f"{rank}:3", failing_ranks=2
    )
    for r in (0, 1):
        error = run.error(r)
        stopped = f"RuntimeError: TokenShardDataModule: training stopped on every rank by rank(s) [{rank}]"
        assert error.startswith(stopped)
        assert "DataLoader worker (pid " in error and "was killed by SIGKILL" in error and "out-of-memory" in error
    assert len(run.records(0)) == len(run.records(1)) < 20  # both stopped before the same batch


def test_two_nodes_read_disjoint_windows_that_cover_the_epoch_once(shards: Path, tmp_path: Path) -> None:
    # Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp"), NODE_RANK=0 and 1 on loopback.
    run = train(shards, tmp_path, devices=1, num_nodes=2, strategy="ddp", max_epochs=1)
    for node in range(2):
        info = run.info(node)
        assert (info["world_size"], info["dp_rank"], info["dp_size"]) == (2, node, 2)
        assert info["sampler_is_datamodule_sampler"]
    node0, node1 = rank_windows(run, 0), rank_windows(run, 1)
    assert len(run.records(0)) == len(run.records(1)) == STEPS_PER_EPOCH
    assert not set(node0) & set(node1), "two nodes trained the same window"
    assert sorted(node0 + node1) == list(range(WINDOWS))


def test_elastic_resume_of_a_2_rank_checkpoint_on_1_rank_consumes_every_position_once(
    ddp_stopped: Run, shards: Path, tmp_path: Path, plan_windows
) -> None:
    k = 3
    resumed = train(shards, tmp_path, devices=1, max_epochs=1, resume=ddp_stopped.checkpoint(k))
    before = consumed(ddp_stopped, dp_size=2, before_step=k)
    after = consumed(resumed, dp_size=1, first_step=k, first_position=k * 2 * BATCH)
    # Together exactly one epoch: every window once.
    assert sorted(list(before.values()) + list(after.values())) == list(range(WINDOWS))
    assert_positions_consumed_once([before, after], WINDOWS, plan_windows)
    assert resumed.info(0)["positions_consumed"] == WINDOWS


def launch_mesh(strategy: str, shards: Path, out: Path, *options: str) -> list[dict]:
    """Four processes, 2 "nodes" x 2 local ranks, started the way torchelastic starts them."""
    cmd = [sys.executable, str(SCRIPTS / "mesh_ranks.py"), "--strategy", strategy, "--data", str(shards), *options]
    cmd += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--batches", "3", "--out", str(out / "batches")]
    port = free_port()
    elastic = dict(WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, TORCHELASTIC_RUN_ID="test_distributed")
    envs = [launch_env(port, RANK=r, LOCAL_RANK=r % 2, GROUP_RANK=r // 2, **elastic) for r in range(4)]
    run_processes([(cmd, env) for env in envs], out / "logs")
    return [json.loads((out / f"batches.rank{r}").read_text()) for r in range(4)]


@pytest.fixture(scope="module")
def model_parallel(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Per global rank: ModelParallelStrategy on a 2 (data parallel) x 2 (tensor parallel) mesh."""
    return launch_mesh("model_parallel", shards, tmp_path_factory.mktemp("model_parallel"))


def test_model_parallel_tensor_parallel_peers_get_identical_batches(model_parallel: list[dict]) -> None:
    for rank in model_parallel:
        dp, tp = rank["mesh_coordinate"]
        assert rank["global_rank"] == 2 * dp + tp
        assert (rank["dp_rank"], rank["dp_size"]) == (dp, 2), "the DataModule did not take the mesh's DP rank"
        assert rank["sampler_is_datamodule_sampler"]
    for dp in range(2):
        peer0, peer1 = model_parallel[2 * dp], model_parallel[2 * dp + 1]
        assert peer0["digests"] == peer1["digests"], f"tensor-parallel peers of DP rank {dp} got different batches"


def test_model_parallel_broadcast_within_tensor_parallel_the_first_rank_reads_for_its_peer(
    shards: Path, tmp_path: Path, model_parallel: list[dict]
) -> None:
    ranks = launch_mesh("model_parallel", shards, tmp_path, "--broadcast-within", "tensor_parallel")
    assert [rank["reads"] for rank in ranks] == [True, False, True, False]
    # The same batches as every rank reading its own, under the real ModelParallelStrategy.
    assert [rank["digests"] for rank in ranks] == [rank["digests"] for rank in model_parallel]


def test_model_parallel_data_parallel_ranks_get_disjoint_slices(model_parallel: list[dict], plan_windows) -> None:
    plan = plan_windows(3 * 2 * BATCH)
    for rank in model_parallel:
        dp = rank["dp_rank"]
        got = [[s // SEQ_LEN for s in batch] for batch in rank["starts"]]
        assert got == [plan[(s * 2 + dp) * BATCH : (s * 2 + dp + 1) * BATCH] for s in range(3)]
    dp0 = {s for batch in model_parallel[0]["starts"] for s in batch}
    dp1 = {s for batch in model_parallel[2]["starts"] for s in batch}
    assert not dp0 & dp1, "two data-parallel ranks read the same window"


def test_fsdp_ranks_get_disjoint_slices(shards: Path, tmp_path: Path, plan_windows) -> None:
    ranks = launch_mesh("fsdp", shards, tmp_path)
    plan = plan_windows(3 * 4 * BATCH)
    seen: set[int] = set()
    for r, rank in enumerate(ranks):
        assert (rank["dp_rank"], rank["dp_size"]) == (r, 4), "FSDP is data-parallel over all 4 ranks"
        assert rank["sampler_is_datamodule_sampler"]
        got = [[s // SEQ_LEN for s in batch] for batch in rank["starts"]]
        assert got == [plan[(s * 4 + r) * BATCH : (s * 4 + r + 1) * BATCH] for s in range(3)]
        mine = {w for batch in got for w in batch}
        assert not seen & mine, f"FSDP rank {r} read a window another rank read"
        seen |= mine
