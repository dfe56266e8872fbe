"""Per-sample randomness from a plan key: a user's random transform (augmentation) draws the same
values for a sample on every run, with any worker count, and after resume."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def seeded(key: int) -> Iterator[None]:
    """Python's, NumPy's and torch's global generators seeded from ``key`` inside the block, and
    restored after it (the training loop's own randomness, dropout say, is left untouched)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(key & (2**63 - 1))  # torch.manual_seed also seeds devices: 1 ms
        random.seed(key)
        np.random.seed(key & 0xFFFFFFFF)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
