"""``PlannedReads``: what a plan source reading through a ``RemoteFiles`` cache shares with every other
such source: the plan's next uses it is given, the position of each read, and the cache's counts,
carried from the workers to the main process in the raw batches and added up there (logged)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple
from typing import Any

import numpy as np

from datamodules.storage.file_cache import CacheStats
from datamodules.storage.remote_files import RemoteFiles

CACHE_COUNTS = "file_cache"  # the raw batch's key for the cache's counts of its reads


class PlannedReads:
    """Mixed into a plan source with ``files``. The DataModule gives the training split
    ``planned_uses`` (``plan.PlannedUses``) when ``plans_file_reads``; the source answers
    ``file_keys(indices)``: the keys of what each sample reads."""

    files: RemoteFiles

    def _start_planning(self) -> None:
        self.planned_uses: Any = None  # the plan's next uses of what the samples read, for the training split
        self.file_cache = CacheStats()  # what the cache did for this split, all workers together

    @property
    def file_cache_summary(self) -> str | None:
        return self.files.summary()

    @contextmanager
    def reading(self, position: int) -> Iterator[None]:
        """Whole files read in this block are for the sample at plan ``position``."""
        with self.files.reading_at(self.planned_uses, position):
            yield

    @contextmanager
    def count_cache(self, raw: dict[str, Any]) -> Iterator[None]:
        """The cache's counts of the reads in this block, into ``raw``."""
        stats = self.files.stats
        before = None if stats is None else astuple(stats)
        yield
        if before is not None:
            raw[CACHE_COUNTS] = np.array(stats.since(before), dtype=np.int64)

    def add_cache_counts(self, raw: dict[str, Any]) -> None:
        """In the main process: a raw batch's cache counts, added up (and taken off the batch)."""
        counts = raw.pop(CACHE_COUNTS, None)
        if counts is not None:
            self.file_cache.add(counts)
