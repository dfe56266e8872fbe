"""The global sample plan: a pure, O(1)-seekable function from position to sample."""

from __future__ import annotations

import numpy as np
import pytest

from datamodules.permutation import permute, round_keys
from datamodules.sample_plan import PlannedSource, SamplePlan, describe_changes


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


def test_fingerprint_and_description_name_what_changed() -> None:
    a, b = plan(100, seed=1), SamplePlan((PlannedSource("train", 120, "other"),), seed=2)
    assert a.fingerprint != b.fingerprint
    assert describe_changes(a.describe(), b.describe()) == [
        "seed: 1 -> 2",
        "source 'train' num_samples: 100 -> 120",
        "source 'train' fingerprint: 'hash' -> 'other'",
    ]


def test_a_source_without_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="source 'train' has no samples"):
        plan(0)
