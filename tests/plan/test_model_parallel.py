"""Model-parallel groups read once (``broadcast_within``): real 4-process jobs on gloo, shaped as 2
data-parallel x 2 tensor-parallel ranks by a device mesh (``MeshDDPStrategy`` in train_record.py, the
view ``ModelParallelStrategy`` gives, trained on CPU). The first rank of each tensor-parallel group
reads; its peer starts no worker, reads nothing and trains the same bytes; the two groups cover the
plan as a 2-rank job does; a checkpoint resumes with or without broadcasting, on other shapes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.object_store.server import S3Proxy, proxied_bucket, storage_options
from datamodules import TokenShardDataModule
from tests.distributed_support import Run, train_record
from tests.plan.test_distributed import BATCH, SEQ_LEN, WINDOWS, consumed
from tests.support import make_token_shards

BUCKET = "model-parallel"
EPOCH_STEPS = WINDOWS // (2 * BATCH)  # on 2 data-parallel ranks


def run(data: str | Path, root: Path, *, devices: int, mesh: str | None = None, broadcast: bool = False,
        workers: int = 0, max_steps: int | None = None, every_n_steps: int | None = None,
        resume: Path | None = None, storage: dict | None = None) -> Run:  # fmt: skip
    args = ["--data", str(data), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--workers", str(workers)]
    args += ["--devices", str(devices), "--strategy", "ddp" if devices > 1 else "auto"]
    args += ["--mesh", mesh] if mesh else []
    args += ["--broadcast-within", "tensor_parallel"] if broadcast else []
    args += ["--max-steps", str(max_steps)] if max_steps else ["--max-epochs", "1"]
    args += ["--every-n-steps", str(every_n_steps)] if every_n_steps else []
    args += ["--resume", str(resume)] if resume else []
    args += ["--storage-options", __import__("json").dumps(storage)] if storage else []
    return train_record(args, root)


@pytest.fixture(scope="module")
def proxy(endpoint: str) -> Iterator[S3Proxy]:
    with proxied_bucket(endpoint, BUCKET) as proxy:
        yield proxy


def test_a_tensor_parallel_group_reads_once_and_its_peer_trains_the_same_bytes(
    tmp_path: Path, endpoint: str, proxy: S3Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    local = make_token_shards(tmp_path / "corpus", WINDOWS * SEQ_LEN + 1, shard_tokens=64)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(local), f"{BUCKET}/corpus", recursive=True)
    url, options = f"s3://{BUCKET}/corpus", storage_options(proxy.url)
    requests = {}
    for name, shape in (("data parallel", {"devices": 2}), ("2x2", {"devices": 4, "mesh": "2x2", "broadcast": True})):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache-{name}"))  # each job starts cold
        proxy.reset_counts()
        jobs = run(url, tmp_path / name, workers=2, storage=options, **shape)
        requests[name] = Counter(proxy.paths)
        if name == "data parallel":
            plain = jobs
    # The job of 4 sends the requests of the 2-rank job: its peers read nothing, at setup or after.
    assert requests["2x2"] == requests["data parallel"]
    # Ranks 0, 1 and ranks 2, 3 are the groups (data-parallel ranks 0 and 1): the same bytes each step,
    # which the plain job's ranks 0 and 1 trained.
    for leader, peer, dp_rank in ((0, 1, 0), (2, 3, 1)):
        assert [r["digest"] for r in jobs.records(peer)] == [r["digest"] for r in jobs.records(leader)]
        assert [r["digest"] for r in jobs.records(leader)] == [r["digest"] for r in plain.records(dp_rank)]
        assert jobs.info(leader)["dp_rank"] == jobs.info(peer)["dp_rank"] == dp_rank
        assert (jobs.info(leader)["worker_processes"], jobs.info(peer)["worker_processes"]) == (2, 0)
    assert len(jobs.records(0)) == EPOCH_STEPS


def leaders_as_ranks(run: Run, leaders: list[int]) -> Run:
    """``run`` seen through its groups' first ranks, renumbered as data-parallel ranks."""

    class Leaders(Run):
        def records(self, rank: int) -> list[dict]:
            return run.records(leaders[rank])

    return Leaders(run.root)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_broadcast_job_resumes_exactly_and_on_other_shapes_with_or_without_broadcasting(
    tmp_path: Path, workers: int
) -> None:
    data = make_token_shards(tmp_path / "corpus", WINDOWS * SEQ_LEN + 1, shard_tokens=64)
    plan = TokenShardDataModule(data, seq_len=SEQ_LEN, batch_size=BATCH)
    plan.setup("fit")
    plan.train_dataloader()
    expected = plan.plan.locate(np.arange(WINDOWS))[1].tolist()  # the window at each plan position
    stopped = run(data, tmp_path / "stopped", devices=4, mesh="2x2", broadcast=True, workers=workers,
                  max_steps=3, every_n_steps=3)  # fmt: skip
    before = consumed(leaders_as_ranks(stopped, [0, 2]), dp_size=2)
    shapes = [("2x2 again", {"devices": 4, "mesh": "2x2", "broadcast": True, "workers": workers}, [0, 2])]
    if not workers:  # the other shapes read the same plan whatever the workers
        shapes += [
            ("4 data-parallel ranks", {"devices": 4}, [0, 1, 2, 3]),
            ("1 x 4 tensor-parallel", {"devices": 4, "mesh": "1x4", "broadcast": True}, [0]),
        ]
    for name, shape, leaders in shapes:
        resumed = run(data, tmp_path / name, resume=stopped.checkpoint(3), **shape)
        after = consumed(leaders_as_ranks(resumed, leaders), dp_size=len(leaders), first_step=3,
                         first_position=3 * 2 * BATCH)  # fmt: skip
        assert not before.keys() & after.keys(), name
        merged = {**before, **after}
        assert [merged[p] for p in range(WINDOWS)] == expected, name  # every window once, in the plan's order
        groups = {leader: [r for r in range(4) if r // (4 // len(leaders)) == i] for i, leader in enumerate(leaders)}
        for leader, members in groups.items():
            for peer in members:
                assert [r["digest"] for r in resumed.records(peer)] == [r["digest"] for r in resumed.records(leader)]


def test_broadcast_within_refuses_a_strategy_without_a_mesh_and_names_the_meshs_dimensions(tmp_path: Path) -> None:
    data = make_token_shards(tmp_path / "corpus", WINDOWS * SEQ_LEN + 1, shard_tokens=64)
    common = ["--data", str(data), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--max-steps", "1"]
    common += ["--devices", "1", "--strategy", "ddp"]
    no_mesh = train_record([*common, "--broadcast-within", "tensor_parallel"], tmp_path / "no-mesh", failing_ranks=1)
    assert (
        "broadcast_within='tensor_parallel' names dimensions of the strategy's device mesh, but DDPStrategy has none"
        in (no_mesh.error(0))
    )
    unknown = train_record(
        [*common, "--mesh", "1x1", "--broadcast-within", "tp"], tmp_path / "unknown", failing_ranks=1
    )
    assert "broadcast_within='tp': the device mesh's dimensions are ['data_parallel', 'tensor_parallel']" in (
        unknown.error(0)
    )
    # A strategy whose sampler view gives the two ranks of a group two data-parallel ranks: refused, by rank.
    common[common.index("--devices") + 1] = "2"
    mixed = train_record(
        [*common, "--mesh", "1x2", "--mesh-sampler", "global", "--broadcast-within", "tensor_parallel"],
        tmp_path / "mixed",
        failing_ranks=2,
    )
    for rank in range(2):
        assert "ranks [0, 1] share batches but have data-parallel ranks [0, 1]" in mixed.error(rank)
    with pytest.raises(ValueError, match=r"broadcast_within names mesh dimensions \(a name or a list\), got 2"):
        TokenShardDataModule(data, seq_len=SEQ_LEN, batch_size=BATCH, broadcast_within=2)


def test_hidden_states_generated_on_demand_are_requested_once_per_group_not_once_per_rank(tmp_path: Path) -> None:
    import datasets

    from examples.hidden_states_server import HiddenStatesServer
    from tests.speculative.speculative_data import conversations, tiny_verifier
    from tests.support import row_digest

    data_dir = tmp_path / "data"
    conversations(60).save_to_disk(str(data_dir))
    prompts = Counter()

    def count(number: int, prompt: list[int]) -> None:  # the server's fault hook: no fault, a count
        prompts[tuple(prompt)] += 1

    args = ["--hidden-states", str(data_dir), "--seq-len", "64", "--batch-size", "1", "--devices", "4"]
    args += ["--strategy", "ddp", "--mesh", "2x2", "--broadcast-within", "tensor_parallel", "--max-steps", "3"]
    with HiddenStatesServer(tiny_verifier(), "tiny-llama", [1, 2, 3], tmp_path / "served", faults=count) as server:
        job = train_record([*args, "--server", server.url], tmp_path / "run")
    tokens = {
        row_digest(__import__("torch").tensor(t)): tuple(t) for t in datasets.load_from_disk(str(data_dir))["input_ids"]
    }
    trained = [tokens[d] for leader in (0, 2) for d in job.rows(leader)]
    assert job.rows(1) == job.rows(0) and job.rows(3) == job.rows(2)
    assert len(set(trained)) == len(trained) > 6  # three steps of two groups' packed rows
    first = tuple(datasets.load_from_disk(str(data_dir))["input_ids"][0])  # asked once at setup for the shape
    # Every conversation trained was generated for its group's first rank alone, once.
    assert all(prompts[prompt] == 1 + (prompt == first) for prompt in trained)
    assert max(count for prompt, count in prompts.items() if prompt != first) == 1
