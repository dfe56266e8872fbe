"""The global sample plan: a pure function from a global position to (source, index in source).

Order depends only on (seed, sources, schedule, position): not on ranks, workers or restarts. Each
pass over a source is shuffled by a fresh keyed bijection, and a mixture fixes every block's
per-source counts by its active weights, so nothing is materialized and any position is reached in
O(number of schedule segments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datamodules.plan.permutation import permute, round_keys

# Feistel stream id of the in-block shuffle; sources use their index as stream id.
_BLOCK_STREAM = 2**32


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


def largest_remainder_counts(probabilities: tuple[float, ...], total: int) -> tuple[int, ...]:
    """Integer counts summing to ``total``, each within one of ``total * p``; a zero ``p`` gets 0."""
    exact = np.asarray(probabilities, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    # Stable sort: ties go to the earlier source, so the rounding is deterministic.
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return tuple(int(c) for c in counts)


@dataclass(frozen=True)
class Segment:
    """From ``first_position`` on, blocks of ``block_size`` positions hold ``counts`` per source."""

    first_position: int
    block_size: int
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.counts) != self.block_size:
            raise ValueError(f"segment counts {self.counts} do not sum to its block size {self.block_size}")


@dataclass(frozen=True)
class SamplePlan:
    """Maps global positions ``g = 0, 1, 2, ...`` to samples, pass after pass over each source.

    A single source is read pass after pass. Several sources are mixed block by block: from each
    segment's first position on, every block of ``block_size`` positions (one global batch) holds
    exactly ``counts[i]`` samples of source ``i``, in a shuffled order. A source that runs out starts
    a new, freshly shuffled pass.

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
        consumed = np.zeros((len(self.segments), len(self.sources)), dtype=np.int64)
        for j in range(1, len(self.segments)):
            prev, seg = self.segments[j - 1], self.segments[j]
            blocks, partial = divmod(seg.first_position - prev.first_position, prev.block_size)
            if blocks <= 0 or partial:
                raise ValueError(
                    f"segment at position {seg.first_position} must start a whole number of blocks of "
                    f"{prev.block_size} after the previous one at {prev.first_position}"
                )
            if len(seg.counts) != len(self.sources):
                raise ValueError(f"segment counts {seg.counts} do not name {len(self.sources)} sources")
            consumed[j] = consumed[j - 1] + blocks * np.asarray(prev.counts)
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
            block_start = positions[mine] - slot
            slot = permute(slot, seg.block_size, round_keys(self.seed, _BLOCK_STREAM, block_start))
            ends = np.cumsum(seg.counts)
            source = np.searchsorted(ends, slot, side="right")
            rank = slot - (ends - np.asarray(seg.counts))[source]
            sources[mine] = source
            drawn[mine] = self._consumed_before[j][source] + block * np.asarray(seg.counts)[source] + rank
        return sources, drawn

    def samples_drawn(self, position: int) -> np.ndarray:
        """How many samples of each source positions ``[0, position)`` hold, in O(segments + block)."""
        if not self.segments:
            return np.array([position], dtype=np.int64)
        j = max(i for i, seg in enumerate(self.segments) if seg.first_position <= position)
        seg = self.segments[j]
        blocks, partial = divmod(position - seg.first_position, seg.block_size)
        drawn = self._consumed_before[j] + blocks * np.asarray(seg.counts)
        if partial:
            sources, _ = self.locate(np.arange(position - partial, position))
            drawn += np.bincount(sources, minlength=len(self.sources))
        return drawn


def describe_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two plan identities (``PlanDataModule.plan_identity()``)."""
    changes = [
        f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
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
