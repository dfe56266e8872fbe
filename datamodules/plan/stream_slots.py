"""Streams inside a plan: a mixture's positions of a streamed source take the stream's samples in order.

The plan fixes how many samples each source gives every global batch and at which positions (the
floor or ceiling of its share, phases included); a map-style source is read at its positions, a
stream cannot be. Each rank's positions of a stream take instead the rank's next samples of it, in
the order its readers produce them (``StreamTraining``: a reader per rank and DataLoader worker), so
the counts and long-run shares of a stream are the plan's, as for any source.

A stream batch holds ``batch_size`` samples and a micro-batch takes as many as it has positions of
the stream: the samples of a stream batch not yet taken wait for the next micro-batches. They are
part of the state, with how many stream batches the rank has read, as both stood after each
micro-batch handed to training, so the state after the batches the loop has trained is known however
far ahead the loaders read. A resume on the same ranks and workers reads on from there; on another
number of ranks, the readers' unfinished work is dealt anew (``Stream.redeal``) and the samples old
rank ``r`` held go to new rank ``r % new``, ahead of its stream: every sample once.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from datamodules.plan.loader import PLAN_SOURCES
from datamodules.plan.stream import StreamLoader

# A stream's size in the plan: its index there is unused and a pass over it never ends.
STREAM_SAMPLES = 2**40

Rows = dict[str, np.ndarray]  # a raw batch's arrays, one row per sample


class StreamSlots:
    """Fills the rows of streams in this rank's raw batches, and keeps each stream's state per batch.

    Args:
        loaders: the plan source id of each stream, and its ``StreamLoader`` on this rank.
        handed: training batches this rank handed out before (the loop's count when the loader starts).
        batches: per stream, the stream batches this rank had read.
        left: per stream, the samples it had read but not yet given (empty: none).
    """

    def __init__(
        self, loaders: dict[int, StreamLoader], handed: int, batches: dict[int, int], left: dict[int, Rows]
    ) -> None:
        self.loaders = loaders
        self._left = {s: left.get(s, {}) for s in loaders}
        self._handed = handed
        # (batches handed, stream batches read, samples left) after each batch, for ``state_at``.
        self._history: deque[tuple[int, dict[int, int], dict[int, Rows]]] = deque(maxlen=64)
        self._history.append((handed, {s: batches.get(s, 0) for s in loaders}, dict(self._left)))

    def fill(self, raw: dict[str, Any]) -> dict[str, Any]:
        """``raw`` (the other sources' rows) with every stream's rows put in at its positions."""
        sources = raw.pop(PLAN_SOURCES)
        taken = {s: self._take(s, int(np.count_nonzero(sources == s))) for s in self.loaders}
        taken = {s: rows for s, rows in taken.items() if rows}
        mapped = ~np.isin(sources, list(self.loaders))
        filled = {}
        for key, values in raw.items():
            dtype = np.result_type(values, *(rows[key] for rows in taken.values()))
            merged = np.empty((len(sources), *values.shape[1:]), dtype)
            merged[mapped] = values
            for s, rows in taken.items():
                merged[sources == s] = rows[key]
            filled[key] = merged
        self._handed += 1
        read = {s: loader.cursor.batches for s, loader in self.loaders.items()}
        self._history.append((self._handed, read, dict(self._left)))
        return filled

    def _take(self, stream: int, count: int) -> Rows:
        """The stream's next ``count`` samples: those left over first, then from new stream batches."""
        if not count:
            return {}
        parts = [self._left[stream]] if self._left[stream] else []
        have = sum(_length(p) for p in parts)
        while have < count:
            parts.append(self.loaders[stream].next_raw())
            have += _length(parts[-1])
        joined = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        self._left[stream] = {key: values[count:] for key, values in joined.items()} if have > count else {}
        return {key: values[:count] for key, values in joined.items()}

    def state_at(self, handed: int) -> tuple[dict[int, int], dict[int, Rows]]:
        """Per stream, the stream batches read and the samples left once ``handed`` batches were trained."""
        for count, read, left in reversed(self._history):
            if count == handed:
                return read, left
        raise RuntimeError(f"the streams' state after batch {handed} is no longer held")

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()


def _length(rows: Rows) -> int:
    return len(next(iter(rows.values())))


def left_for(saved: dict[int, dict[str, Any]], rank: int, ranks: int) -> Rows:
    """The samples a checkpoint's ranks (``saved``: per data-parallel rank) left over, for ``rank`` of
    ``ranks``: old rank ``r``'s go to ``r % ranks``, in the order of the old ranks."""
    mine = [saved[r]["left"] for r in sorted(saved) if r % ranks == rank and saved[r]["left"]]
    if not mine:
        return {}
    return {key: np.concatenate([np.asarray(rows[key]) for rows in mine]) for key in mine[0]}
