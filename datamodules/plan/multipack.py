"""Multipack: samples packed into rows of at most ``total_seq_len`` tokens, packed afresh on every pass.

Rows are the plan's samples: step ``s``, data-parallel rank ``r`` reads row ``s*R + r``, so the rows
do not depend on the number of ranks, and exact, elastic resume and coverage come from the plan.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from datamodules.plan.arguments import require_int
from datamodules.plan.permutation import mix64
from datamodules.plan.sample_plan import PlannedSource, SamplePlan
from datamodules.storage.node_arrays import drop_node_arrays, node_array_names, node_arrays

log = logging.getLogger(__name__)

OverLong = Literal["truncate", "drop"]
_OVER_LONG = ("truncate", "drop")
# Length quanta per row: a sample's length is rounded up to a multiple of ``total_seq_len // 2048``
# tokens (4 at 8,192), so samples within one quantum are interchangeable to the packer.
_QUANTA_PER_ROW = 2048
_STEPS_LOCATED_AT_ONCE = 1024
NODE_KIND = "packed_rows-1"  # the node cache's folder for shared packings; its number: the arrays' format


def order_by(small: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Indices in order of ``small`` (non-negative integers), equal ones in order of ``keys`` (distinct).

    The order ``np.lexsort((keys, small))`` gives, at a fraction of its cost (0.04 s for a million,
    against 0.28 s): one sort of the keys, then a stable sort of ``small`` in the narrowest type that
    holds it, which numpy radix-sorts up to 16 bits.
    """
    by_key = np.argsort(keys)
    narrow = small[by_key].astype(np.min_scalar_type(small.max(initial=0)))  # initial: no items, no rows
    return by_key[np.argsort(narrow, kind="stable")]


def narrow_indices(indices: np.ndarray) -> np.ndarray:
    """Indices as int32 where they fit (half the bytes a node keeps), else int64."""
    return indices.astype(np.int32 if indices.max(initial=0) < 2**31 else np.int64)


