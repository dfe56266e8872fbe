"""Cost of the sample plan at scale: building one over 10^10 samples, and seeking to position 10^12.

The plan materializes nothing, so both should be flat in the number of samples and the position,
and a long mixture schedule (64 or 1,000 sources, 100 phases) should seek about as fast as one source:
``python -m benchmarks.plan_cost [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil

from benchmarks.common import add_run_arguments, report, results_directory
from datamodules.plan.sample_plan import PlannedSource, SamplePlan, Segment


def single_source(num_samples: int) -> SamplePlan:
    return SamplePlan((PlannedSource("train", num_samples, "synthetic"),), seed=0)


def mixture(num_samples: int) -> SamplePlan:
    """Three sources whose weights change twice, each segment a whole number of 64-position blocks."""
    sources = tuple(PlannedSource(f"source{i}", num_samples // 3, "synthetic") for i in range(3))
    weights = ((0.5, 0.3, 0.2), (0.2, 0.5, 0.3), (0.1, 0.1, 0.8))
    firsts = (0, 64 * 10**8, 64 * 10**9)
    segments = tuple(Segment(f, 64, w) for f, w in zip(firsts, weights, strict=True))
    return SamplePlan(sources, seed=0, segments=segments)


# The long schedules: a global batch of 512 (8 per rank on 64 ranks) and a new phase every 3 * 10^7
# steps, so position 10^12 falls mid-schedule, in segment 65 of 0..99.
MANY_PHASES, GLOBAL_BATCH, STEPS_PER_PHASE = 100, 512, 3 * 10**7


def many_phases(num_samples: int, num_sources: int) -> SamplePlan:
    """``num_sources`` sources of uneven sizes, whose weights change 99 times; its build time includes
    each segment's closed form (the samples every source drew before it)."""
    rng = np.random.default_rng(0)
    share = num_samples // num_sources
    sizes = rng.integers(share // 10, 2 * share, num_sources)
    sources = tuple(PlannedSource(f"source{i}", int(n), "synthetic") for i, n in enumerate(sizes))
    weights = rng.random((MANY_PHASES, num_sources))
    phase = GLOBAL_BATCH * STEPS_PER_PHASE
    segments = tuple(Segment(k * phase, GLOBAL_BATCH, tuple(w / w.sum())) for k, w in enumerate(weights))
    return SamplePlan(sources, seed=0, segments=segments)


def build_cost(build: Callable[[int], SamplePlan], num_samples: int, repeats: int, traced: bool) -> dict[str, Any]:
    """Seconds to build (first call and median), the RSS growth of the first, and (``traced``) the traced
    peak of one more build, traced apart: tracemalloc slows Python code many times over (20 s for the
    1,000-source schedule's floor sums)."""
    gc.collect()
    process = psutil.Process()
    rss_before = process.memory_info().rss
    t0 = time.perf_counter()
    plan = build(num_samples)
    first = time.perf_counter() - t0
    rss_growth = process.memory_info().rss - rss_before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build(num_samples)
        times.append(time.perf_counter() - t0)
    del plan
    peak = float("nan")
    if traced:
        tracemalloc.start()
        build(num_samples)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
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

    many, most = (f"{n}-source mixture, {MANY_PHASES} segments" for n in (64, 1000))
    plans = {
        "single source": single_source,
        "3-source mixture, 3 segments": mixture,
        many: functools.partial(many_phases, num_sources=64),
        most: functools.partial(many_phases, num_sources=1000),
    }
    # The 1,000-source plan takes over a second to build: fewer repeats, and no traced build. A smoke
    # run times one build after the first.
    rebuilds = (1, 1) if args.quick else (3, max(5, args.repeats // 100))
    build_rows = [
        {
            "plan": name,
            **build_cost(build, args.num_samples, *((rebuilds[0], False) if name == most else (rebuilds[1], True))),
        }
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
    seeks, many_seeks, most_seeks = (
        [r for r in locate_rows if r["plan"] == plan and r["locate"] in seek_names]
        for plan in ("single source", many, most)
    )
    seek_ms, many_ms, most_ms = (
        ", ".join(f"{r['median ms']:.3f} ms" for r in rows) for rows in (seeks, many_seeks, most_seeks)
    )
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
            "long schedules": f"{MANY_PHASES} segments of {STEPS_PER_PHASE:,} steps, global batch {GLOBAL_BATCH}",
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
            f"{most}: locate at {args.position:,} < 1 ms, 8 positions < 2 ms median ({most_ms})": (
                most_seeks[0]["median ms"] < 1 and most_seeks[1]["median ms"] < 2
            ),
        },
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
