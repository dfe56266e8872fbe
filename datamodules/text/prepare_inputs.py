"""What the prepare command reads: files by suffix (compressed too), directories, ``save_to_disk``
folders and hub names, each read as batches of documents in a fixed order.

Every way an input can be wrong (a missing path, an unknown suffix, a row without text, bytes that
are not UTF-8) is a ``PrepareError`` naming the value, raised before or where it is read.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from glob import glob as expand_glob
from itertools import chain
from pathlib import Path
from typing import Any

import fsspec

from datamodules.plan.arguments import option
from datamodules.plan.hf_loading import is_saved_dataset, load_split
from datamodules.storage.locations import is_url, storage_path

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")  # one document per file
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")  # one document per record
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2", ".xz": "xz"}
_KINDS = {**dict.fromkeys(TEXT_SUFFIXES, "text"), **dict.fromkeys(JSON_SUFFIXES, "json"), ".parquet": "parquet"}
# owner/name or name, as the Hub spells them; anything else is a local path.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
BATCH_DOCUMENTS = 1024
BATCH_CHARACTERS = 8 << 20
BAD_ROW_POLICIES = ("raise", "skip")


class PrepareError(ValueError):
    """A problem with the prepare command's inputs, output or options, told in one line."""


def accepted_suffixes() -> str:
    plain = ", ".join(_KINDS)
    return f"{plain} (each also compressed: {', '.join(COMPRESSIONS)})"


def looks_like_hub_name(value: str) -> bool:
    """``owner/name`` or ``name`` with no data-file suffix and no existing local parent directory."""
    if not _HUB_NAME.match(value) or _split_suffix(value)[0] is not None:
        return False
    parent = Path(value).parent
    return parent == Path(".") or not parent.exists()


def _split_suffix(name: str) -> tuple[str | None, str | None]:
    """``(kind, compression)`` of a file name; kind ``None`` for an unknown suffix."""
    lower = name.lower()
    compression = None
    for suffix, codec in COMPRESSIONS.items():
        if lower.endswith(suffix):
            compression, lower = codec, lower[: -len(suffix)]
            break
    return _KINDS.get(Path(lower).suffix), compression


def skip_hint() -> str:
    """How to go past rows without text, in the caller's spelling (``option``)."""
    return f"{option('on_bad_row', 'skip')} counts and skips such rows"


def missing_column(where: str, text_field: str, columns: list[str]) -> str:
    """The message for inputs without the text column: the columns they have, and the option that names it."""
    name = option("text_field", "NAME")
    return f"{where} has no column {text_field!r}; columns are {columns}: name the text's column with {name}"


@dataclass(frozen=True)
class _Missing:
    """A record without the text field, and the fields it has (none when it is not an object)."""

    fields: tuple[str, ...] = ()


@dataclass
class BadRows:
    """Rows without usable text: raised at the first (``raise``) or counted and skipped (``skip``).
    Empty documents (``""``: an empty file, an empty text) are counted in ``empty`` and skipped,
    unless ``keep_empty`` (each would be a document of nothing but its separator)."""

    policy: str = "raise"
    count: int = 0
    examples: list[str] = field(default_factory=list)
    keep_empty: bool = False
    empty: int = 0

    def __post_init__(self) -> None:
        if self.policy not in BAD_ROW_POLICIES:
            raise PrepareError(f"{option('on_bad_row')} must be one of {BAD_ROW_POLICIES}, got {self.policy!r}")

    def text(self, value: Any, where: str, text_field: str) -> str | None:
        """``value`` if it is a string; else raise, or count it and return ``None``."""
        if isinstance(value, str):
            return value
        if isinstance(value, _Missing):
            # A mistyped field name misses it in every row: say the fields there are, and the option naming it.
            fields = f" (its fields: {list(value.fields)})" if value.fields else ""
            message = f"{where}: text field {text_field!r} is missing{fields}"
            hint = f"name the text's field with {option('text_field', 'NAME')}, or {skip_hint()}"
        else:
            problem = "is null" if value is None else f"is a {type(value).__name__}"
            message, hint = f"{where}: text field {text_field!r} {problem}", skip_hint()
        if self.policy == "raise":
            raise PrepareError(f"{message}; {hint}")
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(message)
        return None

    def texts(self, values: Iterable[tuple[str, Any]], text_field: str) -> Iterator[str]:
        """The strings among ``(where, value)`` pairs; every other value raised or counted (``text``)."""
        for where, value in values:
            text = self.text(value, where, text_field)
            if text is not None:
                yield text

    def is_empty(self, text: str) -> bool:
        """Whether ``text`` is an empty document to skip (counted)."""
        if text or self.keep_empty:
            return False
        self.empty += 1
        return True