def best_fit_decreasing(units: np.ndarray, capacity: int, tie_keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Row of each item under best-fit decreasing, and the number of rows.

    Items are integer sizes in ``[1, capacity]``; items of one size are placed together: best fit
    sends each to the open row with the least room that holds it, so a run of equal items fills the
    tightest rows first, ``room // size`` items each, then opens rows of ``capacity // size`` items.
    That is the same packing as placing them one by one, at a cost per distinct size, not per item.
    Equal items are taken in the order of ``tie_keys`` (distinct), so which items share a row follows
    the keys, while the number of rows and their fill depend on the sizes alone.
    """
    order = order_by(capacity - units, tie_keys)
    sizes, counts = np.unique(units[order], return_counts=True)
    row_of_sorted = np.empty(len(units), dtype=np.int64)
    open_rows = np.zeros(capacity + 1, dtype=np.int64)  # open rows by room left
    by_room: list[list[np.ndarray]] = [[] for _ in range(capacity + 1)]
    placed = num_rows = 0

    def fill(rows: np.ndarray, per_row: int, room: int, size: int) -> None:
        nonlocal placed
        row_of_sorted[placed : placed + len(rows) * per_row] = np.repeat(rows, per_row)
        placed += len(rows) * per_row
        left = room - per_row * size
        if left > 0:
            by_room[left].append(rows)
            open_rows[left] += len(rows)

    for size, count in zip(sizes[::-1].tolist(), counts[::-1].tolist(), strict=True):
        for room in (np.flatnonzero(open_rows[size:]) + size).tolist():
            rows = np.concatenate(by_room[room])
            by_room[room], open_rows[room] = [], 0
            per_row = room // size
            full = min(len(rows), count // per_row)
            fill(rows[:full], per_row, room, size)
            count -= full * per_row
            rest = rows[full:]
            if len(rest) and count:
                fill(rest[:1], count, room, size)
                rest, count = rest[1:], 0
            if len(rest):
                by_room[room].append(rest)
                open_rows[room] += len(rest)
            if not count:
                break
        if count:
            per_row = capacity // size
            full, partial = divmod(count, per_row)
            fill(np.arange(num_rows, num_rows + full), per_row, capacity, size)
            num_rows += full
            if partial:
                fill(np.array([num_rows]), partial, capacity, size)
                num_rows += 1
    row_of = np.empty(len(units), dtype=np.int64)
    row_of[order] = row_of_sorted
    return row_of, num_rows


def row_layout(lengths: list[list[int]], total_seq_len: int, most: int) -> dict[str, Any]:
    """Where the samples packed in each row sit: ``position_ids`` ``[B, T]`` restarting at 0 in each
    (and in the row's padding), ``document_ids`` ``[B, T]`` (a sample's place in its row, -1 on
    padding), and ``cu_seqlens`` ``[B * (most + 1) + 1]`` int32, the offsets of the samples (and of
    each row's padding) in the ``B * T`` tokens flattened, as flash-attention's varlen kernels take
    them, padded to a fixed length with the total; ``num_sequences`` of them are real and
    ``max_seqlen`` is the longest. ``lengths[b]``: the tokens of row ``b``'s samples, in order;
    ``most``: the most samples a row can hold."""
    count, length = len(lengths), total_seq_len
    positions = np.zeros((count, length), dtype=np.int64)
    documents = np.full((count, length), -1, dtype=np.int64)
    sequences = np.full(count * (most + 1) + 1, count * length, dtype=np.int32)
    sequences[0], at, longest = 0, 1, 0
    for b, row in enumerate(lengths):
        filled = 0
        for document, n in enumerate(row):
            positions[b, filled : filled + n] = np.arange(n)
            documents[b, filled : filled + n] = document
            filled += n
            sequences[at], at, longest = b * length + filled, at + 1, max(longest, n)
        if filled < length:  # the row's padding: one sequence of its own
            positions[b, filled:] = np.arange(length - filled)
            sequences[at], at, longest = (b + 1) * length, at + 1, max(longest, length - filled)
    return {
        "position_ids": positions,
        "document_ids": documents,
        "cu_seqlens": sequences,
        "num_sequences": at - 1,
        "max_seqlen": longest,
    }


@dataclass(frozen=True)
class PackingReport:
    """How well a set of rows is packed.

    ``token_efficiency`` is tokens / (rows x ``total_seq_len``); ``balanced_steps`` the fraction of
    steps whose rows (one per rank) hold tokens within ``max/min <= 1.02`` of each other.
    """

    rows: int
    samples: int
    tokens: int
    total_seq_len: int
    token_efficiency: float
    balanced_steps: float
    truncated: int
    dropped: int


class PackedRows:
    """Every pass's packing of samples with these ``lengths`` into rows of ``total_seq_len`` tokens.

    Pass ``p`` packs by best-fit decreasing on lengths rounded up to a quantum, equal lengths in an
    order keyed by ``(seed, p)``: the rows' composition changes from pass to pass while their number
    stays the same, which keeps the plan's positions (and so resume) O(1).

    Args:
        lengths: tokens of each sample (>= 1).
        total_seq_len: tokens per row.
        seed: the data-order seed.
        over_long: a sample longer than a row is cut to ``total_seq_len`` tokens (``"truncate"``)
            or left out (``"drop"``); either way it is counted (``truncated``, ``dropped``), for the
            caller to log.
        length_quantum: lengths are rounded up to a multiple of this for packing (more samples
            trade places between passes; the rows lose at most ``quantum - 1`` tokens a sample);
            default ``total_seq_len // 2048``, at least 1.
        max_length: the longest sample kept whole (``over_long`` applies past it), at most
            ``total_seq_len`` (the default).
        shared_as: a name for these lengths and options: the per-sample arrays and each pass's
            packing are then computed once on the node and mapped by its processes
            (``node_arrays``); ``None`` (the default): computed and held by this process.
        images: images of each sample, for ``max_images_per_row`` (each at most that many).
        max_images_per_row: the most images a row holds. A sample then takes the room of its tokens
            or of its share of the row's images, whichever is more (``images * capacity / max``,
            rounded up): rows within capacity are then within both budgets, and a single packing
            problem remains. It costs room only to samples richer in images than the cap's average.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        total_seq_len: int,
        *,
        seed: int = 0,
        over_long: OverLong = "truncate",
        length_quantum: int | None = None,
        max_length: int | None = None,
        shared_as: str | None = None,
        images: np.ndarray | None = None,
        max_images_per_row: int | None = None,
    ) -> None:
        if (images is None) != (max_images_per_row is None):
            raise ValueError("images and max_images_per_row go together")
        self.max_images_per_row = None if images is None else require_int("max_images_per_row", max_images_per_row, 1)
        self.total_seq_len = require_int("total_seq_len", total_seq_len, 1)
        self.max_length = total_seq_len if max_length is None else require_int("max_length", max_length, 1)
        if self.max_length > total_seq_len:
            raise ValueError(f"max_length={max_length} is longer than a row (total_seq_len={total_seq_len})")
        if over_long not in _OVER_LONG:
            raise ValueError(f"over_long must be one of {_OVER_LONG}, got {over_long!r}")
        quantum = max(1, total_seq_len // _QUANTA_PER_ROW) if length_quantum is None else length_quantum
        self.quantum = require_int("length_quantum", quantum, 1)
        if self.quantum > total_seq_len:
            raise ValueError(f"length_quantum={quantum} is larger than total_seq_len={total_seq_len}")
        self.seed, self.shared_as = seed, shared_as
        packing = (total_seq_len, self.quantum, over_long) + ((self.max_length,) if max_length is not None else ())
        packing += (max_images_per_row,) if images is not None else ()
        base = self._arrays("base", lambda: self._base(lengths, over_long, packing, images))
        self.lengths, self._units = base["lengths"], base["units"]
        self.kept = base.get("kept")  # the samples packed, where some are dropped; else all of them
        self.num_kept = len(self._units)
        self.truncated, self.dropped = int(base["truncated"]), int(base["dropped"])
        self.fingerprint = str(base["fingerprint"])
        self.most_per_row = int(base["most_per_row"])  # samples a row can hold at most: the shortest ones
        self._capacity = total_seq_len // self.quantum
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.num_rows = int(base["num_rows"])

    def _base(
        self, lengths: np.ndarray, over_long: str, packing: tuple, images: np.ndarray | None
    ) -> dict[str, np.ndarray]:
        """The per-sample arrays every pass packs from: lengths cut to ``max_length``, the samples kept
        (with ``"drop"``), their sizes in quanta; the counts cut and left out; the fingerprint of
        lengths and options. Each in the narrowest type that holds it (a node keeps them)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or not len(lengths):
            raise ValueError(f"lengths must be a non-empty 1-D sequence, got shape {lengths.shape}")
        if lengths.min() < 1:
            bad = np.flatnonzero(lengths < 1)
            raise ValueError(f"{len(bad)} samples have no tokens (length < 1), the first at index {int(bad[0])}")
        long = lengths > self.max_length
        kept = np.flatnonzero(~long) if over_long == "drop" else np.arange(len(lengths))
        if not len(kept):
            raise ValueError(f"every sample is longer than {self.max_length} tokens: nothing left to pack")
        clipped = np.minimum(lengths, self.max_length)
        total = self.total_seq_len
        capacity = total // self.quantum
        identity = clipped.tobytes() + repr(packing).encode()
        units = np.minimum(-(-clipped[kept] // self.quantum), capacity)
        if images is not None:
            images = np.asarray(images, dtype=np.int64)
            if images.shape != lengths.shape or images.min() < 0:
                raise ValueError(f"images must be {len(lengths)} counts >= 0, one a sample, got shape {images.shape}")
            if images.max() > self.max_images_per_row:
                over = np.flatnonzero(images > self.max_images_per_row)
                raise ValueError(
                    f"{len(over)} samples hold more than max_images_per_row={self.max_images_per_row} images, "
                    f"the first (index {int(over[0])}) {int(images[over[0]])}"
                )
            units = np.maximum(units, -(-images[kept] * capacity // self.max_images_per_row))
            identity += images.tobytes()
        fingerprint = hashlib.blake2b(identity, digest_size=16).hexdigest()
        # Every pass packs into as many rows: the count depends on the sizes, not on the tie keys.
        _, num_rows = best_fit_decreasing(units, capacity, np.arange(len(units), dtype=np.uint64))
        return {
            "lengths": clipped.astype(np.int32),  # at most total_seq_len
            **({"kept": narrow_indices(kept)} if over_long == "drop" else {}),
            "units": units.astype(np.min_scalar_type(capacity)),
            "num_rows": np.array(num_rows),
            "most_per_row": np.array(max(1, int(np.searchsorted(np.cumsum(np.sort(clipped[kept])), total, "right")))),
            "truncated": np.array(int(long.sum()) if over_long == "truncate" else 0),
            "dropped": np.array(int(long.sum()) if over_long == "drop" else 0),
            "fingerprint": np.array(fingerprint),
        }

    def _arrays(self, name: str, make: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """``make``'s arrays: the node's (``shared_as``), or this process's own."""
        return make() if self.shared_as is None else node_arrays(NODE_KIND, f"{self.shared_as}/{name}", make)

    def __len__(self) -> int:
        return self.num_rows

    def _pack(self, pass_: int) -> tuple[np.ndarray, np.ndarray]:
        """Pass ``pass_``'s rows: the sample indices row after row, and where each row starts in them."""
        if pass_ not in self._cache:
            if len(self._cache) >= 2:  # a loader reads at most two passes at once (one epoch's turn)
                self._cache.pop(next(iter(self._cache)))
            packed = self._arrays(f"pass-{pass_}", lambda: self._packing_of(pass_))
            self._cache[pass_] = (packed["samples"], packed["offsets"])
        return self._cache[pass_]

    def _packing_of(self, pass_: int) -> dict[str, np.ndarray]:
        if self.shared_as is not None:  # the node's older passes go: a loader reads at most two at once
            for name in node_array_names(NODE_KIND, self.shared_as):
                _, _, last = name.rpartition("/")
                if last.startswith("pass-") and int(last.removeprefix("pass-")) < pass_ - 1:
                    drop_node_arrays(NODE_KIND, name)
        key = mix64(np.array([self.seed], dtype=np.uint64) ^ mix64(np.array([pass_ + 1], dtype=np.uint64)))
        tie_keys = mix64(np.arange(len(self._units), dtype=np.uint64) ^ key)
        row_of, num_rows = best_fit_decreasing(self._units, self._capacity, tie_keys)
        row_of = self._row_order(row_of, num_rows, key)[row_of]
        # Each row's samples in index order: one sort of the distinct keys row * n + index, a
        # sixth of a stable argsort's time on a million samples.
        n = len(row_of)
        order = np.sort(row_of * n + np.arange(n)) % n
        offsets = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(row_of, minlength=num_rows), out=offsets[1:])
        return {"samples": narrow_indices(order if self.kept is None else self.kept[order]), "offsets": offsets}

    def _row_order(self, row_of: np.ndarray, num_rows: int, key: np.ndarray) -> np.ndarray:
        """Where each packed row goes in the pass: rows within 1% of the fullest in an order keyed
        by the pass, then the rest, fullest first. Ranks read consecutive rows in a step, so the
        few under-filled rows best-fit leaves meet each other at the pass's end, not full rows."""
        kept = self.lengths if self.kept is None else self.lengths[self.kept]
        tokens = np.bincount(row_of, weights=kept, minlength=num_rows).astype(np.int64)
        keys = mix64(np.arange(num_rows, dtype=np.uint64) ^ mix64(key))
        full = tokens * 1.01 >= tokens.max()
        # Full rows rank 0; any other holds fewer tokens than the fullest, so its shortfall ranks it (>= 1).
        rank = order_by(np.where(full, 0, tokens.max() - tokens), keys)
        where = np.empty(num_rows, dtype=np.int64)
        where[rank] = np.arange(num_rows)
        return where

    def row(self, pass_: int, row: int) -> np.ndarray:
        """The sample indices of row ``row`` of pass ``pass_``."""
        samples, offsets = self._pack(pass_)
        return samples[offsets[row] : offsets[row + 1]]

    def row_tokens(self, pass_: int) -> np.ndarray:
        """Tokens of every row of pass ``pass_`` (lengths after truncation)."""
        samples, offsets = self._pack(pass_)
        return np.add.reduceat(self.lengths[samples].astype(np.int64), offsets[:-1])

    def report(self, rows_per_step: np.ndarray) -> PackingReport:
        """The packing of the rows ``rows_per_step`` (``[steps, ranks]`` of ``(pass, row)`` pairs)."""
        passes, rows = rows_per_step[..., 0], rows_per_step[..., 1]
        tokens = np.zeros(rows.shape, dtype=np.int64)
        samples = 0
        for pass_ in np.unique(passes).tolist():
            mine = passes == pass_
            tokens[mine] = self.row_tokens(pass_)[rows[mine]]
            offsets = self._pack(pass_)[1]
            samples += int((offsets[rows[mine] + 1] - offsets[rows[mine]]).sum())
        balanced = tokens.max(axis=1) <= 1.02 * tokens.min(axis=1)
        return PackingReport(
            rows=int(tokens.size),
            samples=samples,
            tokens=int(tokens.sum()),
            total_seq_len=self.total_seq_len,
            token_efficiency=float(tokens.sum() / (tokens.size * self.total_seq_len)),
            balanced_steps=float(balanced.mean()),
            truncated=self.truncated,
            dropped=self.dropped,
        )


