"""What the ranks' stop vote costs a step: ``RankVote.check`` on every batch, 2 gloo processes on CPU.

On several ranks every batch carries a ``Stop`` and the DataModule's ``on_after_batch_transfer``
votes on it (``datamodules/plan/stopping.py``): an asynchronous all-reduce of one int on a CPU group,
waited for one batch later. Here each of 2 processes runs ``--batches`` iterations of a step-like
loop (a matrix product, then a gradient-sized all-reduce on the default group, as DDP's backward
does), with and without the vote, alternating rounds: microseconds per batch, and the vote's share
of this small step. On 2 cores the vote's gloo thread competes with the 2 training processes for
them; the goal is under 0.5 ms a batch (under 1% of a 50 ms GPU step).
``python -m benchmarks.rank_vote [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import add_run_arguments, gloo_ranks, report, results_directory


def _steps(batches: int, vote: bool) -> float:
    from datamodules.plan.stopping import RankVote, Stop

    voter = RankVote("bench")
    weight, gradient = torch.randn(256, 256), torch.zeros(1 << 16)
    dist.barrier()
    start = time.perf_counter()
    for i in range(batches):
        if vote:
            stop = Stop()
            stop.first = i == 0
            voter.check(stop)
        weight @ weight  # noqa: B018 (the step's compute)
        dist.all_reduce(gradient)  # the step's gradient all-reduce
    dist.barrier()
    return (time.perf_counter() - start) / batches * 1e6


def _rank(rank: int, port: int, batches: int, rounds: int, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    timings: dict[str, list[float]] = {"without the vote": [], "with the vote": []}
    _steps(min(batches, 200), True)  # warm-up: the vote's group is made on first use
    for _ in range(rounds):
        for name, vote in (("without the vote", False), ("with the vote", True)):
            timings[name].append(_steps(batches, vote))
    if rank == 0:
        results.put({name: statistics.median(values) for name, values in timings.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_run_arguments(parser, data=False)
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    batches, rounds = (200, 1) if args.quick else (args.batches, args.rounds)
    timings = gloo_ranks(_rank, (batches, rounds))
    base, voted = timings["without the vote"], timings["with the vote"]
    rows = [
        {"loop": "step: 256x256 matmul + 256 KB gradient all-reduce", "us per batch": base},
        {"loop": "the same step + RankVote.check", "us per batch": voted},
        {"loop": "the vote's cost", "us per batch": voted - base, "of the step": (voted - base) / base},
    ]
    # A GPU step takes 50 ms or more: under 0.5 ms a batch, the vote costs it under 1%.
    checks = {"the vote costs under 0.5 ms a batch": voted - base < 500}
    config = {"processes": 2, "backend": "gloo", "batches": batches, "rounds": rounds}
    tables = {
        "a step with and without the stop vote (medians over rounds)": (["loop", "us per batch", "of the step"], rows)
    }
    report("rank_vote", tables, config, checks, results_directory(args.results_dir, args.quick))


if __name__ == "__main__":
    main()