def file_stamp(path: Path, name: str | None = None) -> str:
    """``name:size:mtime`` of a file (``name`` defaults to its path): what says it is unchanged."""
    stat = path.stat()
    mtime = getattr(stat, "st_mtime_ns", None) or stat.st_mtime  # a file at a URL: its store's time
    return f"{path if name is None else name}:{stat.st_size}:{mtime}"


def _rows(path: str, batches: Iterable[list[Any]]) -> Iterator[tuple[str, Any]]:
    """``(where, value)`` of a column read in batches, rows numbered from 0 across batches."""
    return ((f"{path} row {row}", value) for row, value in enumerate(chain.from_iterable(batches)))


def _field(record: Any, text_field: str) -> Any:
    """``record[text_field]``, or ``_Missing`` naming the fields ``record`` has."""
    if isinstance(record, dict):
        return record[text_field] if text_field in record else _Missing(tuple(record))
    return _Missing()


def _open(path: str, compression: str | None, storage_options: dict[str, Any] | None = None) -> Any:
    try:
        stream = fsspec.open(path, "rb", compression=compression, **(storage_options or {})).open()
    except ValueError as err:  # fsspec names a codec whose library is not installed this way
        raise PrepareError(f"cannot open {path}: {err}") from None
    # Some decompressors (zstd) read but do not split lines; a buffer over them does both.
    return stream if compression is None else io.BufferedReader(stream, buffer_size=1 << 20)


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PrepareError(
            f"{where} is not valid UTF-8 (byte {err.start}: {data[err.start : err.start + 1]!r})"
        ) from None


@dataclass(frozen=True)
class InputFile:
    """One file, local or at a URL, read by its kind (``text``, ``json`` or ``parquet``), maybe compressed."""

    path: str
    kind: str
    compression: str | None
    storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def identity(self) -> str:
        return file_stamp(storage_path(self.path, self.storage_options if is_url(self.path) else None))

    def _open(self) -> Any:
        return _open(self.path, self.compression, self.storage_options if is_url(self.path) else None)

    def documents(self, text_field: str, bad_rows: BadRows) -> Iterator[str]:
        if self.kind == "text":
            with self._open() as f:
                yield _decode(f.read(), self.path)
        elif self.kind == "json":
            yield from self._json_documents(text_field, bad_rows)
        else:
            yield from self._parquet_documents(text_field, bad_rows)

    def _json_documents(self, text_field: str, bad_rows: BadRows) -> Iterator[str]:
        with self._open() as f:
            head = f.read(1)
            while head.isspace():
                head = f.read(1)
            if head == b"[":  # a JSON array of records, not JSON lines
                records = enumerate(json.loads(_decode(head + f.read(), self.path)), start=1)
                yield from self._records(((f"{self.path} record {i}", r) for i, r in records), text_field, bad_rows)
                return
            lines = ((f"{self.path} line {i}", line) for i, line in enumerate(chain([head + f.readline()], f), start=1))
            yield from self._records(self._parsed(lines), text_field, bad_rows)

    @staticmethod
    def _parsed(lines: Iterator[tuple[str, bytes]]) -> Iterator[tuple[str, Any]]:
        for where, line in lines:
            if line.strip():
                try:
                    yield where, json.loads(_decode(line, where))
                except json.JSONDecodeError as err:
                    raise PrepareError(f"{where} is not valid JSON: {err.msg}") from None

    @staticmethod
    def _records(records: Iterator[tuple[str, Any]], text_field: str, bad_rows: BadRows) -> Iterator[str]:
        values = ((where, _field(r, text_field)) for where, r in records)
        return bad_rows.texts(values, text_field)

    def _parquet_documents(self, text_field: str, bad_rows: BadRows) -> Iterator[str]:
        import pyarrow.parquet as pq

        with self._open() as f:
            parquet = pq.ParquetFile(f)
            if text_field not in parquet.schema_arrow.names:
                raise PrepareError(missing_column(self.path, text_field, parquet.schema_arrow.names))
            batches = parquet.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[text_field])
            yield from bad_rows.texts(_rows(self.path, (b.column(0).to_pylist() for b in batches)), text_field)