class MultipackBatchSampler(DistributedSampler):
    """Yields, per step, the sample indices of this rank's packed row (at most ``total_seq_len`` tokens).

    The rows are the plan's: global position ``g`` is row ``g % K`` of pass ``g // K`` (``K`` rows
    a pass, in the order ``PackedRows`` gives them, keyed by the pass), and step ``s`` of rank ``r``
    reads position ``s*R + r``, so the same rows are trained whatever the number of ranks. Epoch ``e`` is steps
    ``[e*S, (e+1)*S)`` with ``S = K // R`` (or ``max_batches``): no row is skipped across epochs.
    It subclasses ``DistributedSampler``, so Lightning's default ``use_distributed_sampler=True``
    leaves it alone: pass it as ``sampler=`` with ``batch_size=None``, and the dataset gets the
    list of a row's indices (``datasets.Dataset`` returns their columns).

    Args:
        lengths: tokens of each sample.
        total_seq_len: tokens per row.
        num_replicas: data-parallel size; default: the initialised process group's, else 1.
        rank: data-parallel rank; default: the process group's, else 0.
        seed: the data-order seed; with the epoch (``set_epoch``) it fixes every row.
        over_long: ``"truncate"`` (default) or ``"drop"`` samples longer than a row; counted.
        max_batches: at most this many steps per epoch.
        length_quantum: lengths are rounded up to a multiple of this for packing (more samples
            trade places between passes; the rows lose at most ``quantum - 1`` tokens a sample);
            default ``total_seq_len // 2048``, at least 1.

    Example::

        sampler = MultipackBatchSampler(dataset["seq_len"], total_seq_len=8192, seed=7)
        loader = DataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=pack_row)
        print(sampler.efficiency().token_efficiency)
    """

    def __init__(
        self,
        lengths: np.ndarray,
        total_seq_len: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        over_long: OverLong = "truncate",
        max_batches: int | None = None,
        length_quantum: int | None = None,
    ) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        num_replicas = num_replicas if num_replicas is not None else dist.get_world_size() if initialised else 1
        rank = rank if rank is not None else dist.get_rank() if initialised else 0
        self.packed = PackedRows(lengths, total_seq_len, seed=seed, over_long=over_long, length_quantum=length_quantum)
        super().__init__(range(len(self.packed)), num_replicas=num_replicas, rank=rank, shuffle=False, seed=seed)
        if len(self.packed) < num_replicas:
            raise ValueError(
                f"{len(self.packed)} packed rows of {total_seq_len} tokens cannot give each of {num_replicas} "
                "ranks a row per step; use more samples or a smaller total_seq_len"
            )
        if self.packed.truncated or self.packed.dropped:
            how = "truncated to" if self.packed.truncated else "left out, longer than"
            count = self.packed.truncated or self.packed.dropped
            log.warning("%d of %d samples %s total_seq_len=%d", count, len(lengths), how, total_seq_len)
        self.max_batches = None if max_batches is None else require_int("max_batches", max_batches, 1)
        # Rows come in the packer's own order, keyed by the pass (see ``PackedRows``): the plan adds no shuffle.
        rows = PlannedSource("rows", len(self.packed), self.packed.fingerprint)
        self.plan = SamplePlan((rows,), seed=seed, shuffle=False)

    def __len__(self) -> int:
        steps = len(self.packed) // self.num_replicas
        return steps if self.max_batches is None else min(steps, self.max_batches)

    def planned_rows(self, steps: np.ndarray) -> np.ndarray:
        """``(pass, row)`` of every rank's row at each global step: shape ``[steps, ranks, 2]``."""
        positions = np.asarray(steps, dtype=np.int64)[:, None] * self.num_replicas + np.arange(self.num_replicas)
        _, rows, passes = self.plan.locate_in_passes(positions.ravel())
        return np.stack([passes, rows], axis=1).reshape(*positions.shape, 2)

    def _epoch_steps(self) -> np.ndarray:
        return np.arange(self.epoch * len(self), (self.epoch + 1) * len(self))

    def __iter__(self) -> Iterator[list[int]]:
        # Rows are located a block of steps at a time, so the first comes without converting the epoch's.
        steps = self._epoch_steps()
        for start in range(0, len(steps), _STEPS_LOCATED_AT_ONCE):
            planned = self.planned_rows(steps[start : start + _STEPS_LOCATED_AT_ONCE])[:, self.rank]
            for pass_, row in planned.tolist():
                yield self.packed.row(pass_, row).tolist()

    def efficiency(self) -> PackingReport:
        """Token efficiency and rank balance of this epoch's rows over all ranks."""
        return self.packed.report(self.planned_rows(self._epoch_steps()))
