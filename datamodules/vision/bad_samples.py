"""The ``on_bad_sample`` policy of vision sources: raise naming the sample, or skip it for a
replacement drawn from the sample's own index, so every run, worker count and resume agrees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from datamodules.plan.bad_samples import BadSample
from datamodules.plan.permutation import mix64

MAX_REPLACEMENTS = 16
T = TypeVar("T")


def replacement(index: int, attempt: int, n: int) -> int:
    """The ``attempt``-th stand-in for sample ``index`` of ``n``: another index, a pure function of
    ``(index, attempt)`` (no RNG state, no worker id), so it is the same wherever it is drawn."""
    if n < 2:
        return index
    h = int(mix64(np.array([(index << 8) ^ attempt], dtype=np.uint64))[0])
    return (index + 1 + h % (n - 1)) % n


def sample_or_replacement(
    index: int,
    n: int,
    read: Callable[[int], T],
    describe: Callable[[int], str],
    policy: str,
    skipped: list[tuple[str, str]],
) -> T:
    """``read(index)``; if it raises ``BadSample``, raise naming the sample (``policy="raise"``) or
    read its replacements in turn, appending ``(sample, reason)`` of each bad one to ``skipped``."""
    candidate = index
    first = len(skipped)
    for attempt in range(1, MAX_REPLACEMENTS + 2):
        try:
            return read(candidate)
        except BadSample as err:
            if policy == "raise":
                raise BadSample(
                    f"{describe(candidate)}: {err} (on_bad_sample='skip' replaces such samples and counts them)"
                ) from None
            skipped.append((describe(candidate), str(err)))
        candidate = replacement(index, attempt, n)
    sample, reason = skipped[first]  # its own reason: often the one mistake behind all (a field misnamed)
    raise BadSample(f"{sample}: {reason}; and its {MAX_REPLACEMENTS} replacements are all bad: is the dataset broken?")
