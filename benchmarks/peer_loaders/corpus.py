"""The token corpus every contender of ``benchmarks.peers`` reads, in uint16 ``.npy`` shards.

``all/`` holds 4 shards; shards 0 and 1 hold token ids below ``SOURCE_SPLIT`` and shards 2 and 3
ids at or above it, so a sample's first token tells which mixture source it came from.
``source0/`` and ``source1/`` link to those halves: the two sources of the 70/30 mixture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.common import VOCAB_SIZE, warm_page_cache
from benchmarks.peer_loaders.protocol import SOURCE_SPLIT

NUM_SHARDS = 4
_CHUNK = 1 << 24


def write_corpus(directory: Path, num_tokens: int, seed: int = 0) -> Path:
    """``directory/all``, ``source0``, ``source1``; reused when already there at this size. Returns ``directory``."""
    shards = [directory / "all" / f"shard_{i:05d}.npy" for i in range(NUM_SHARDS)]
    sizes = [num_tokens // NUM_SHARDS + (i < num_tokens % NUM_SHARDS) for i in range(NUM_SHARDS)]
    if not all(p.exists() and len(np.load(p, mmap_mode="r")) == n for p, n in zip(shards, sizes, strict=True)):
        shards[0].parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        for i, (path, size) in enumerate(zip(shards, sizes, strict=True)):
            low, high = (0, SOURCE_SPLIT) if i < NUM_SHARDS // 2 else (SOURCE_SPLIT, VOCAB_SIZE)
            shard = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(size,))
            for lo in range(0, size, _CHUNK):
                hi = min(size, lo + _CHUNK)
                shard[lo:hi] = rng.integers(low, high, hi - lo, dtype=np.uint16)
            shard.flush()
            del shard
    for s, half in enumerate((shards[: NUM_SHARDS // 2], shards[NUM_SHARDS // 2 :])):
        folder = directory / f"source{s}"
        folder.mkdir(exist_ok=True)
        for path in half:
            link = folder / path.name
            if not link.exists():
                link.symlink_to(path.resolve())
    warm_page_cache(shards)
    return directory
