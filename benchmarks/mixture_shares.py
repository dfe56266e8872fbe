"""How closely a mixture's samples follow its weights: ours against the rules users move from.

For random weight vectors (2 to 1,000 sources, Zipf-like tails and zeros) and global batches of 8 to
4,096, the worst distance, in samples, between any source's count after ``B`` global batches and its
share ``p G B``, and how many batches hold each source's floor or ceiling of ``p G``:

- ours (plan 2): ``Segment.counts``, the loader's per-batch counts, and ``Segment.drawn_before`` far out;
- whole counts per batch (largest remainder, the same in every batch: plan 1, Mosaic's stratified batches);
- independent draws per sample (litdata's ``CombinedStreamingDataset``), with a fixed seed.

``python -m benchmarks.mixture_shares [--quick]``
"""

from __future__ import annotations

import argparse
from fractions import Fraction

import numpy as np

from benchmarks.common import add_run_arguments, report, results_directory
from datamodules.plan.sample_plan import Segment

BLOCK_SIZES = (8, 64, 256, 4096)
DENSE, FAR = "worst, every B", "worst, sampled B <= 10^12"
OLMO = {"dclm": 0.95, "code": 0.02, "pes2o": 0.02, "arxiv": 0.006, "math": 0.003, "wiki": 0.001}


def random_cases(count: int, rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    cases = []
    for _ in range(count):
        n = int(2 * 500 ** (rng.random() ** 4))
        w = 1.0 / rng.permutation(np.arange(1, n + 1)) ** rng.uniform(0.8, 2.0) if rng.random() < 0.5 else rng.random(n)
        w[rng.random(n) < 0.1] = 0.0
        w[0] = w[0] or 1.0
        cases.append((w / w.sum(), int(rng.choice(BLOCK_SIZES))))
    return cases


def largest_remainder(p: np.ndarray, block: int) -> np.ndarray:
    exact = p * block
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: block - counts.sum()]] += 1
    return counts


def per_batch(rule: str, p: np.ndarray, block: int, first: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``[count, sources]`` samples of each source in global batches ``first .. first + count - 1``."""
    if rule == "ours":
        return Segment(0, block, tuple(p)).counts(np.arange(first, first + count))
    if rule == "whole counts":
        return np.broadcast_to(largest_remainder(p, block), (count, len(p)))
    return rng.multinomial(block, p, size=count)


def dense_deviation(
    rule: str, p: np.ndarray, block: int, batches: int, rng: np.random.Generator
) -> tuple[float, float]:
    """Worst ``|count - p G B|`` over every ``B <= batches`` and every source; share of batches within floor/ceil."""
    share = p * block
    drawn, worst, within, chunk = np.zeros(len(p)), 0.0, 0, 10_000
    for first in range(0, batches, chunk):
        counts = per_batch(rule, p, block, first, chunk, rng)
        within += int(((counts >= np.floor(share)) & (counts <= np.ceil(share))).all(axis=1).sum())
        cumulative = drawn + np.cumsum(counts, axis=0)
        worst = max(worst, float(np.abs(cumulative - share * np.arange(first + 1, first + chunk + 1)[:, None]).max()))
        drawn = cumulative[-1]
    return worst, within / batches


def far_deviation(p: np.ndarray, block: int, rng: np.random.Generator) -> float:
    """Ours at 12 batch counts drawn log-uniformly up to 10^12, every source, exactly (floor sums, fractions)."""
    segment = Segment(0, block, tuple(p))
    exact = [Fraction(x) for x in p]
    shares = [x / sum(exact) * block for x in exact]
    batches = np.unique(10 ** rng.uniform(5, 12, 12)).astype(np.int64)
    drawn = segment.drawn_before(batches)
    return max(
        float(abs(d - s * int(b)))
        for b, row in zip(batches, drawn, strict=True)
        for d, s in zip(row, shares, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=200)
    add_run_arguments(parser, data=False)
    args = parser.parse_args()
    cases_count, dense_batches, long_batches = (12, 10**4, 2 * 10**4) if args.quick else (args.cases, 10**5, 10**6)
    rng = np.random.default_rng(0)
    cases = random_cases(cases_count, rng)
    rows = []
    for rule in ("ours", "whole counts", "independent draws"):
        dense = [dense_deviation(rule, p, g, dense_batches, rng) for p, g in cases]
        small = [(p, g) for p, g in cases if len(p) <= 64][:20]
        long = [dense_deviation(rule, p, g, long_batches, rng)[0] for p, g in small]
        rows.append(
            {
                "rule": rule,
                DENSE: max(d for d, _ in dense),
                f"worst, every B <= {long_batches:,} ({len(small)} vectors)": max(long),
                FAR: max(far_deviation(p, g, rng) for p, g in cases) if rule == "ours" else "-",
                "batches within floor/ceil": min(w for _, w in dense),
            }
        )
    olmo = np.array(list(OLMO.values()))
    olmo_rows = [
        {
            "rule": rule,
            **{name: int(n) for name, n in zip(OLMO, per_batch(rule, olmo, 256, 0, 10**5, rng).sum(0), strict=True)},
        }
        for rule in ("ours", "whole counts", "independent draws")
    ]
    olmo_rows.append({"rule": "asked (p x 256 x 10^5)", **{name: p * 256 * 10**5 for name, p in OLMO.items()}})
    ours = rows[0]
    report(
        "mixture_shares",
        {
            f"Distance from the shares, in samples ({len(cases)} weight vectors, every B up to {dense_batches:,})": (
                list(rows[0]),
                rows,
            ),
            "An OLMo-2-like mix at a global batch of 256: samples in 10^5 batches": (list(olmo_rows[0]), olmo_rows),
        },
        config={"cases": len(cases), "block sizes": list(BLOCK_SIZES), "long horizon": long_batches},
        checks={
            f"ours within 6 samples at every B <= {dense_batches:,} ({ours[DENSE]:.2f})": ours[DENSE] <= 6,
            f"ours within 12 samples at sampled B <= 10^12 ({ours[FAR]:.2f})": ours[FAR] <= 12,
            "ours: every batch holds the floor or ceiling of every share": ours["batches within floor/ceil"] == 1.0,
            f"ours: wiki within 6 of 25,600 ({olmo_rows[0]['wiki']})": abs(olmo_rows[0]["wiki"] - 25_600) <= 6,
        },
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
