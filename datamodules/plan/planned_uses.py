"""When a node next reads each file: the plan's order, seen from the node's data-parallel ranks.

The order of training is a pure function of the seed and the position, so the file cache of a node
(``storage.FileCache``) can evict by next use (Belady's rule) rather than by recency. ``PlannedUses``
evaluates the plan over a horizon of the node's positions from the one being read, asks the source
which file each sample reads (its 64-bit ``url_key``, 0 for none), and answers, for a file and a
position, the next position at which the node reads that file. Every process of the node computes
the same answer, so the processes sharing a cache agree on its order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from datamodules.storage.file_cache import NEVER

DEFAULT_HORIZON = 1 << 18  # positions of the node looked ahead: 4 MiB of arrays a process


class PlannedUses:
    """The next use, by this node, of each file the plan's samples read.

    Args:
        sample_indices: the samples (indices into the source) at an array of plan positions, and the
            passes over their sources before them.
        file_keys: given samples and their passes (packed rows change every pass), the key of the
            file (``url_key``) or range (``range_key``) each reads (0: none); a 2-D array for samples
            that read several (rows padded with 0).
        anchor: the position where this run's grid of global micro-batches starts.
        batch_size: samples per data-parallel rank per micro-batch.
        dp_size: data-parallel ranks.
        node_ranks: the data-parallel ranks on this node (read together through its cache).
        horizon: how many of the node's positions are looked ahead; a file not read within them
            counts as never read again (it leaves the cache first).
    """

    def __init__(
        self,
        sample_indices: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
        file_keys: Callable[[np.ndarray, np.ndarray], np.ndarray],
        anchor: int,
        batch_size: int,
        dp_size: int,
        node_ranks: range,
        horizon: int = DEFAULT_HORIZON,
    ) -> None:
        self.sample_indices = sample_indices
        self.file_keys = file_keys
        self.anchor = anchor
        self.batch_size = batch_size
        self.stride = batch_size * dp_size  # positions of one global micro-batch
        self.node_ranks = node_ranks
        self.horizon = horizon
        self._forget()

    def _forget(self) -> None:
        self._window = (-1, -1)
        self._keys, self._positions = np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64)

    def __getstate__(self) -> dict:  # a worker computes its own window
        return {k: v for k, v in self.__dict__.items() if k not in ("_window", "_keys", "_positions")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._forget()

    def node_positions(self, first: int, count: int) -> np.ndarray:
        """The node's ``count`` positions from the micro-batch holding ``first`` on, in order."""
        per_batch = len(self.node_ranks) * self.batch_size
        batches = -(-count // per_batch) + 1
        start = self.anchor + max(0, (first - self.anchor) // self.stride) * self.stride
        bases = start + np.arange(batches, dtype=np.int64) * self.stride + self.node_ranks.start * self.batch_size
        positions = (bases[:, None] + np.arange(per_batch, dtype=np.int64)[None, :]).ravel()
        return positions[positions >= first][:count]

    def next_use(self, key: int, position: int) -> float:
        """The first position after ``position`` at which the node reads the file ``key``."""
        first, stop = self._window
        if not first <= position < first + (stop - first) // 2:  # the second half is kept ahead
            self._look_ahead(position)
        key = np.uint64(key)
        lo, hi = np.searchsorted(self._keys, key, "left"), np.searchsorted(self._keys, key, "right")
        at = lo + int(np.searchsorted(self._positions[lo:hi], position, side="right"))
        return float(self._positions[at]) if at < hi else NEVER

    def _look_ahead(self, position: int) -> None:
        positions = self.node_positions(position, self.horizon)
        samples, where = np.unique(np.stack(self.sample_indices(positions), axis=1), axis=0, return_inverse=True)
        keys = self.file_keys(samples[:, 0], samples[:, 1]).astype(np.uint64)[where.ravel()]  # asked once a sample
        if keys.ndim == 2:  # several reads a sample (a window across two shards): one use each
            positions, keys = np.repeat(positions, keys.shape[1]), keys.ravel()
        reads = keys != 0
        keys, positions = keys[reads], positions[reads]
        order = np.lexsort((positions, keys))
        self._keys, self._positions = keys[order], positions[order]
        self._window = (position, int(positions[-1]) + 1 if len(positions) else position + 1)
