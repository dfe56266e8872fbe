"""Cost of the sample plan at scale: building one over 10^10 samples, and seeking to position 10^12.

The plan materializes nothing, so both should be flat in the number of samples and the position,
and a long mixture schedule (64 sources, 100 phases) should seek as fast as one source:
``python -m benchmarks.plan_cost [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil

from benchmarks.common import add_run_arguments, report, results_directory
from datamodules.plan.sample_plan import PlannedSource, SamplePlan, Segment, largest_remainder_counts


def single_source(num_samples: int) -> SamplePlan:
    return SamplePlan((PlannedSource("train", num_samples, "synthetic"),), seed=0)


def mixture(num_samples: int) -> SamplePlan:
    """Three sources whose weights change twice, each segment a whole number of 64-position blocks."""
    sources = tuple(PlannedSource(f"source{i}", num_samples // 3, "synthetic") for i in range(3))
    weights = ((0.5, 0.3, 0.2), (0.2, 0.5, 0.3), (0.1, 0.1, 0.8))
    firsts = (0, 64 * 10**8, 64 * 10**9)
    segments = tuple(Segment(f, 64, largest_remainder_counts(w, 64)) for f, w in zip(firsts, weights, strict=True))
    return SamplePlan(sources, seed=0, segments=segments)


# The long schedule: a global batch of 512 (8 per rank on 64 ranks) and a new phase every 3 * 10^7
# steps, so position 10^12 falls mid-schedule, in segment 65 of 0..99.
MANY_SOURCES, MANY_PHASES, GLOBAL_BATCH, STEPS_PER_PHASE = 64, 100, 512, 3 * 10**7


def many_phases(num_samples: int) -> SamplePlan:
    """64 sources of uneven sizes, whose weights change 99 times; timed with the counts it computes."""
    rng = np.random.default_rng(0)
    share = num_samples // MANY_SOURCES
    sizes = rng.integers(share // 10, 2 * share, MANY_SOURCES)
    sources = tuple(PlannedSource(f"source{i}", int(n), "synthetic") for i, n in enumerate(sizes))
    weights = rng.random((MANY_PHASES, MANY_SOURCES))
    counts = [largest_remainder_counts(tuple(w / w.sum()), GLOBAL_BATCH) for w in weights]
    phase = GLOBAL_BATCH * STEPS_PER_PHASE
    segments = tuple(Segment(k * phase, GLOBAL_BATCH, c) for k, c in enumerate(counts))
    return SamplePlan(sources, seed=0, segments=segments)


def build_cost(build: Callable[[int], SamplePlan], num_samples: int, repeats: int) -> dict[str, Any]:
    """Seconds to build (first call and median), with the RSS growth and traced peak of the first."""
    gc.collect()
    process = psutil.Process()
    rss_before = process.memory_info().rss
    tracemalloc.start()
    t0 = time.perf_counter()
    plan = build(num_samples)
    first = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_growth = process.memory_info().rss - rss_before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build(num_samples)
        times.append(time.perf_counter() - t0)
    del plan
    return {
        "first build ms": first * 1e3,
        "median build ms": statistics.median(times) * 1e3,
        "RSS growth MB": rss_growth / 2**20,
        "traced peak MB": peak / 2**20,
    }


def locate_cost(plan: SamplePlan, positions: np.ndarray, repeats: int) -> dict[str, float]:
    """Median and 99th-percentile seconds of ``plan.locate(positions)``, after one untimed call."""
    plan.locate(positions)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan.locate(positions)
        times.append(time.perf_counter() - t0)
    return {"median ms": statistics.median(times) * 1e3, "p99 ms": float(np.percentile(times, 99)) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-samples", type=int, default=10**10)
    parser.add_argument("--position", type=int, default=10**12, help="the position to seek to")
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls per measurement")
    add_run_arguments(parser, data=False)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 50

    many = f"{MANY_SOURCES}-source mixture, {MANY_PHASES} segments"
    plans = {"single source": single_source, "3-source mixture, 3 segments": mixture, many: many_phases}
    build_rows = [
        {"plan": name, **build_cost(build, args.num_samples, max(5, args.repeats // 100))}
        for name, build in plans.items()
    ]
    p = args.position
    probes = {
        "position 0": np.array([0]),
        f"position {p:,}": np.array([p]),
        f"8 positions from {p:,}": np.arange(p, p + 8),
        f"4096 positions from {p:,} (one loader chunk)": np.arange(p, p + 4096),
    }
    seek_names = list(probes)[1:3]
    locate_rows = []
    for name, build in plans.items():
        plan = build(args.num_samples)
        for what, positions in probes.items():
            locate_rows.append({"plan": name, "locate": what, **locate_cost(plan, positions, args.repeats)})

    single = build_rows[0]
    seeks, many_seeks = (
        [r for r in locate_rows if r["plan"] == plan and r["locate"] in seek_names] for plan in ("single source", many)
    )
    seek_ms, many_ms = (", ".join(f"{r['median ms']:.3f} ms" for r in rows) for rows in (seeks, many_seeks))
    report(
        "plan_cost",
        {
            f"Building a plan over {args.num_samples:,} samples": (
                ["plan", "first build ms", "median build ms", "RSS growth MB", "traced peak MB"],
                build_rows,
            ),
            "plan.locate(positions)": (["plan", "locate", "median ms", "p99 ms"], locate_rows),
        },
        config={
            "num_samples": args.num_samples,
            "position": args.position,
            "repeats": args.repeats,
            "long schedule": f"{MANY_PHASES} segments of {STEPS_PER_PHASE:,} steps, global batch {GLOBAL_BATCH}",
        },
        checks={
            f"single-source plan builds in < 0.1 s (first build {single['first build ms']:.2f} ms)": single[
                "first build ms"
            ]
            < 100,
            f"... with < 50 MB extra memory (RSS +{single['RSS growth MB']:.1f} MB, traced peak "
            f"{single['traced peak MB']:.3f} MB)": max(single["RSS growth MB"], single["traced peak MB"]) < 50,
            f"locate at {args.position:,} (1 and 8 positions) < 1 ms median ({seek_ms})": all(
                r["median ms"] < 1 for r in seeks
            ),
            f"{many}: locate at {args.position:,} (1 and 8 positions) < 1 ms median ({many_ms})": all(
                r["median ms"] < 1 for r in many_seeks
            ),
        },
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
