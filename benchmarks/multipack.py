"""Multipack packing: token efficiency, rank balance and packing time of ours against the packers in
common use, on the same lengths in one run.

Lengths: lognormal, mean about 2,700 tokens (sigma 0.8), budget 8,192 tokens a row. Contenders:
ours (``MultipackBatchSampler``: best-fit decreasing placed per distinct length, rows as plan
samples; its seconds to construct, which packs the first pass, and to the first row it yields); a
shuffled-prefix LPT packer (each step takes the longest prefix of the shuffled remainder that LPT
fits into one row per rank, as the multipack samplers in wide use do); and best-fit decreasing in
plain Python, one item at a time (sorted list of rooms, ``bisect``), on both counts. The LPT packer
runs on ``--peer-lengths`` only (its efficiency depends on the distribution, not the count; its time
is quoted at that count): ``python -m benchmarks.multipack``.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import time

import numpy as np

from benchmarks.common import add_run_arguments, report, results_directory
from datamodules.plan.multipack import MultipackBatchSampler

BUDGET = 8192


def lognormal_lengths(n: int, mean: float = 2700.0, sigma: float = 0.8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)).astype(np.int64)


def ours(lengths: np.ndarray, ranks: int) -> dict[str, float]:
    """Seconds to construct the sampler (it packs the first pass) and from then on to its first row."""
    t0 = time.perf_counter()
    sampler = MultipackBatchSampler(lengths, BUDGET, num_replicas=ranks, rank=0, seed=0)
    built = time.perf_counter()
    next(iter(sampler))
    first_row = time.perf_counter() - t0
    packed = sampler.efficiency()
    return {
        "seconds": built - t0,
        "to first row": first_row,
        "efficiency": packed.token_efficiency,
        "balanced": packed.balanced_steps,
    }


def _lpt_fits(items: list[int], ranks: int) -> bool:
    loads = [0] * ranks
    for size in sorted(items, reverse=True):
        least = heapq.heappop(loads)
        if least + size > BUDGET:
            return False
        heapq.heappush(loads, least + size)
    return True


def _lpt_loads(items: list[int], ranks: int) -> list[int]:
    loads = [0] * ranks
    for size in sorted(items, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + size)
    return loads


def shuffled_prefix_lpt(lengths: np.ndarray, ranks: int) -> dict[str, float]:
    """Each step: the longest prefix of the shuffled rest that LPT fits into ``ranks`` rows (binary search)."""
    clipped = np.minimum(lengths, BUDGET)[np.random.default_rng(0).permutation(len(lengths))].tolist()
    t0 = time.perf_counter()
    steps, start = [], 0
    while start < len(clipped):
        low, high = 1, min(len(clipped) - start, 64 * ranks)
        while low < high:  # the largest k whose prefix fits
            mid = (low + high + 1) // 2
            low, high = (mid, high) if _lpt_fits(clipped[start : start + mid], ranks) else (low, mid - 1)
        steps.append(_lpt_loads(clipped[start : start + low], ranks))
        start += low
    seconds = time.perf_counter() - t0
    loads = np.array(steps[:-1] or steps)  # the last step is a remainder
    balanced = loads.max(axis=1) <= 1.02 * np.maximum(loads.min(axis=1), 1)
    return {"seconds": seconds, "efficiency": loads.sum() / (loads.size * BUDGET), "balanced": balanced.mean()}


def python_best_fit_decreasing(lengths: np.ndarray, ranks: int) -> dict[str, float]:
    """Best fit decreasing one item at a time: a sorted list of open rooms, ``bisect`` for the tightest."""
    t0 = time.perf_counter()
    rooms: list[int] = []
    rows = 0
    for size in sorted(np.minimum(lengths, BUDGET).tolist(), reverse=True):
        at = bisect.bisect_left(rooms, size)
        if at < len(rooms):
            room = rooms.pop(at) - size
        else:
            rows, room = rows + 1, BUDGET - size
        if room:
            bisect.insort(rooms, room)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "efficiency": np.minimum(lengths, BUDGET).sum() / (rows * BUDGET), "balanced": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, default=1_000_000)
    parser.add_argument("--peer-lengths", type=int, default=100_000, help="lengths the Python packers get")
    parser.add_argument("--rounds", type=int, default=3, help="timed repeats of ours; medians")
    add_run_arguments(parser, data=False)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.peer_lengths, args.rounds = 20_000, 5_000, 1
    lengths, peer = lognormal_lengths(args.lengths), lognormal_lengths(args.peer_lengths)
    rows = []
    for ranks in (1, 8):
        runs = [ours(lengths, ranks) for _ in range(args.rounds)]
        best = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
        rows.append({"packer": "ours (MultipackBatchSampler)", "lengths": len(lengths), "ranks": ranks, **best})
        rows.append({"packer": "ours", "lengths": len(peer), "ranks": ranks, **ours(peer, ranks)})
        rows.append(
            {"packer": "shuffled-prefix LPT", "lengths": len(peer), "ranks": ranks, **shuffled_prefix_lpt(peer, ranks)}
        )
    for some in (peer, lengths):
        plain = python_best_fit_decreasing(some, 1)
        rows.append({"packer": "best-fit decreasing, plain Python", "lengths": len(some), "ranks": 1, **plain})
    ours_full = [r for r in rows if r["packer"].startswith("ours (")]
    checks = {
        "token efficiency >= 0.995 on 1 rank and on 8": all(r["efficiency"] >= 0.995 for r in ours_full),
        "ranks balanced (max/min <= 1.02) on >= 99% of steps at 8 ranks": ours_full[1]["balanced"] >= 0.99,
        f"{len(lengths):,} lengths: the first row in under 1 s": all(r["to first row"] < 1.0 for r in ours_full),
    }
    columns = ["packer", "lengths", "ranks", "seconds", "to first row", "efficiency", "balanced"]
    config = {"budget": BUDGET, "mean length": round(float(lengths.mean())), "rounds": args.rounds}
    report("multipack", {"packing": (columns, rows)}, config, checks, results_directory(args.results_dir, args.quick))


if __name__ == "__main__":
    main()
