"""A mixture's per-block counts: floor or ceiling of each share in every block, and exact over the run.

The reference is the arithmetic itself: source ``d`` of probability ``p_d`` (normalized exactly) must
have drawn ``p_d * G * B`` samples, within a few, after ``B`` blocks of ``G``, for every ``B``.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from datamodules.plan import sample_plan
from datamodules.plan.sample_plan import PlannedSource, SamplePlan, Segment, floor_sum

BLOCK_SIZES = (8, 64, 256, 4096)
DENSE_BLOCKS = 10**5
CHUNK = 5_000


def random_probabilities(rng: np.random.Generator, num_sources: int) -> tuple[float, ...]:
    """Zipf-like tails or uniform draws, with about one source in ten at weight 0."""
    if rng.random() < 0.5:
        weights = 1.0 / rng.permutation(np.arange(1, num_sources + 1)) ** rng.uniform(0.8, 2.0)
    else:
        weights = rng.random(num_sources)
    weights[rng.random(num_sources) < 0.1] = 0.0
    if not weights.any():
        weights[rng.integers(num_sources)] = 1.0
    return tuple(float(w) for w in weights / weights.sum())


def random_cases(count: int, seed: int) -> list[tuple[tuple[float, ...], int]]:
    rng = np.random.default_rng(seed)
    # Mostly a few sources, sometimes hundreds: 2 * 500 ** (u ** 6) spans 2 .. 1,000.
    sizes = [int(2 * 500 ** (rng.random() ** 6)) for _ in range(count - 2)] + [1000, 1000]
    return [(random_probabilities(rng, n), int(rng.choice(BLOCK_SIZES))) for n in sizes]


CASES = random_cases(200, seed=7)


def exact_shares(probabilities: tuple[float, ...], block_size: int) -> list[Fraction]:
    """Each source's samples per block, exactly: ``p_d / sum(p) * G``."""
    exact = [Fraction(p) for p in probabilities]
    total = sum(exact)
    return [p / total * block_size for p in exact]


def test_every_block_holds_floor_or_ceiling_of_each_share_and_every_run_of_blocks_tracks_the_shares() -> None:
    """200 weight vectors: per block within floor/ceil summing to G; cumulative error <= 6 at every
    block boundary up to 10^5; a zero weight never drawn."""
    worst = 0.0
    for probabilities, block_size in CASES:
        segment = Segment(0, block_size, probabilities)
        shares = np.array([float(s) for s in exact_shares(probabilities, block_size)])
        low = np.floor(shares).astype(np.int64)
        fractions = (shares - low).astype(np.float32)
        extras_drawn = np.zeros(len(shares), dtype=np.int32)
        for first in range(0, DENSE_BLOCKS, CHUNK):
            counts = segment.counts(np.arange(first, first + CHUNK))
            assert (counts.sum(axis=1) == block_size).all(), "a block does not hold G samples"
            extras = (counts - low).astype(np.int8)
            assert ((extras == 0) | (extras == 1)).all(), "a block holds other than the floor or ceiling of a share"
            assert not counts[:, shares == 0].any(), "a source of weight 0 was drawn"
            # The floors are exact; the error is the extras' against the fractional parts.
            cumulative = np.cumsum(extras, axis=0, dtype=np.int32) + extras_drawn
            blocks = np.arange(first + 1, first + CHUNK + 1, dtype=np.float32)[:, None]
            worst = max(worst, float(np.abs(cumulative - fractions * blocks).max()))
            extras_drawn = cumulative[-1]
    assert worst <= 6, f"a source's count strayed {worst:.2f} samples from its share within 10^5 blocks"


def test_far_block_boundaries_stay_within_12_samples_of_the_shares() -> None:
    """At sampled boundaries up to 10^12 blocks, the closed form (floor sums) is within 12 of the exact share."""
    rng = np.random.default_rng(11)
    for probabilities, block_size in CASES[::4]:
        segment = Segment(0, block_size, probabilities)
        shares = exact_shares(probabilities, block_size)
        checked = np.unique(np.concatenate([rng.choice(len(shares), min(8, len(shares)), replace=False), [0]]))
        blocks = np.unique(10 ** rng.uniform(5, 12, 6)).astype(np.int64)
        drawn = segment.drawn_before(blocks, checked)
        for row, b in enumerate(blocks.tolist()):
            for column, d in enumerate(checked.tolist()):
                assert abs(drawn[row, column] - shares[d] * b) <= 12, (probabilities, block_size, b, d)


