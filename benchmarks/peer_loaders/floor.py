"""The raw floor: nanoGPT's ``get_batch``, random windows copied from ``np.memmap`` into one array.

No loader, no workers, no state: the cost of reading the bytes, which no loader can beat.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.peer_loaders.protocol import Setup, Unsupported


def convert(corpus: Path, out: Path, seq_len: int) -> None:
    """Nothing to convert: it reads the ``.npy`` shards."""


class Contender:
    def __init__(self, setup: Setup, state: None) -> None:
        if setup.mixture or setup.workers:
            raise Unsupported("the floor is one process reading one corpus")
        self.maps = [np.load(p, mmap_mode="r") for p in sorted((Path(setup.corpus) / "all").glob("*.npy"))]
        self.setup = setup

    def batches(self) -> Iterator[np.ndarray]:
        width = self.setup.seq_len + 1
        out = np.empty((self.setup.batch_size, width), dtype=np.int64)
        rng = np.random.default_rng(self.setup.seed)
        limits = np.array([len(m) - width for m in self.maps])
        while True:
            # Random draws a thousand batches at a time, so the floor times copies, not the generator.
            shards = rng.integers(0, len(self.maps), size=(1024, self.setup.batch_size))
            starts = (rng.random(shards.shape) * limits[shards]).astype(np.int64)
            for batch_shards, batch_starts in zip(shards.tolist(), starts.tolist(), strict=True):
                for row, (shard, start) in enumerate(zip(batch_shards, batch_starts, strict=True)):
                    out[row] = self.maps[shard][start : start + width]
                yield out

    def state_dict(self) -> None:
        raise Unsupported("the floor keeps no state")

    def close(self) -> None:
        self.maps = []


def state_at(setup: Setup, step: int) -> None:
    raise Unsupported("the floor keeps no state")