@dataclass(frozen=True)
class FileCorpus:
    """Local files, read one after another in the order given (directories: sorted, recursive)."""

    files: tuple[InputFile, ...]

    def names(self) -> list[str]:
        return [f.path for f in self.files]

    def describe(self) -> str:
        more = f" and {len(self.files) - 3} more" if len(self.files) > 3 else ""
        return ", ".join(f.path for f in self.files[:3]) + more

    def identity(self) -> list[str]:
        return [f.identity() for f in self.files]

    def part(self, index: int, num_parts: int) -> FileCorpus:
        if len(self.files) < num_parts:
            raise PrepareError(
                f"{num_parts} parts need at least {num_parts} input files, got {len(self.files)}; "
                "split the corpus into more files or prepare it in fewer parts"
            )
        n = len(self.files)
        return FileCorpus(self.files[index * n // num_parts : (index + 1) * n // num_parts])

    def documents(self, text_field: str, bad_rows: BadRows) -> Iterator[str]:
        for file in self.files:
            yield from file.documents(text_field, bad_rows)


@dataclass(frozen=True)
class DatasetCorpus:
    """A ``save_to_disk`` folder (``saved``), or anything ``datasets.load_dataset`` takes: a hub name,
    a builder (``json``, ``parquet``, ``text``) with ``data_files``, a local data folder. Loaded
    datasets are streamed: one pass is all tokenizing needs, and no Arrow cache is left behind.

    Args:
        path: the folder, or ``load_dataset``'s ``path``.
        split: the split to read.
        saved: ``path`` is a ``save_to_disk`` folder (``load_from_disk``).
        config: ``load_dataset``'s ``name`` (the dataset configuration).
        data_files: ``load_dataset``'s ``data_files`` (local paths or globs, or remote ones).
        load_kwargs: further ``load_dataset`` arguments, e.g. ``{"sample_by": "document"}``.
        storage_options: for URLs (``s3://``, ...), as ``datasets`` takes them; not part of the identity.
    """

    path: str
    split: str
    saved: bool
    config: str | None = None
    data_files: str | tuple[str, ...] | dict[str, Any] | None = None
    load_kwargs: tuple[tuple[str, Any], ...] = ()
    part_index: int = 0
    num_parts: int = 1
    storage_options: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def names(self) -> list[str]:
        loader = "disk" if self.saved else "load"
        return [
            f"{loader}:{self.path}:{self.config}:{self.split}:{self.data_files}:{sorted(self.load_kwargs)}:"
            f"{self.part_index}/{self.num_parts}"
        ]

    def describe(self) -> str:
        return f"split {self.split!r} of {self.path!r}" + (f" ({self.data_files})" if self.data_files else "")

    def local_files(self, split_only: bool = False) -> list[Path]:
        """The local files behind the dataset (with ``split_only``, those ``data_files`` gives this split)."""
        if self.saved or Path(self.path).is_dir():
            return sorted(p for p in Path(self.path).rglob("*") if p.is_file())
        patterns = [p for p in self._patterns(split_only) if not is_url(p)]
        return sorted(
            {Path(p) for pattern in patterns for p in expand_glob(pattern, recursive=True) if Path(p).is_file()}
        )

    def _patterns(self, split_only: bool) -> list[str]:
        files = self.data_files
        if isinstance(files, dict):
            values = [files.get(self.split, ())] if split_only else files.values()
        else:
            values = [files]
        return [p for v in values for p in ([v] if isinstance(v, str) else list(v or []))]

    def remote_files(self, split_only: bool = False) -> list[Path]:
        """The files at URLs that ``data_files`` names or matches (as ``UPath``s)."""
        found = []
        for pattern in self._patterns(split_only):
            if is_url(pattern):
                fs, path = fsspec.url_to_fs(pattern, **(self.storage_options or {}))
                protocol = pattern.split("://", 1)[0]
                found += [storage_path(f"{protocol}://{match}", self.storage_options) for match in fs.glob(path)]
        return sorted(found, key=str)

    def identity(self) -> list[str]:
        # Local files by size and time; a hub dataset by its name (its revision is not checked).
        return [*self.names(), *map(file_stamp, self.local_files())]

    def part(self, index: int, num_parts: int) -> DatasetCorpus:
        return replace(self, part_index=index, num_parts=num_parts)

    def load(self) -> Any:
        data_files = list(self.data_files) if isinstance(self.data_files, tuple) else self.data_files
        loaded = load_split(
            self.path,
            self.split,
            self.config,
            data_files,
            dict(self.load_kwargs),
            streaming=not self.saved,
            error=PrepareError,
            storage_options=self.storage_options,
        )
        if self.num_parts == 1:
            return loaded
        if self.saved:
            return loaded.shard(self.num_parts, self.part_index, contiguous=True)
        return loaded.shard(num_shards=self.num_parts, index=self.part_index)

    def documents(self, text_field: str, bad_rows: BadRows) -> Iterator[str]:
        dataset = self.load()
        columns = dataset.column_names
        if columns is not None and text_field not in columns:
            raise PrepareError(missing_column(self.path, text_field, columns))
        batches = dataset.select_columns([text_field]).iter(batch_size=BATCH_DOCUMENTS)
        yield from bad_rows.texts(_rows(self.path, (b[text_field] for b in batches)), text_field)


Corpus = FileCorpus | DatasetCorpus


def _input_file(path: Path, storage_options: dict[str, Any] | None = None) -> InputFile:
    kind, compression = _split_suffix(path.name)
    if kind is None:
        raise PrepareError(f"input {str(path)!r} has an unknown suffix; accepted: {accepted_suffixes()}")
    return InputFile(str(path), kind, compression, storage_options)


def _directory_files(
    directory: Path, glob: str | None, storage_options: dict[str, Any] | None = None
) -> list[InputFile]:
    paths = sorted(
        p
        for p in directory.rglob(glob or "*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    if not paths:
        raise PrepareError(
            f"input directory {str(directory)!r} holds no files" + (f" matching {glob!r}" if glob else "")
        )
    if glob is None:
        unknown = [p.name for p in paths if _split_suffix(p.name)[0] is None]
        kinds = {_split_suffix(p.name)[0] for p in paths} - {None}
        if unknown or len(kinds) > 1:
            what = (
                f"files with unknown suffixes ({unknown[:3]})" if unknown else f"files of several kinds {sorted(kinds)}"
            )
            raise PrepareError(
                f"input directory {str(directory)!r} holds {what}; "
                f"choose the documents with {option('glob')}, e.g. {option('glob', '**/*.jsonl.gz')}"
            )
    return [_input_file(p, storage_options) for p in paths]


def resolve_inputs(
    inputs: list[str], split: str = "train", glob: str | None = None, storage_options: dict[str, Any] | None = None
) -> Corpus:
    """The corpus that ``inputs`` (local paths, URLs read with ``storage_options``, a hub name) name,
    checked for existence and kind without reading documents."""
    if not inputs:
        raise PrepareError("no inputs given")
    datasets_named = []
    files: list[InputFile] = []
    for value in map(str, inputs):
        remote = is_url(value)
        try:
            path = storage_path(value, storage_options) if remote else Path(value).expanduser()
        except (ImportError, ValueError) as err:
            raise PrepareError(str(err)) from None
        if is_saved_dataset(path, storage_options):
            datasets_named.append(DatasetCorpus(str(path), split, saved=True, storage_options=storage_options))
        elif path.is_dir():
            files += _directory_files(path, glob, storage_options)
        elif path.is_file():
            files.append(_input_file(path, storage_options))
        elif not remote and looks_like_hub_name(value):
            datasets_named.append(DatasetCorpus(value, split, saved=False))
        else:
            raise PrepareError(f"input path {value!r} does not exist")
    if datasets_named and (files or len(datasets_named) > 1):
        raise PrepareError(f"a saved or hub dataset ({datasets_named[0].path}) must be the only input")
    return datasets_named[0] if datasets_named else FileCorpus(tuple(files))


def document_batches(corpus: Corpus, text_field: str, bad_rows: BadRows) -> Iterator[list[str]]:
    """The corpus's documents in order, in batches of at most ``BATCH_DOCUMENTS`` or about 8M characters."""
    batch: list[str] = []
    characters = 0
    for text in corpus.documents(text_field, bad_rows):
        if bad_rows.is_empty(text):
            continue
        batch.append(text)
        characters += len(text)
        if len(batch) >= BATCH_DOCUMENTS or characters >= BATCH_CHARACTERS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch
