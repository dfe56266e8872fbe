"""Keyed bijections on ``[0, n)`` computed on the fly.

A Feistel network over the smallest even-bit domain that holds ``n``, with cycle-walking back into
range, so a shuffle of any size costs O(1) memory and O(1) time per element.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
# 4**1 ... 4**31: n values get the Feistel domain 4**half, the first of these >= n (half = index + 1).
_EVEN_BIT_DOMAINS = 4 ** np.arange(1, 32, dtype=np.int64)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a fast, well-distributed hash of uint64 values (wraps mod 2**64)."""
    x = np.asarray(x, dtype=np.uint64) + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def round_keys(seed: int, stream: int | np.ndarray, passes: np.ndarray) -> np.ndarray:
    """Per-element Feistel round keys, shape ``[_ROUNDS, len(passes)]``, for (seed, stream, pass).

    ``stream`` is one stream id (>= 0) for every element, or one per element.
    """
    base = mix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))
    base = mix64(base ^ np.asarray(stream).astype(np.uint64))
    keyed = mix64(base ^ mix64(np.asarray(passes, dtype=np.uint64)))
    rounds = np.arange(1, _ROUNDS + 1, dtype=np.uint64)[:, None]
    return mix64(keyed[None, :] ^ (rounds * _GOLDEN))


def permute(values: np.ndarray, n: int | np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Map each ``values[j]`` in ``[0, n)`` through the bijection keyed by ``keys[:, j]``.

    ``n`` is one size for every value or one per value: values of several sizes (a mixture's
    sources) cycle-walk together, in as many rounds as the longest walk, not in one loop per size.
    """
    sizes = np.asarray(n, dtype=np.int64)
    if np.any(sizes <= 0):
        raise ValueError(f"permutation size must be positive, got {sizes.min()}")
    halves = (np.searchsorted(_EVEN_BIT_DOMAINS, sizes) + 1).astype(np.uint64)
    masks = (np.uint64(1) << halves) - np.uint64(1)
    limits = sizes.astype(np.uint64)
    out = np.asarray(values, dtype=np.uint64).copy()
    todo = np.arange(out.size)
    keys = np.asarray(keys, dtype=np.uint64)
    # Cycle-walking: the domain 4**half is < 4n, so each element needs under 4 walks on average.
    while todo.size:
        x, k = out[todo], keys[:, todo]
        # One size (a single source, a block): plain scalars, no per-value gathers in the hot loop.
        shift, mask, limit = (halves, masks, limits) if sizes.ndim == 0 else (halves[todo], masks[todo], limits[todo])
        left, right = x >> shift, x & mask
        for r in range(_ROUNDS):
            left, right = right, left ^ (mix64(right ^ k[r]) & mask)
        x = (left << shift) | right
        out[todo] = x
        todo = todo[x >= limit]
    return out.astype(np.int64)