def test_the_closed_form_agrees_with_counting_block_by_block() -> None:
    probabilities, block_size = CASES[3]
    segment = Segment(0, block_size, probabilities)
    counted = np.cumsum(segment.counts(np.arange(20_000)), axis=0)
    blocks = np.array([1, 2, 17, 4_095, 4_096, 9_999, 20_000])
    assert np.array_equal(segment.drawn_before(blocks), counted[blocks - 1])
    # Each block on its own, far apart: one closed form each.
    assert np.array_equal(segment.drawn_before(np.array([17, 20_000])), counted[[16, 19_999]])


def test_an_olmo_like_mix_gives_every_source_its_share_over_100k_global_batches() -> None:
    """dclm 0.95, code 0.02, pes2o 0.02, arxiv 0.006, math 0.003, wiki 0.001 at G = 256: wiki 25,600 +/- 6."""
    probabilities = (0.95, 0.02, 0.02, 0.006, 0.003, 0.001)
    segment = Segment(0, 256, probabilities)
    drawn = segment.counts(np.arange(10**5)).sum(axis=0)
    expected = np.array(probabilities) * 256 * 10**5
    assert np.abs(drawn - expected).max() <= 6, drawn.tolist()
    assert np.array_equal(segment.drawn_before(np.array([10**5]))[0], drawn)


def test_locate_agrees_with_samples_drawn_near_and_far() -> None:
    probabilities, block_size = (0.5, 0.3, 0.15, 0.049, 0.001), 64
    sources = tuple(PlannedSource(f"s{i}", n, "x") for i, n in enumerate([1000, 700, 300, 90, 5]))
    segments = (Segment(0, block_size, probabilities), Segment(64 * 500, 8, (0.0, 0.1, 0.2, 0.3, 0.4)))
    plan = SamplePlan(sources, seed=3, segments=segments)
    located, _ = plan.locate(np.arange(64 * 500 + 8 * 300))
    for position in (0, 1, 63, 64, 640, 64 * 500, 64 * 500 + 5, 64 * 500 + 8 * 300):
        assert np.array_equal(plan.samples_drawn(position), np.bincount(located[:position], minlength=5))
    # Far away: a whole block's positions of each source draw exactly the samples after samples_drawn.
    first = 64 * 500 + 8 * 10**12
    block_sources, drawn = plan._mix(np.arange(first, first + 8))
    before = plan.samples_drawn(first)
    for s in range(5):
        assert sorted(drawn[block_sources == s].tolist()) == list(
            range(before[s], before[s] + (block_sources == s).sum())
        )
    assert np.array_equal(plan.samples_drawn(first + 8), before + np.bincount(block_sources, minlength=5))


def test_locate_agrees_with_samples_drawn_on_random_mixtures() -> None:
    for probabilities, block_size in CASES[::20]:
        sizes = [block_size + 7 * i for i in range(len(probabilities))]
        sources = tuple(PlannedSource(f"s{i}", n, "x") for i, n in enumerate(sizes))
        plan = SamplePlan(sources, seed=1, segments=(Segment(0, block_size, probabilities),))
        located, _ = plan.locate(np.arange(block_size * 40))
        for blocks in (1, 13, 40):
            counted = np.bincount(located[: blocks * block_size], minlength=len(sizes))
            assert np.array_equal(plan.samples_drawn(blocks * block_size), counted)


def test_the_offsets_step_by_the_golden_ratios_fibonacci_approximation() -> None:
    """The discrepancy bound rests on a continued fraction of all ones: consecutive Fibonacci numbers."""
    quotients, (a, b) = [], (sample_plan._PERIOD, sample_plan._STEP)
    while b:
        quotients.append(a // b)
        a, b = b, a % b
    assert quotients[:-1] == [1] * (len(quotients) - 1) and quotients[-1] == 2 and a == 1
    assert sample_plan._PERIOD > 10**12  # no repetition within the runs the bound is stated for


@pytest.mark.parametrize(("n", "m", "a", "b"), [(1, 1, 0, 0), (7, 3, 2, 5), (100, 17, 40, 3), (64, 2**64, 3, 2**63)])
def test_floor_sum_matches_the_sum_it_stands_for(n: int, m: int, a: int, b: int) -> None:
    assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


def test_a_share_a_hair_off_a_whole_count_is_that_count_in_every_block() -> None:
    """0.7 and 0.3 are not exact in binary; blocks of 10 still hold 7 and 3, not 8 and 2 now and then."""
    counts = Segment(0, 10, (0.7, 0.3)).counts(np.arange(10**5))
    assert (counts == [7, 3]).all()
