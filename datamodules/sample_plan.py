"""The global sample plan: a pure function from a global position to (source, index in source).

Order depends only on (seed, sources, position): not on ranks, workers or restarts. Each pass over
a source is shuffled by a fresh keyed bijection, so nothing is materialized and any position is
reached in O(1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from datamodules.permutation import permute, round_keys


@dataclass(frozen=True)
class PlannedSource:
    """One source as the plan sees it: a name, a sample count and a fingerprint of its content."""

    name: str
    num_samples: int
    fingerprint: str


@dataclass(frozen=True)
class SamplePlan:
    """Maps global positions ``g = 0, 1, 2, ...`` to samples, pass after pass over each source.

    Args:
        sources: the sources, in a fixed order (one for a single-source DataModule).
        seed: the data-order seed, independent of the model's seed.
        shuffle: shuffle every pass with a fresh bijection; ``False`` reads samples in order.
    """

    sources: tuple[PlannedSource, ...]
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if len(self.sources) != 1:
            raise ValueError(f"a sample plan takes exactly one source here, got {len(self.sources)}")
        for source in self.sources:
            if source.num_samples <= 0:
                raise ValueError(f"source {source.name!r} has no samples (num_samples={source.num_samples})")

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source ids, sample indices)`` of each global position; vectorized, O(1) per position."""
        positions = np.asarray(positions, dtype=np.int64)
        n = self.sources[0].num_samples
        passes, within = np.divmod(positions, n)
        if self.shuffle:
            within = permute(within, n, round_keys(self.seed, 0, passes))
        return np.zeros_like(positions), within

    def describe(self) -> dict[str, Any]:
        """The plan's identity as plain values, stored in checkpoints to explain what changed."""
        return {"seed": self.seed, "shuffle": self.shuffle, "sources": [asdict(s) for s in self.sources]}

    @property
    def fingerprint(self) -> str:
        return hashlib.blake2b(json.dumps(self.describe(), sort_keys=True).encode(), digest_size=16).hexdigest()


def describe_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two ``SamplePlan.describe()`` dicts."""
    changes = [
        f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
        for key in ("seed", "shuffle")
        if saved.get(key) != current.get(key)
    ]
    old = {s["name"]: s for s in saved.get("sources", [])}
    new = {s["name"]: s for s in current.get("sources", [])}
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            changes.append(f"source {name!r} removed")
        elif name not in old:
            changes.append(f"source {name!r} added")
        else:
            changes += [
                f"source {name!r} {field}: {old[name][field]!r} -> {new[name][field]!r}"
                for field in ("num_samples", "fingerprint")
                if old[name][field] != new[name][field]
            ]
    return changes
