"""``PlannedFiles``: what a vision source whose rows name files (images, clips) by path or URL, or
whose samples lie in tar shards in a bucket, gives a file cache that evicts by the plan's next use."""

from __future__ import annotations

from typing import Any

import numpy as np

from datamodules.storage.locations import is_url
from datamodules.storage.planned_reads import PlannedReads
from datamodules.storage.remote_files import url_key


class PlannedFiles(PlannedReads):
    """Mixed into a vision plan source with ``files``, ``dataset`` and ``split``: ``fetch`` reads each
    sample ``reading(position)``, inside ``count_cache``; ``to_batch`` calls ``add_cache_counts``."""

    uses_positions = True  # a sample's plan position: where the node stands in the plan's reads
    dataset: Any
    file_column: str  # the row's column naming its file

    def file_location(self, value: Any) -> str | None:
        """The path or URL of the file a row's ``file_column`` value names (``None``: none)."""
        raise NotImplementedError

    @property
    def plans_file_reads(self) -> bool:
        """Whether the files the rows name (or, tar shards in a bucket, the rows' ranges: the dataset's
        own ``file_keys``) go through a cache that evicts by the plan's next use."""
        return self.files.plans_ahead and any(hasattr(self.dataset, a) for a in ("select_columns", "file_keys"))

    def file_keys(self, indices: np.ndarray, passes: np.ndarray | None = None) -> np.ndarray:
        """The ``url_key`` of the remote file each sample reads (0: none), whatever the pass."""
        rows = self.split.rows(np.asarray(indices, dtype=np.int64))
        if hasattr(self.dataset, "file_keys"):
            return self.dataset.file_keys(rows)
        values = self.dataset.select_columns([self.file_column])[rows.tolist()][self.file_column]
        locations = [self.file_location(value) for value in values]
        return np.array([url_key(p) if p is not None and is_url(p) else 0 for p in locations], dtype=np.uint64)

    def prefetch(self, indices: np.ndarray, positions: np.ndarray) -> None:
        """Tar shards: the micro-batch's members requested together, where the plan reads them."""
        if hasattr(self.dataset, "prefetch"):
            rows = self.split.rows(np.asarray(indices)).tolist()
            self.dataset.prefetch(rows, self.planned_uses, np.asarray(positions).tolist())
