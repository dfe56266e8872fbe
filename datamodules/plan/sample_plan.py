"""The global sample plan: a pure function from a global position to (source, index in source).

Order depends only on (seed, sources, schedule, position): not on ranks, workers or restarts. Each
pass over a source is shuffled by a fresh keyed bijection, and a mixture fixes every block's
per-source counts by its active probabilities, so nothing is materialized and any position is
reached in O(log position) per schedule segment.

How a mixture fills its blocks (one block = one global batch of ``G`` positions): the construction
issue 25 proposed, with one change. Source ``d`` of probability ``p_d`` gets ``floor(p_d G)`` slots
of every block; the ``R = G - sum floor`` slots left go one each to ``R`` sources by systematic
sampling: the fractional parts ``f_d = p_d G - floor(p_d G)`` are laid end to end on ``[0, R)``,
and block ``b`` gives an extra slot to the sources whose stretch holds one of the points ``u_b + j``
(``j = 0 .. R-1``). So every block holds each source's floor or ceiling of ``p_d G``, a zero
probability is never drawn, and the extras a source got in blocks ``[0, B)`` count the points of the
sequence ``u_b`` in its stretch, which stays within a few samples of ``f_d B`` for every ``B`` when
``u_b`` has low discrepancy. Largest-remainder counts, the same in every block, would instead give a
source its rounded count: 0.1% of 256 is 0 per block, so 0 over the run. Megatron's blend (greedy
largest error) tracks the shares as closely but can only be replayed from position 0, not sought.

The change: ``u_b = frac(1/2 + b * F59 / F60)`` (consecutive Fibonacci numbers, ~1.5 * 10^12) rather
than the golden ratio held as ``A / 2^64``. The continued fraction of ``F59 / F60`` is all ones, so
its discrepancy is the golden ratio's at every ``B`` up to its period; that of ``A / 2^64`` is the
golden ratio's only up to about 2^32 blocks, after which its partial quotients are arbitrary (one
such ``A`` strayed 77 samples at 4 * 10^11 blocks). The offset 1/2 keeps a share that a float's
rounding puts a hair off a whole count (0.7 of 10) from drawing an extra at block 0. Shares are
held in units of ``2^-64`` of a sample (exact fractions of the float probabilities), ``U_b`` in
uint64 without overflow, and a source's extras over ``B`` blocks are a difference of two floor sums
(``floor_sum``, a Euclid-like recursion in O(log B)). Measured by ``python -m
benchmarks.mixture_shares`` over 200 random weight vectors: see ``docs/sources/mixtures.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datamodules.plan.permutation import permute, round_keys

# Feistel stream id of the in-block shuffle; sources use their index as stream id.
_BLOCK_STREAM = 2**32
# Shares are held in units of 2^-64 of a sample per block.
_UNIT = 2**64
# The offsets u_b = frac(1/2 + b * _STEP / _PERIOD): consecutive Fibonacci numbers F(59) / F(60), the
# golden ratio's best approximation under 2^41, whose continued fraction is all ones: the golden
# ratio's low discrepancy for every run up to _PERIOD (1.5 * 10^12) blocks.
_PERIOD, _STEP = 1_548_008_755_920, 956_722_026_041
_HALF = _PERIOD // 2  # u_0 = 1/2: a share a float's rounding puts a hair off a whole count gets no extra
# What fixes how a mixture fills its blocks; part of a mixture's plan identity, so a checkpoint
# written under another rule is refused rather than read with another order.
MIXING_RULE = "floor counts plus systematic extras at Fibonacci offsets F59/F60 (plan 2)"


@dataclass(frozen=True)
class PlannedSource:
    """One source as the plan sees it: a name, a sample count and a fingerprint of its content.

    ``details`` are the plain settings behind the fingerprint (``seq_len``, the token range of a
    split, ...), so a refused resume can say in words what changed.
    """

    name: str
    num_samples: int
    fingerprint: str
    details: dict[str, Any] = field(default_factory=dict, compare=False)


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * i + b) / m) for i in range(n))`` for ``n, m >= 1`` and ``a, b >= 0``, in
    O(log m) steps (the Euclid-like recursion of AtCoder Library's ``floor_sum``)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y = a * n + b
        if y < m:
            return total
        n, b = divmod(y, m)
        m, a = a, m


def _points_below(blocks: int, bounds: list[int]) -> list[int]:
    """For each bound ``c``: how many offsets ``U_b = (b * _STEP + _HALF) mod _PERIOD``, ``b < blocks``, are ``< c``."""
    if blocks <= 0:
        return [0] * len(bounds)
    # [U_b < c] = 1 + floor((b S + H) / P) - floor((b S + H + P - c) / P), for 0 <= c <= P
    shared = blocks + floor_sum(blocks, _PERIOD, _STEP, _HALF)
    return [shared - floor_sum(blocks, _PERIOD, _STEP, _HALF + _PERIOD - c) if c > 0 else 0 for c in bounds]


def _offsets(blocks: np.ndarray) -> np.ndarray:
    """``U_b`` of each block, exactly, in uint64: ``b * _STEP`` is formed from two 21-bit halves of
    ``_STEP`` so that no product passes 2^63."""
    b = np.asarray(blocks, dtype=np.int64).astype(np.uint64) % np.uint64(_PERIOD)
    high = (b * np.uint64(_STEP >> 21)) % np.uint64(_PERIOD)
    low = b * np.uint64(_STEP & (2**21 - 1)) + np.uint64(_HALF)
    return ((high << np.uint64(21)) + low) % np.uint64(_PERIOD)


def quotas(probabilities: tuple[float, ...], block_size: int) -> list[int]:
    """Each source's samples per block in units of ``2^-64``, exact: proportional to the
    probabilities (normalized exactly), summing to ``block_size * 2^64``; zero stays zero."""
    ratios = [float(p).as_integer_ratio() for p in probabilities]
    common = max(den for _, den in ratios)  # floats' denominators are powers of two
    weights = [num * (common // den) for num, den in ratios]
    total, whole = sum(weights), block_size * _UNIT
    scaled = [w * whole for w in weights]
    out = [s // total for s in scaled]
    # Largest remainder; ties go to the earlier source.
    order = sorted(range(len(out)), key=lambda i: (-(scaled[i] % total), i))
    for i in order[: whole - sum(out)]:
        out[i] += 1
    return out


@dataclass(frozen=True)
class Segment:
    """From ``first_position`` on, blocks of ``block_size`` positions mix sources by ``probabilities``.

    Block ``b`` of the segment holds ``counts([b])`` samples of each source: the floor of
    ``p_d * block_size`` or its ceiling, summing to ``block_size``, such that every source's
    cumulative count stays within a few samples of ``p_d * block_size * b`` (see the module).
    """

    first_position: int
    block_size: int
    probabilities: tuple[float, ...]
    _floors: np.ndarray = field(init=False, repr=False, compare=False)
    _wholes: np.ndarray = field(init=False, repr=False, compare=False)
    _rests: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.probabilities
        if not p or not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in p) or sum(p) <= 0:
            raise ValueError(f"segment probabilities must be finite, >= 0 and not all zero, got {p}")
        shares = quotas(p, self.block_size)
        # The fractional parts laid end to end: stretch d is [ends[d], ends[d + 1]), in 2^-64 units.
        ends = [0]
        for share in shares:
            ends.append(ends[-1] + share % _UNIT)
        object.__setattr__(self, "_floors", np.array([s // _UNIT for s in shares], dtype=np.int64))
        object.__setattr__(self, "_wholes", np.array([e // _UNIT for e in ends], dtype=np.int64))
        # A point u_b lies below e / 2^64 iff U_b < ceil(e * P / 2^64): the stretch ends in U's units.
        rests = [-(-(e % _UNIT) * _PERIOD // _UNIT) for e in ends]
        object.__setattr__(self, "_rests", np.array(rests, dtype=np.uint64))

    @property
    def num_sources(self) -> int:
        return len(self.probabilities)

    @property
    def most_per_block(self) -> tuple[int, ...]:
        """The most samples of each source one block holds (the ceiling of ``p_d * block_size``)."""
        extra = np.diff(self._wholes) + (np.diff(self._rests.astype(np.int64)) != 0)
        return tuple(int(c) for c in self._floors + (extra > 0))

    def counts(self, blocks: np.ndarray, sources: np.ndarray | None = None) -> np.ndarray:
        """Samples of each source (or of ``sources``) in each of ``blocks``: ``[len(blocks), sources]``."""
        sources = np.arange(self.num_sources) if sources is None else np.asarray(sources)
        # Stretch d = [W_d + r_d, W_{d+1} + r_{d+1}) holds a point u + j iff the count of integers in
        # [stretch - u) is 1: ceil(W + r - u) differences, with ceil(r - u) = [r > u] for r, u in [0, 1).
        ends = np.union1d(sources, sources + 1)
        below = (_offsets(blocks)[:, None] < self._rests[ends][None, :]).view(np.int8)
        column = np.searchsorted(ends, sources)
        extras = below[:, column + 1] - below[:, column]
        return (self._floors[sources] + self._wholes[sources + 1] - self._wholes[sources])[None, :] + extras

    def drawn_before(self, blocks: np.ndarray, sources: np.ndarray | None = None) -> np.ndarray:
        """Samples of each source (or of ``sources``) in the segment's blocks ``[0, b)``, for each
        ``b`` of the sorted ``blocks``: ``[len(blocks), sources]``, in O(log b) per run of blocks."""
        sources = np.arange(self.num_sources) if sources is None else np.asarray(sources)
        blocks = np.asarray(blocks, dtype=np.int64)
        out = np.empty((len(blocks), len(sources)), dtype=np.int64)
        # Blocks within _DENSE_BLOCKS of a run's first share its closed form, then add block counts.
        if not len(blocks):
            return out
        breaks = np.flatnonzero(np.diff((blocks - blocks[0]) // _DENSE_BLOCKS)) + 1
        for run in np.split(np.arange(len(blocks)), breaks):
            first, last = int(blocks[run[0]]), int(blocks[run[-1]])
            base = self._closed_form(first, sources)
            between = np.cumsum(self.counts(np.arange(first, last), sources), axis=0)
            between = np.concatenate([np.zeros((1, len(sources)), dtype=np.int64), between])
            out[run] = base[None, :] + between[blocks[run] - first]
        return out

    def _closed_form(self, blocks: int, sources: np.ndarray) -> np.ndarray:
        """Samples of ``sources`` in blocks ``[0, blocks)``: the floors, plus the extras, whose count
        is the points ``u_b + j`` in each source's stretch (two floor sums a stretch end)."""
        ends = np.union1d(sources, sources + 1).tolist()
        below = _points_below(blocks, [int(self._rests[e]) for e in ends])
        inside = {e: int(self._wholes[e]) * blocks + n for e, n in zip(ends, below, strict=True)}
        extras = np.array([inside[int(d) + 1] - inside[int(d)] for d in sources], dtype=np.int64)
        return self._floors[sources] * blocks + extras


