"""MultipackBatchSampler and the packer under it: full rows, balanced ranks, rows independent of
the number of ranks, fresh rows every pass, every sample once per pass."""

from __future__ import annotations

import numpy as np
import pytest

from datamodules import MultipackBatchSampler
from datamodules.plan.multipack import PackedRows, best_fit_decreasing, order_by

BUDGET = 8192


def lognormal_lengths(n: int, mean: float = 2700.0, sigma: float = 0.8, seed: int = 0) -> np.ndarray:
    """Conversation lengths as they come: lognormal with the given mean, some longer than a row."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)).astype(np.int64)


def one_by_one_best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """The textbook algorithm: each item, largest first, into the open row with the least room that fits."""
    rows: list[list[int]] = []
    rooms: list[int] = []
    for size in sorted(sizes, reverse=True):
        fits = [i for i, room in enumerate(rooms) if room >= size]
        if fits:
            best = min(fits, key=lambda i: rooms[i])
            rows[best].append(size)
            rooms[best] -= size
        else:
            rows.append([size])
            rooms.append(capacity - size)
    return rows


@pytest.mark.parametrize("seed", range(20))
def test_bulk_best_fit_packs_like_placing_items_one_by_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(20, 200))
    sizes = rng.integers(1, capacity + 1, int(rng.integers(1, 400)))
    row_of, num_rows = best_fit_decreasing(sizes, capacity, rng.integers(0, 2**62, len(sizes)).astype(np.uint64))
    # Rows with equal room are interchangeable, so compare the fills (the multiset of rooms is what
    # best fit's choices depend on), not which row got which item.
    ours = sorted(np.bincount(row_of, weights=sizes, minlength=num_rows).astype(int).tolist())
    reference = sorted(sum(row) for row in one_by_one_best_fit_decreasing(sizes.tolist(), capacity))
    assert ours == reference


@pytest.mark.parametrize("largest", [5, 2000, 2**20])
def test_order_by_orders_as_lexsort_does(largest: int) -> None:
    # The packer's sorts (sizes then tie keys; rows by fill then keys) must keep lexsort's order,
    # or every pass's rows would change; 2**20 is past the 16 bits numpy radix-sorts.
    rng = np.random.default_rng(largest)
    small = rng.integers(0, largest + 1, 50_000)
    keys = rng.choice(2**62, 50_000, replace=False).astype(np.uint64)
    assert (order_by(small, keys) == np.lexsort((keys, small))).all()


def test_no_items_order_and_pack_into_no_rows() -> None:
    nothing = np.array([], dtype=np.int64)
    assert order_by(nothing, nothing.astype(np.uint64)).size == 0
    rows_of, num_rows = best_fit_decreasing(nothing, 10, nothing.astype(np.uint64))
    assert rows_of.size == 0 and num_rows == 0


def test_the_sampler_hands_out_its_planned_rows_in_order_past_one_block() -> None:
    lengths = lognormal_lengths(8000, mean=600)
    sampler = MultipackBatchSampler(lengths, 2048, num_replicas=2, rank=1, seed=4)
    sampler.set_epoch(1)
    assert len(sampler) > 1024  # more steps than one block of located rows
    planned = sampler.planned_rows(np.arange(len(sampler), 2 * len(sampler)))[:, 1]
    assert list(sampler) == [sampler.packed.row(pass_, row).tolist() for pass_, row in planned.tolist()]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_rows_are_full_and_ranks_balanced_at_any_rank_count(ranks: int) -> None:
    lengths = lognormal_lengths(20_000)
    samplers = [MultipackBatchSampler(lengths, BUDGET, num_replicas=ranks, rank=r, seed=3) for r in range(ranks)]
    report = samplers[0].efficiency()
    assert report.token_efficiency >= 0.995
    assert report.balanced_steps >= 0.99
    steps = [list(s) for s in samplers]
    for rank_rows in steps:
        for row in rank_rows:
            assert lengths[row].clip(max=BUDGET).sum() <= BUDGET
    per_step = np.array([[lengths[row].clip(max=BUDGET).sum() for row in step] for step in zip(*steps, strict=True)])
    assert (per_step.max(axis=1) <= 1.02 * per_step.min(axis=1)).mean() >= 0.99


def test_the_sequence_of_rows_does_not_depend_on_the_number_of_ranks() -> None:
    lengths = lognormal_lengths(3000)

    def rows_in_step_order(ranks: int, steps: int) -> list[list[int]]:
        per_rank = [
            list(MultipackBatchSampler(lengths, BUDGET, num_replicas=ranks, rank=r))[:steps] for r in range(ranks)
        ]
        return [row for step in zip(*per_rank, strict=True) for row in step]

    one = rows_in_step_order(1, 96)
    assert rows_in_step_order(2, 48) == one
    assert rows_in_step_order(4, 24) == one
    assert rows_in_step_order(8, 12) == one


def test_rows_follow_the_seed_and_epoch_and_change_composition_every_pass() -> None:
    lengths = lognormal_lengths(3000)
    sampler = MultipackBatchSampler(lengths, BUDGET, seed=11)
    again = MultipackBatchSampler(lengths, BUDGET, seed=11)
    assert list(sampler) == list(again)
    assert list(MultipackBatchSampler(lengths, BUDGET, seed=12)) != list(sampler)
    packed = sampler.packed
    compositions = [{frozenset(packed.row(p, r).tolist()) for r in range(len(packed))} for p in range(3)]
    # Not one packing reshuffled: most rows of one pass hold a set of samples no row of the next holds.
    for this, following in zip(compositions, compositions[1:], strict=False):
        assert len(this - following) > 0.5 * len(this)
    sampler.set_epoch(1)
    again.set_epoch(1)
    assert list(sampler) == list(again)


def test_every_sample_is_in_exactly_one_row_of_each_pass() -> None:
    lengths = lognormal_lengths(2000)
    packed = PackedRows(lengths, BUDGET, seed=5)
    for pass_ in range(3):
        samples = np.concatenate([packed.row(pass_, r) for r in range(len(packed))])
        assert sorted(samples.tolist()) == list(range(len(lengths)))


def test_epochs_continue_through_the_plan_so_no_row_is_skipped() -> None:
    lengths = lognormal_lengths(1500)
    ranks = 4
    samplers = [MultipackBatchSampler(lengths, BUDGET, num_replicas=ranks, rank=r, max_batches=7) for r in range(ranks)]
    packed, steps = samplers[0].packed, len(samplers[0])
    assert steps == 7
    trained = []
    for epoch in range(-(-len(packed) // (steps * ranks))):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        trained += [frozenset(row) for step in zip(*per_rank, strict=True) for row in step]
    first_pass = [frozenset(packed.row(0, r).tolist()) for r in range(len(packed))]
    assert trained[: len(packed)] == first_pass


def test_over_long_samples_are_truncated_or_dropped_and_counted() -> None:
    lengths = np.array([BUDGET + 500, 100, 2 * BUDGET, 300, 4000])
    truncated = PackedRows(lengths, BUDGET)
    assert truncated.truncated == 2 and truncated.dropped == 0
    assert sorted(np.concatenate([truncated.row(0, r) for r in range(len(truncated))]).tolist()) == [0, 1, 2, 3, 4]
    dropped = PackedRows(lengths, BUDGET, over_long="drop")
    assert dropped.dropped == 2 and dropped.truncated == 0
    assert sorted(np.concatenate([dropped.row(0, r) for r in range(len(dropped))]).tolist()) == [1, 3, 4]
    sampler = MultipackBatchSampler(lengths, BUDGET, over_long="drop")
    assert sampler.efficiency().dropped == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [10, 0, 5]}, "1 samples have no tokens"),
        ({"lengths": []}, "non-empty"),
        ({"total_seq_len": 0}, "total_seq_len must be a positive integer, got 0"),
        ({"over_long": "wrap"}, "over_long must be one of"),
        ({"length_quantum": 0}, "length_quantum must be a positive integer"),
        ({"lengths": [9000], "over_long": "drop"}, "every sample is longer"),
    ],
)
def test_bad_packing_arguments_are_refused_with_the_value(kwargs: dict, message: str) -> None:
    args = {"lengths": [100, 200, 300], "total_seq_len": 1024, **kwargs}
    with pytest.raises(ValueError, match=message):
        PackedRows(np.asarray(args.pop("lengths")), **args)


def test_more_ranks_than_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="2 packed rows of 1000 tokens cannot give each of 4 ranks"):
        MultipackBatchSampler([900, 900], 1000, num_replicas=4, rank=0)


def test_a_cap_on_images_a_row_holds_in_every_row_and_costs_no_room_where_tokens_bind_first() -> None:
    rng = np.random.default_rng(3)
    images = rng.poisson(1.5, 4000)
    images[rng.random(len(images)) < 0.05] = 12  # a few pages of pictures
    lengths = lognormal_lengths(len(images), mean=600) + 256 * images  # text, and 256 tokens an image
    free = PackedRows(lengths, BUDGET, seed=1)
    assert max(int(images[free.row(0, r)].sum()) for r in range(len(free))) > 16
    for cap in (16, 32):
        packed = PackedRows(lengths, BUDGET, seed=1, images=images, max_images_per_row=cap)
        for pass_ in range(3):
            rows = [packed.row(pass_, r) for r in range(len(packed))]
            assert sorted(np.concatenate(rows).tolist()) == list(range(len(lengths)))  # every sample once a pass
            assert max(int(images[r].sum()) for r in rows) <= cap
            assert max(int(np.minimum(lengths, BUDGET)[r].sum()) for r in rows) <= BUDGET
    # 32 images of 256 tokens fill a row: the cap never binds, and the rows are the ones without it.
    assert len(packed) == len(free)
    rows_of = lambda p: [p.row(1, r).tolist() for r in range(len(p))]  # noqa: E731
    assert rows_of(packed) == rows_of(free)


def test_a_sample_with_more_images_than_a_row_holds_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"more than max_images_per_row=4 images, the first \(index 1\) 5"):
        PackedRows(np.array([10, 10]), 100, images=np.array([1, 5]), max_images_per_row=4)
