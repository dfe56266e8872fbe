"""Time to the first batch when resuming at step 10^6 against starting at step 0.

Resuming seeks the plan instead of replaying it, so both should take the same time; the two are
timed alternately, many times, and compared by median: ``python -m benchmarks.resume_cost [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.common import add_run_arguments, cached_token_shards, data_directory, report, results_directory
from datamodules import TokenShardDataModule


def first_batch_seconds(dm: TokenShardDataModule) -> float:
    """Wall seconds of ``train_dataloader()`` plus its first batch; shuts the loader's workers down."""
    t0 = time.perf_counter()
    loader = dm.train_dataloader()
    batches = iter(loader)
    next(batches)
    elapsed = time.perf_counter() - t0
    if hasattr(batches, "close"):
        batches.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-tokens", type=int, default=200_000_000)
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step", type=int, default=10**6, help="the training step to resume at")
    parser.add_argument("--repeats", type=int, default=31, help="timed first batches per (start, workers)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values to time")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_tokens, args.repeats = 4_000_000, 3

    with data_directory(args.data_dir) as directory:
        cached_token_shards(directory, args.num_tokens, args.num_shards)

        def datamodule(workers: int, state: dict[str, Any] | None) -> TokenShardDataModule:
            dm = TokenShardDataModule(directory, seq_len=args.seq_len, batch_size=args.batch_size, num_workers=workers)
            dm.setup("fit")
            if state is not None:
                dm.load_state_dict(state)
            return dm

        # A checkpoint's state at the resume step: the plan's identity from the same data, the position moved on.
        resumed = {**datamodule(0, None).state_dict(), "positions_consumed": args.step * args.batch_size}
        rows = []
        for workers in args.workers:
            times: dict[str, list[float]] = {"step 0": [], f"step {args.step:,}": []}
            first_batch_seconds(datamodule(workers, None))  # untimed: first imports, first worker start
            for _ in range(args.repeats):  # alternating, so drift on the machine hits both alike
                for start, state in zip(times, (None, resumed), strict=True):
                    times[start].append(first_batch_seconds(datamodule(workers, state)))
            fresh, resume = (statistics.median(t) for t in times.values())
            for start, t in times.items():
                rows.append(
                    {
                        "num_workers": workers,
                        "start": start,
                        "median ms": statistics.median(t) * 1e3,
                        "min ms": min(t) * 1e3,
                        "max ms": max(t) * 1e3,
                        "resume / fresh": resume / fresh,
                    }
                )
            print(f"num_workers={workers}: fresh {fresh * 1e3:.2f} ms, resume {resume * 1e3:.2f} ms")

    by_workers = {r["num_workers"]: r["resume / fresh"] for r in rows}
    report(
        "resume_cost",
        {
            "train_dataloader() + first batch (medians of alternating runs)": (
                ["num_workers", "start", "median ms", "min ms", "max ms", "resume / fresh"],
                rows,
            )
        },
        config={
            "num_tokens": args.num_tokens,
            "batch": f"{args.batch_size}x{args.seq_len}",
            "resume step": args.step,
            "positions_consumed": args.step * args.batch_size,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        checks={
            f"resume at step {args.step:,} within 10% of step 0, num_workers={w} ({ratio:.3f})": ratio <= 1.10
            for w, ratio in by_workers.items()
        },
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
