"""The global sample plan: a pure, O(1)-seekable function from position to sample."""

from __future__ import annotations

import numpy as np
import pytest

from datamodules.plan.permutation import permute, round_keys
from datamodules.plan.sample_plan import (
    PlannedSource,
    SamplePlan,
    Segment,
    describe_changes,
)


def plan(n: int, seed: int = 0) -> SamplePlan:
    return SamplePlan((PlannedSource("train", n, "hash"),), seed=seed)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_every_pass_is_a_permutation_of_all_samples(n: int) -> None:
    p = plan(n)
    for pass_index in range(3):
        _, indices = p.locate(np.arange(pass_index * n, (pass_index + 1) * n))
        assert sorted(indices.tolist()) == list(range(n))


def test_passes_are_shuffled_differently() -> None:
    _, indices = plan(1000).locate(np.arange(2000))
    assert not np.array_equal(indices[:1000], indices[1000:])
    assert not np.array_equal(indices[:1000], np.arange(1000))


def test_locate_is_pure_and_independent_of_how_positions_are_grouped() -> None:
    p = plan(12345, seed=3)
    positions = np.arange(50_000, 60_000)
    _, together = p.locate(positions)
    pieces = [p.locate(chunk)[1] for chunk in np.array_split(positions, 7)]
    assert np.array_equal(together, np.concatenate(pieces))
    assert np.array_equal(together, plan(12345, seed=3).locate(positions)[1])


def test_seed_changes_the_order() -> None:
    assert not np.array_equal(plan(1000, 1).locate(np.arange(1000))[1], plan(1000, 2).locate(np.arange(1000))[1])


def test_seek_far_beyond_the_first_pass_matches_the_pass_permutation() -> None:
    n = 10**10
    position = 10**12
    _, (index,) = plan(n, seed=5).locate(np.array([position]))
    assert index == permute(np.array([position % n]), n, round_keys(5, 0, np.array([position // n])))[0]
    assert 0 <= index < n


def test_plan_changes_are_described_by_name() -> None:
    saved = {"seed": 1, "sources": [{"name": "train", "num_samples": 100, "fingerprint": "hash"}]}
    current = {"seed": 2, "sources": [{"name": "train", "num_samples": 120, "fingerprint": "other"}]}
    assert describe_changes(saved, current) == [
        "seed: 1 -> 2",
        "source 'train' num_samples: 100 -> 120",
        "source 'train' fingerprint: 'hash' -> 'other'",
    ]
    assert describe_changes(saved, {**saved, "sources": []}) == ["source 'train' removed"]


def test_a_source_without_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="source 'train' has no samples"):
        plan(0)


def mixture(seed: int = 0) -> SamplePlan:
    sources = (PlannedSource("a", 100, "x"), PlannedSource("b", 30, "y"), PlannedSource("c", 7, "z"))
    segments = (
        Segment(0, 10, (0.5, 0.3, 0.2)),
        Segment(50, 16, (0.0, 0.25, 0.75)),
    )
    return SamplePlan(sources, seed=seed, segments=segments)


def test_every_mixture_block_holds_exactly_its_segment_counts() -> None:
    sources, _ = mixture().locate(np.arange(50 + 16 * 20))
    for block in range(5):
        assert np.bincount(sources[block * 10 : (block + 1) * 10], minlength=3).tolist() == [5, 3, 2]
    for block in range(20):
        first = 50 + block * 16
        assert np.bincount(sources[first : first + 16], minlength=3).tolist() == [0, 4, 12]


def test_each_mixture_source_is_read_pass_after_pass_without_repeats() -> None:
    p = mixture()
    for blocks_after_switch in (0, 7, 20):
        end = 50 + 16 * blocks_after_switch
        sources, indices = p.locate(np.arange(end))
        for s, source in enumerate(p.sources):
            drawn = indices[sources == s]
            full_passes, extra = divmod(len(drawn), source.num_samples)
            seen = np.bincount(drawn, minlength=source.num_samples)
            # Up to a block boundary a source has drawn samples 0..D-1 of its pass sequence.
            assert set(seen.tolist()) <= {full_passes, full_passes + 1}
            assert (seen == full_passes + 1).sum() == extra


def test_mixture_locate_is_pure_and_seekable_in_any_grouping() -> None:
    p = mixture(seed=4)
    positions = np.arange(10**9, 10**9 + 3000)
    together = p.locate(positions)
    pieces = [p.locate(chunk) for chunk in np.array_split(positions, 11)]
    assert np.array_equal(together[0], np.concatenate([s for s, _ in pieces]))
    assert np.array_equal(together[1], np.concatenate([i for _, i in pieces]))


def test_a_segment_not_on_a_block_boundary_is_refused() -> None:
    sources = (PlannedSource("a", 10, "x"), PlannedSource("b", 10, "y"))
    with pytest.raises(ValueError, match="must start a whole number of blocks of 4"):
        SamplePlan(sources, segments=(Segment(0, 4, (0.5, 0.5)), Segment(6, 4, (0.25, 0.75))))
