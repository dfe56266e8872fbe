"""``PlannedFiles``: what a vision source whose rows name files (images, clips) by path or URL gives
a file cache that evicts by the plan's next use (``storage.FileCache``, ``plan.PlannedUses``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple
from typing import Any

import numpy as np

from datamodules.storage.file_cache import CacheStats
from datamodules.storage.locations import is_url
from datamodules.storage.remote_files import RemoteFiles, url_key


class PlannedFiles:
    """Mixed into a plan source with ``files`` (``RemoteFiles``), ``dataset`` and ``split``.

    The DataModule gives the training split ``planned_uses`` when ``plans_file_reads``; ``fetch`` reads
    each sample ``reading(position)`` and adds the cache's counts to its raw batch
    (``count_cache``), which ``to_batch`` adds up in the main process (``file_cache``, logged).
    """

    uses_positions = True  # a sample's plan position: where the node stands in the plan's reads
    files: RemoteFiles
    dataset: Any
    file_column: str  # the row's column naming its file

    def file_location(self, value: Any) -> str | None:
        """The path or URL of the file a row's ``file_column`` value names (``None``: none)."""
        raise NotImplementedError

    def _start_planning(self) -> None:
        self.planned_uses: Any = None  # the plan's next uses of the files, set for the training split
        self.file_cache = CacheStats()  # what the file cache did for this split, all workers together

    @property
    def plans_file_reads(self) -> bool:
        """Whether the files the rows name go through a cache that evicts by the plan's next use."""
        return self.files.plans_ahead and hasattr(self.dataset, "select_columns")

    @property
    def file_cache_summary(self) -> str | None:
        return self.files.summary()

    def file_keys(self, indices: np.ndarray) -> np.ndarray:
        """The ``url_key`` of the remote file each sample reads (0: none)."""
        rows = self.split.rows(np.asarray(indices, dtype=np.int64))
        values = self.dataset.select_columns([self.file_column])[rows.tolist()][self.file_column]
        locations = [self.file_location(value) for value in values]
        return np.array([url_key(p) if p is not None and is_url(p) else 0 for p in locations], dtype=np.uint64)

    @contextmanager
    def reading(self, position: int) -> Iterator[None]:
        with self.files.reading_at(self.planned_uses, position):
            yield

    @contextmanager
    def count_cache(self, raw: dict[str, Any]) -> Iterator[None]:
        """The cache's counts of the reads in this block, into ``raw["file_cache"]``."""
        stats = self.files.stats
        before = None if stats is None else astuple(stats)
        yield
        if before is not None:
            raw["file_cache"] = np.array(stats.since(before), dtype=np.int64)

    def add_cache_counts(self, raw: dict[str, Any]) -> None:
        if "file_cache" in raw:
            self.file_cache.add(raw["file_cache"])