# Blocks this close are counted block by block from one closed form, not one closed form each.
_DENSE_BLOCKS = 4096


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` without its sort where the values span a short
    range (a loader's chunk of positions: consecutive blocks, a few sources)."""
    low, high = int(values.min()), int(values.max())
    if high - low >= 2 * len(values):
        return np.unique(values, return_inverse=True)
    seen = np.bincount(values - low, minlength=high - low + 1) > 0
    present = np.flatnonzero(seen)
    index = np.cumsum(seen) - 1
    return present + low, index[values - low]


@dataclass(frozen=True)
class SamplePlan:
    """Maps global positions ``g = 0, 1, 2, ...`` to samples, pass after pass over each source.

    A single source is read pass after pass. Several sources are mixed block by block: from each
    segment's first position on, every block of ``block_size`` positions (one global batch) holds
    the segment's counts for that block (see ``Segment``), in a shuffled order. A source that runs
    out starts a new, freshly shuffled pass.

    Args:
        sources: the sources, in a fixed order.
        seed: the data-order seed, independent of the model's seed.
        shuffle: shuffle every pass with a fresh bijection; ``False`` reads samples in order.
        segments: the mixture schedule, first segment at position 0; empty for a single source.
    """

    sources: tuple[PlannedSource, ...]
    seed: int = 0
    shuffle: bool = True
    segments: tuple[Segment, ...] = field(default=())
    _consumed_before: np.ndarray = field(init=False, repr=False, compare=False)
    _sizes: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("a sample plan needs at least one source")
        for source in self.sources:
            if source.num_samples <= 0:
                raise ValueError(f"source {source.name!r} has no samples (num_samples={source.num_samples})")
        if len(self.sources) > 1 and not self.segments:
            raise ValueError(f"{len(self.sources)} sources need a mixture schedule (segments)")
        if self.segments and self.segments[0].first_position != 0:
            raise ValueError(f"the first segment must start at position 0, not {self.segments[0].first_position}")
        for seg in self.segments:
            if seg.num_sources != len(self.sources):
                raise ValueError(f"segment probabilities {seg.probabilities} do not name {len(self.sources)} sources")
        consumed = np.zeros((len(self.segments), len(self.sources)), dtype=np.int64)
        for j in range(1, len(self.segments)):
            prev, seg = self.segments[j - 1], self.segments[j]
            blocks, partial = divmod(seg.first_position - prev.first_position, prev.block_size)
            if blocks <= 0 or partial:
                raise ValueError(
                    f"segment at position {seg.first_position} must start a whole number of blocks of "
                    f"{prev.block_size} after the previous one at {prev.first_position}"
                )
            consumed[j] = consumed[j - 1] + prev.drawn_before(np.array([blocks]))[0]
        object.__setattr__(self, "_consumed_before", consumed)
        object.__setattr__(self, "_sizes", np.array([s.num_samples for s in self.sources], dtype=np.int64))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source ids, sample indices)`` of each global position; vectorized."""
        sources, indices, _ = self.locate_in_passes(positions)
        return sources, indices

    def locate_in_passes(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(source ids, sample indices, passes)``: ``passes`` counts the earlier passes over that
        source (a source whose samples are rebuilt every pass, such as packed rows, needs it)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.segments:
            sources, drawn = self._mix(positions)
        else:
            sources, drawn = np.zeros_like(positions), positions
        sizes = self._sizes[sources]
        passes, within = np.divmod(drawn, sizes)
        if not self.shuffle:
            return sources, within, passes
        # Source s's pass p is shuffled by the bijection keyed (seed, s, p). One call for all sources:
        # they cycle-walk together, in as many rounds as the longest walk, not one loop per source.
        return sources, permute(within, sizes, round_keys(self.seed, sources, passes)), passes

    def _mix(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source of each position and how many samples that source had drawn before it."""
        firsts = np.array([seg.first_position for seg in self.segments], dtype=np.int64)
        which = np.searchsorted(firsts, positions, side="right") - 1
        sources = np.empty_like(positions)
        drawn = np.empty_like(positions)
        for j in np.unique(which).tolist():
            seg, mine = self.segments[j], which == j
            block, slot = np.divmod(positions[mine] - seg.first_position, seg.block_size)
            slot = permute(slot, seg.block_size, round_keys(self.seed, _BLOCK_STREAM, positions[mine] - slot))
            blocks, row = _distinct(block)
            counts = seg.counts(blocks)
            ends = np.cumsum(counts, axis=1)
            # Each block's slots [0, G) split by its own counts: one search over the blocks laid end to end.
            shift = row * seg.block_size
            source = (
                np.searchsorted(
                    (ends + (np.arange(len(blocks)) * seg.block_size)[:, None]).ravel(), slot + shift, side="right"
                )
                - row * seg.num_sources
            )
            rank = slot - (ends - counts)[row, source]
            present, column = _distinct(source)
            before = seg.drawn_before(blocks, present)
            sources[mine] = source
            drawn[mine] = self._consumed_before[j][source] + before[row, column] + rank
        return sources, drawn

    def samples_drawn(self, position: int) -> np.ndarray:
        """How many samples of each source positions ``[0, position)`` hold, in O(segments + log)."""
        if not self.segments:
            return np.array([position], dtype=np.int64)
        j = max(i for i, seg in enumerate(self.segments) if seg.first_position <= position)
        seg = self.segments[j]
        blocks, partial = divmod(position - seg.first_position, seg.block_size)
        drawn = self._consumed_before[j] + seg.drawn_before(np.array([blocks]))[0]
        if partial:
            sources, _ = self.locate(np.arange(position - partial, position))
            drawn += np.bincount(sources, minlength=len(self.sources))
        return drawn


def describe_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two plan identities (``PlanDataModule.plan_identity()``)."""
    changes = [
        f"{key}: {_saved_value(saved, key)} -> {current.get(key)!r}"
        for key in sorted(saved.keys() | current.keys())
        if key not in ("sources", "segments") and saved.get(key) != current.get(key)
    ]
    old = {s["name"]: s for s in saved.get("sources", [])}
    new = {s["name"]: s for s in current.get("sources", [])}
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            changes.append(f"source {name!r} removed")
        elif name not in old:
            changes.append(f"source {name!r} added")
        else:
            changes += _source_changes(name, old[name], new[name])
    return changes


def _saved_value(saved: dict[str, Any], key: str) -> str:
    return repr(saved[key]) if key in saved else "not recorded (a checkpoint of an earlier version)"


def _source_changes(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    changes = [f"source {name!r} num_samples: {old['num_samples']!r} -> {new['num_samples']!r}"]
    changes = changes if old["num_samples"] != new["num_samples"] else []
    before, after = old.get("details", {}), new.get("details", {})
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) != after.get(key):
            what = _DETAIL_WORDS.get(key, key)
            changes.append(f"source {name!r} {what}: {before.get(key)!r} -> {after.get(key)!r}")
    if old["fingerprint"] != new["fingerprint"] and before == after:
        changes.append(f"source {name!r} fingerprint: {old['fingerprint']!r} -> {new['fingerprint']!r}")
    return changes


_DETAIL_WORDS = {
    "data": "data content (fingerprint)",
    "tokens": "token range of this split [first, end)",
}
