"""Held-out splits carved from a dataset's rows: validation and test fractions, disjoint from training."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from datamodules.plan.permutation import permute, round_keys

_SPLIT_KEY = 0x1D7E5  # the held-out split does not move when the training seed does


@dataclass(frozen=True)
class RowSplit:
    """Samples ``[0, count)`` of a split as dataset rows: rows ``[first, first + count)`` in the order of
    a keyed shuffle of all ``num_rows`` rows (``shuffled``), or as they are."""

    num_rows: int
    first: int = 0
    count: int | None = None
    shuffled: bool = False

    def __len__(self) -> int:
        return self.num_rows - self.first if self.count is None else self.count

    def rows(self, indices: np.ndarray) -> np.ndarray:
        positions = np.asarray(indices, dtype=np.int64) + self.first
        if not self.shuffled:
            return positions
        return permute(positions, self.num_rows, round_keys(_SPLIT_KEY, 0, np.zeros(len(positions), dtype=np.int64)))


HELD_OUT_NAMES = {"validation": "[held out]", "test": "[held out for test]"}


def held_out_rows(num_rows: int, fractions: dict[str, float], what: str) -> tuple[RowSplit, dict[str, RowSplit]]:
    """Training rows and held-out rows by role (``{"validation": 0.01, "test": 0.01}``), carved from a
    fixed keyed shuffle of all rows (not the tail: datasets are often sorted): validation first, then
    test, the rest training; no fraction at all keeps every row, in order, for training."""
    counts = {role: math.ceil(num_rows * f) for role, f in fractions.items() if f > 0}
    if not counts:
        return RowSplit(num_rows), {}
    if sum(counts.values()) >= num_rows:
        asked = ", ".join(f"{role} {fractions[role]}" for role in counts)
        raise ValueError(f"holding out {asked} of {num_rows} {what} leaves no training {what}")
    held, first = {}, 0
    for role, count in counts.items():
        held[role] = RowSplit(num_rows, first, count, shuffled=True)
        first += count
    return RowSplit(num_rows, first, shuffled=True), held
