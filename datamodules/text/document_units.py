"""A text dataset cut into units a stream reader can open without reading what comes before.

Local parquet units are row groups (their sizes come from the file footers) and ``save_to_disk``
units are row ranges of the memory-mapped table: opening any of them costs one unit, wherever it
is. Anything else ``datasets.load_dataset`` streams (JSON lines, text, hub datasets) is cut into its
stream shards (files); a reader resumes inside one by skipping rows from the shard's start, so a
resume costs at most one shard, never the whole pass.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from datamodules.storage.locations import is_url, open_remote
from datamodules.text.prepare_inputs import DatasetCorpus, PrepareError, file_stamp, missing_column, skip_hint


class DocumentUnits(ABC):
    """The documents of one split as ``len(self)`` units, each read in blocks of rows."""

    text_field: str

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def identity(self) -> list[str]:
        """What says these are the same documents (file names, sizes, modification times)."""

    @abstractmethod
    def blocks(self, unit: int, first_block: int, block_rows: int) -> Iterator[tuple[str, int, list[Any]]]:
        """``(table, first_row, values)`` of blocks ``first_block, ...`` of ``unit``, ``block_rows``
        rows each (the last may be shorter); ``table`` and ``first_row`` name the rows in errors."""

    def split(self, parts: int) -> None:  # noqa: B027 (units of unknown size cannot be split)
        """Cut every unit into ``parts`` row ranges, when units' sizes are known."""

    @abstractmethod
    def describe(self) -> str:
        """What the units are, for the data summary: how many, of what, and the rows where known."""

    splittable = False


def check_texts(table: str, first_row: int, values: list[Any], text_field: str) -> list[str]:
    """``values`` checked to be strings; the first that is not stops the run, with its row named."""
    for row, value in enumerate(values):
        if not isinstance(value, str):
            problem = "is null" if value is None else f"is a {type(value).__name__}, not a string"
            raise ValueError(f"{table} row {first_row + row}: text field {text_field!r} {problem}; {skip_hint()}")
    return values


class _RowRangeUnits(DocumentUnits):
    """Units that are row ranges ``(table, first_row, stop_row)`` of tables read whole."""

    splittable = True

    def __init__(self, ranges: list[tuple[int, int, int]], text_field: str) -> None:
        self.ranges = ranges
        self.text_field = text_field

    def __len__(self) -> int:
        return len(self.ranges)

    def split(self, parts: int) -> None:
        pieces = []
        for table, first, stop in self.ranges:
            step = math.ceil((stop - first) / parts)
            pieces += [(table, lo, min(lo + step, stop)) for lo in range(first, stop, step)]
        self.ranges = pieces

    @property
    def rows(self) -> int:
        return sum(stop - first for _, first, stop in self.ranges)

    @abstractmethod
    def _read(self, table: int) -> list[Any]: ...

    @abstractmethod
    def _name(self, table: int) -> str: ...

    def blocks(self, unit: int, first_block: int, block_rows: int) -> Iterator[tuple[str, int, list[Any]]]:
        table, first, stop = self.ranges[unit]
        values = self._read(table)
        for lo in range(first + first_block * block_rows, stop, block_rows):
            yield self._name(table), lo, values[lo : min(lo + block_rows, stop)]


class ParquetUnits(_RowRangeUnits):
    """Row groups of parquet files, local or at URLs (``UPath``s); one row group is read per unit."""

    def __init__(self, files: list[Path], text_field: str) -> None:
        self.files = files
        groups = []
        for path in files:
            metadata = _parquet(path)
            if text_field not in metadata.schema_arrow.names:
                raise ValueError(missing_column(str(path), text_field, metadata.schema_arrow.names))
            for group in range(metadata.num_row_groups):
                groups.append((path, group, metadata.metadata.row_group(group).num_rows))
        self._groups = groups
        super().__init__([(i, 0, rows) for i, (_, _, rows) in enumerate(groups) if rows], text_field)

    def identity(self) -> list[str]:
        return ["parquet", self.text_field, *map(file_stamp, self.files)]

    def describe(self) -> str:
        return f"{len(self._groups):,} row groups of {len(self.files):,} parquet files, {self.rows:,} rows"

    def _read(self, table: int) -> list[Any]:
        path, group, _ = self._groups[table]
        return _parquet(path).read_row_group(group, columns=[self.text_field]).column(0).to_pylist()

    def _name(self, table: int) -> str:
        path, group, _ = self._groups[table]
        return f"{path} row group {group}"


def _parquet(path: Path) -> Any:
    """A parquet file opened for reading; at a URL, through its fsspec file (footer and row groups
    are ranged reads)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(open_remote(path) if is_url(path) else path)


class SavedDatasetUnits(_RowRangeUnits):
    """Row ranges of a ``save_to_disk`` dataset (memory-mapped, so any range is read directly)."""

    def __init__(self, corpus: DatasetCorpus, text_field: str, unit_rows: int) -> None:
        self.corpus = corpus
        self.dataset = corpus.load()
        if text_field not in self.dataset.column_names:
            raise ValueError(missing_column(corpus.path, text_field, self.dataset.column_names))
        rows = len(self.dataset)
        super().__init__([(0, lo, min(lo + unit_rows, rows)) for lo in range(0, rows, unit_rows)], text_field)

    def identity(self) -> list[str]:
        return ["saved", self.text_field, *self.corpus.identity()]

    def describe(self) -> str:
        return f"{self.corpus.path} ({self.corpus.split}): {len(self):,} row ranges, {self.rows:,} rows"

    def _read(self, table: int) -> Any:
        return _Column(self.dataset, self.text_field)

    def _name(self, table: int) -> str:
        return f"{self.corpus.path} ({self.corpus.split})"


class _Column:
    """Slices of one column of a memory-mapped dataset, read only when asked for."""

    def __init__(self, dataset: Any, column: str) -> None:
        self.dataset, self.column = dataset, column

    def __getitem__(self, rows: slice) -> list[Any]:
        return self.dataset[rows][self.column]


class StreamedUnits(DocumentUnits):
    """The stream shards (files) of a ``datasets.load_dataset(..., streaming=True)`` dataset."""

    def __init__(self, corpus: DatasetCorpus, text_field: str) -> None:
        self.corpus = corpus
        self.text_field = text_field
        dataset = corpus.load()
        columns = dataset.column_names
        if columns is not None and text_field not in columns:
            raise ValueError(missing_column(corpus.path, text_field, columns))
        self.num_shards = dataset.num_shards
        self._dataset: Any = None  # loaded once per process: each load resolves the files again

    def __len__(self) -> int:
        return self.num_shards

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None}

    def identity(self) -> list[str]:
        return ["streamed", self.text_field, *self.corpus.identity()]

    def describe(self) -> str:
        return f"{self.corpus.path}: {self.num_shards:,} stream shards (rows unknown until read)"

    def blocks(self, unit: int, first_block: int, block_rows: int) -> Iterator[tuple[str, int, list[Any]]]:
        if self._dataset is None:
            self._dataset = self.corpus.load()
        shard = self._dataset.shard(num_shards=self.num_shards, index=unit).skip(first_block * block_rows)
        # ``iter``, not ``__iter__``: inside a DataLoader worker, datasets' ``__iter__`` would split
        # the shard again among the workers (this reader's worker would get none of it).
        batches = shard.select_columns([self.text_field]).iter(batch_size=block_rows)
        for block, batch in enumerate(batches, start=first_block):
            yield f"{self.corpus.path} shard {unit} of {self.num_shards}", block * block_rows, batch[self.text_field]


def document_units(corpus: DatasetCorpus, text_field: str, block_rows: int) -> DocumentUnits:
    """The seekable units of ``corpus`` where its format has them, else its stream shards."""
    if corpus.saved:
        units: DocumentUnits = SavedDatasetUnits(corpus, text_field, block_rows)
    elif corpus.path == "parquet" and corpus.data_files is not None:
        files = corpus.local_files(split_only=True) or corpus.remote_files(split_only=True)
        if not files:
            raise PrepareError(f"data_files {corpus.data_files!r} match no parquet file")
        units = ParquetUnits(files, text_field)
    else:
        units = StreamedUnits(corpus, text_field)
    if len(units) == 0:
        raise PrepareError(f"no documents in {corpus.describe()}")
    return units
