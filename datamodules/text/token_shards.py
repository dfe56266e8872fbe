"""A directory of token shards read as one memory-mapped token stream.

Layouts, by what the directory holds: shards written by prepare (``metadata.json``); a directory of
prepared parts (``part-00000/``, ...), read in part order; Megatron-LM ``.bin``/``.idx`` pairs; or
bare ``.npy`` files (dtype from the header). A ``.bin`` without metadata or index is refused, never
guessed, and so are signed ids without metadata.

The directory may be a URL (``s3://bucket/corpus``, see ``datamodules.storage``): its layout is
read the same way, and windows are read as byte ranges, the windows of one batch in one round of
concurrent requests, adjacent ranges of a file merged.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.plan.loader import same_tokenizer
from datamodules.storage.locations import describe_error, is_url, storage_path
from datamodules.storage.range_reader import RangeReader, check_unchanged, local_version, read_ranges
from datamodules.text.megatron import read_index
from datamodules.text.shard_metadata import EDGE_BYTES, METADATA_FILE, ShardMetadata, edge_ranges, edges_digest

log = logging.getLogger(__name__)

SHARD_SUFFIXES = (".npy", ".bin")
# Bytes read for a .npy header: numpy refuses headers over 10,000 bytes unless told otherwise.
_NPY_HEAD = 16_384
PART_GLOB = "part-*"
PREFETCH_STEPS = 16
IO_THREADS = 16
# Seconds between checks that the local shards a process maps are the ones opened (a stat each): a
# check per batch would cost a few microseconds a shard, a tenth of the memory-mapped read itself.
CHECK_EVERY = 1.0


@dataclass(frozen=True)
class _Shard:
    path: Path  # a pathlib.Path, or a UPath for a URL
    num_tokens: int
    offset: int  # byte offset of the first token inside the file (the .npy header)
    dtype: str


@dataclass
class _Layout:
    """What a layout reader finds: the shards in order, document starts, and the data's identity."""

    dtype: np.dtype
    shards: list[_Shard]
    document_starts: np.ndarray | None
    fingerprint: str
    vocabulary: dict[str, Any] | None  # the tokenizer and EOS id that wrote the tokens, when recorded


def _npy_shards(paths: list[Path]) -> list[_Shard]:
    """1-D ``.npy`` files as shards, reading only their headers (for URLs, all in one round of requests)."""
    sizes = [path.stat().st_size for path in paths]
    heads = read_ranges(paths, [0] * len(paths), [min(size, _NPY_HEAD) for size in sizes])  # errors name the file
    return [_npy_shard(path, size, head) for path, size, head in zip(paths, sizes, heads, strict=True)]


def _npy_shard(path: Path, size: int, head: bytes) -> _Shard:
    """A 1-D ``.npy`` file of ``size`` bytes as a shard, from its first bytes ``head``."""
    try:
        f = io.BytesIO(head)
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = header(f)
        offset = f.tell()
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"token shard {path} is truncated or not a .npy file ({err})") from None
    if len(shape) != 1:
        raise ValueError(f"token shard {path} must be 1-D, got shape {shape}")
    if offset + shape[0] * dtype.itemsize > size:
        raise ValueError(
            f"token shard {path} is truncated or not a .npy file (its header names {shape[0]} tokens, "
            f"its file has {size} bytes)"
        )
    return _Shard(path, int(shape[0]), offset, dtype.name)


def _bin_shard(path: Path, dtype: np.dtype) -> _Shard:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"shard {path} is {size} bytes, not a multiple of the {dtype} item size {dtype.itemsize}")
    return _Shard(path, size // dtype.itemsize, 0, dtype.name)


def _edges(shards: list[_Shard], itemsize: int) -> list[tuple[bytes, bytes]]:
    """Every shard's first and last ``EDGE_BYTES`` bytes, read in one round (cheap for thousands of files)."""
    ranges = [edge_ranges(shard.offset, shard.num_tokens, itemsize) for shard in shards]
    paths = [shard.path for shard in shards for _ in range(2)]
    read = iter(read_ranges(paths, [a for r in ranges for a, _ in r], [b for r in ranges for _, b in r]))
    return [(next(read), next(read)) for _ in shards]


def _content_fingerprint(shards: list[_Shard], itemsize: int) -> str:
    # Names, sizes and both ends of every shard.
    h = hashlib.blake2b(digest_size=16)
    for shard, (first, last) in zip(shards, _edges(shards, itemsize), strict=True):
        h.update(f"{shard.path.name}:{shard.num_tokens}".encode())
        h.update(first)
        h.update(last)
    return h.hexdigest()


def _check_edges(directory: Path, metadata: ShardMetadata, shards: list[_Shard], itemsize: int) -> None:
    """Shards whose ends differ from what ``metadata.json`` recorded when they were written: refused, by name."""
    recorded = [(info, shard) for info, shard in zip(metadata.shards, shards, strict=True) if info.edges]
    if not recorded:
        return  # prepared by an earlier version: the content hash alone fingerprints the folder
    found = _edges([shard for _, shard in recorded], itemsize)
    changed = [info.file for (info, _), ends in zip(recorded, found, strict=True) if edges_digest(*ends) != info.edges]
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ValueError(
            f"token shards in {directory} changed since they were prepared: {', '.join(changed[:3])}{more} (its first "
            f"or last {EDGE_BYTES} bytes differ from {METADATA_FILE}'s record); prepare the folder again"
        )


def _matching(directory: Path, suffixes: tuple[str, ...], file_pattern: str | None) -> list[Path]:
    paths = directory.glob(file_pattern) if file_pattern else directory.iterdir()
    return sorted(p for p in paths if p.is_file() and p.suffix in suffixes)


def _prepared_layout(directory: Path, metadata: ShardMetadata | None = None) -> _Layout:
    metadata = metadata or ShardMetadata.read(directory)
    dtype = np.dtype(metadata.dtype)
    shards = []
    # One listing names the files (and, for a URL, caches their sizes): no request per shard.
    listed = {path.name for path in directory.iterdir()}
    paths = [directory / info.file for info in metadata.shards]
    for info, path in zip(metadata.shards, paths, strict=True):
        if info.file not in listed or not path.is_file():
            raise FileNotFoundError(f"shard {info.file!r} listed in {directory / METADATA_FILE} is missing")
    npy = iter(_npy_shards([path for path in paths if path.suffix == ".npy"]))
    for info, path in zip(metadata.shards, paths, strict=True):
        shard = next(npy) if path.suffix == ".npy" else _bin_shard(path, dtype)
        if shard.dtype != dtype.name:
            raise ValueError(f"shard {path} has dtype {shard.dtype}, expected {dtype}")
        if shard.num_tokens != info.num_tokens:
            raise ValueError(f"shard {path} holds {shard.num_tokens} tokens but {METADATA_FILE} says {info.num_tokens}")
        shards.append(shard)
    starts = None
    if metadata.document_starts:
        path = directory / metadata.document_starts
        if not path.is_file():
            raise FileNotFoundError(f"{path}, named in {directory / METADATA_FILE}, is missing")
        starts = np.load(io.BytesIO(path.read_bytes())).astype(np.int64)
    vocabulary = metadata.vocabulary()
    _check_edges(directory, metadata, shards, dtype.itemsize)
    fingerprint = metadata.content_hash or _content_fingerprint(shards, dtype.itemsize)
    return _Layout(dtype, shards, starts, fingerprint, vocabulary)


def _megatron_layout(directory: Path, file_pattern: str | None) -> _Layout:
    indexes = _matching(directory, (".idx",), file_pattern)
    shards, starts, dtypes = [], [], set()
    offset = 0
    for idx in indexes:
        index = read_index(idx)
        data = idx.with_suffix(".bin")
        if not data.is_file():
            raise FileNotFoundError(f"Megatron index {idx} has no data file {data.name}")
        shard = _bin_shard(data, index.dtype)
        if shard.num_tokens != index.num_tokens:
            raise ValueError(f"{data} holds {shard.num_tokens} tokens but its index {idx.name} says {index.num_tokens}")
        shards.append(shard)
        starts.append(index.document_starts + offset)
        dtypes.add(index.dtype)
        offset += shard.num_tokens
    if len(dtypes) != 1:
        raise ValueError(f"Megatron shards in {directory} have several dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    return _Layout(dtype, shards, np.concatenate(starts), _content_fingerprint(shards, dtype.itemsize), None)


def _npy_layout(directory: Path, file_pattern: str | None) -> _Layout:
    paths = _matching(directory, SHARD_SUFFIXES, file_pattern)
    bins = [p.name for p in paths if p.suffix == ".bin"]
    if bins:
        raise ValueError(
            f"{directory} holds raw .bin shards ({bins[0]}, ...) but no {METADATA_FILE} or Megatron .idx; a .bin "
            "file does not record its dtype, so write metadata (python -m datamodules.text.prepare) or use .npy"
        )
    if not paths:
        where = f" matching {file_pattern!r}" if file_pattern else ""
        raise ValueError(f"no token shards (*.npy or *.bin){where} in {directory}")
    shards = _npy_shards(paths)
    dtypes = {s.dtype for s in shards}
    if len(dtypes) != 1:
        raise ValueError(f"token shards in {directory} have several dtypes {sorted(dtypes)}")
    dtype = np.dtype(dtypes.pop())
    if dtype.kind == "i":
        raise ValueError(
            f"token shards in {directory} hold signed integers ({dtype}) and no {METADATA_FILE}: negative ids "
            "cannot be token ids; store unsigned ids, or write metadata.json stating the dtype"
        )
    return _Layout(dtype, shards, None, _content_fingerprint(shards, dtype.itemsize), None)


def _parts_layout(directory: Path, parts: list[Path]) -> _Layout:
    layouts, indices = [], []
    for part in parts:
        metadata = ShardMetadata.read(part)
        layouts.append(_prepared_layout(part, metadata))
        indices.append((metadata.extra.get("part_index"), metadata.extra.get("num_parts")))
    totals = {n for _, n in indices}
    if len(totals) != 1 or None in totals:
        raise ValueError(f"the parts in {directory} disagree on how many parts there are: {sorted(map(str, totals))}")
    total = totals.pop()
    missing = sorted(set(range(total)) - {i for i, _ in indices})
    if missing:
        raise ValueError(
            f"{directory} holds {len(parts)} of {total} prepared parts; part(s) {missing} are missing "
            "(still being prepared, or their run failed)"
        )
    ordered = [layout for _, layout in sorted(zip(indices, layouts, strict=True), key=lambda p: p[0][0])]
    if not all(same_tokenizer(ordered[0].vocabulary, layout.vocabulary) for layout in ordered[1:]):
        vocabularies = sorted({str(layout.vocabulary) for layout in ordered})
        raise ValueError(f"the parts in {directory} were written by different tokenizers: {vocabularies}")
    return _concat(ordered)


def _concat(layouts: list[_Layout]) -> _Layout:
    offsets = np.cumsum([0] + [sum(s.num_tokens for s in layout.shards) for layout in layouts])
    starts = [layout.document_starts for layout in layouts]
    vocabulary = layouts[0].vocabulary
    fingerprint = hashlib.blake2b("+".join(layout.fingerprint for layout in layouts).encode(), digest_size=16)
    return _Layout(
        np.result_type(*(layout.dtype for layout in layouts)),
        [shard for layout in layouts for shard in layout.shards],
        None
        if any(s is None for s in starts)
        else np.concatenate([s + o for s, o in zip(starts, offsets, strict=False)]),
        fingerprint.hexdigest(),
        vocabulary if all(same_tokenizer(vocabulary, layout.vocabulary) for layout in layouts[1:]) else None,
    )


def _read_layout(directory: Path, file_pattern: str | None) -> _Layout:
    if (directory / METADATA_FILE).exists():
        if file_pattern:
            raise ValueError(f"file_pattern selects shards of directories without {METADATA_FILE}; {directory} has one")
        return _prepared_layout(directory)
    if _matching(directory, (".idx",), file_pattern):
        return _megatron_layout(directory, file_pattern)
    parts = sorted(p for p in directory.glob(PART_GLOB) if p.is_dir() and (p / METADATA_FILE).exists())
    if parts and not file_pattern:
        return _parts_layout(directory, parts)
    return _npy_layout(directory, file_pattern)


class TokenShards:
    """The tokens of every shard in ``directory``, concatenated in order, read without loading them.

    Args:
        directory: a prepared directory (``metadata.json``, needed for ``.bin`` shards written by
            prepare and for document boundaries), a directory of prepared ``part-*`` folders,
            Megatron ``.bin``/``.idx`` pairs, or bare 1-D ``.npy`` files.
        file_pattern: glob selecting the shard files (``.npy``, or Megatron ``.idx``) of a directory
            without ``metadata.json``, e.g. ``"train_*.npy"``; default: all of them.
        storage_options: for a URL ``directory``, the fsspec filesystem's options (endpoint,
            credentials, ``anon``).
        prefetch_steps: for a URL, micro-batches whose windows are requested together, the next
            group while the current one trains.
        io_threads: for a URL, range requests in flight at once, per process.
    """

    def __init__(
        self,
        directory: str | Path,
        file_pattern: str | None = None,
        storage_options: dict[str, Any] | None = None,
        prefetch_steps: int = PREFETCH_STEPS,
        io_threads: int = IO_THREADS,
    ) -> None:
        self.directory = storage_path(directory, storage_options)
        self.prefetch_steps = prefetch_steps
        reader = RangeReader(str(directory), storage_options, io_threads) if is_url(directory) else None
        try:
            if not self.directory.is_dir():
                raise FileNotFoundError(f"token shard directory {str(directory)!r} does not exist")
            layout = _read_layout(self.directory, file_pattern)
            if reader is not None:  # what the run reads: an object changed under it is refused
                reader.expect([str(shard.path) for shard in layout.shards])
        except ImportError as err:  # the URL's fsspec filesystem is not installed (gcsfs, ...)
            raise ImportError(f"cannot read token shards at {str(directory)!r}: {err}") from None
        except Exception as err:
            if reader is None or isinstance(err, FileNotFoundError | ValueError):
                raise
            # The store's own errors (no credentials, access denied, ...): one line naming the URL.
            raise OSError(f"cannot read token shards at {str(directory)!r}: {describe_error(err)}") from None
        self._set_layout(layout)
        self._readers = [reader] * len(self._shards)  # per shard: a mixture may join local and remote streams
        # Local shards' (size, mtime) as opened; a remote one's ETag goes with each read instead.
        self._versions = [None if reader else local_version(os.stat(s.path)) for s in self._shards]

    def _set_layout(self, layout: _Layout) -> None:
        self.dtype = layout.dtype
        self._shards = layout.shards
        if self.dtype.kind not in "iu":
            raise ValueError(f"token shards must hold integers, {self.directory} holds {self.dtype}")
        self._starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in self._shards], dtype=np.int64)])
        self.num_tokens = int(self._starts[-1])
        starts = layout.document_starts
        if starts is not None and (
            starts.ndim != 1 or (starts.size and (starts[0] != 0 or starts[-1] >= self.num_tokens))
        ):
            raise ValueError(f"document starts in {self.directory} do not fit {self.num_tokens} tokens")
        self.document_starts = starts
        self.fingerprint = layout.fingerprint
        self.vocabulary = layout.vocabulary
        self._layout = layout
        self._maps: dict[int, np.ndarray] = {}
        self._memory: np.ndarray | None = None
        self._checked_at = time.monotonic()
        self._read_since_check: set[int] = set()  # local shards read since the last check

    @classmethod
    def from_tokens(
        cls, tokens: np.ndarray, document_starts: np.ndarray, name: str, vocabulary: dict[str, Any] | None = None
    ) -> TokenShards:
        """A stream held in memory (an evaluation set sent from rank 0), read like shards on disk."""
        shards = cls.__new__(cls)
        shards.directory = Path(name)
        digest = hashlib.blake2b(np.ascontiguousarray(tokens).data, digest_size=16).hexdigest()
        shard = _Shard(Path(f"<memory:{name}>"), len(tokens), 0, tokens.dtype.name)
        shards._set_layout(_Layout(tokens.dtype, [shard], document_starts.astype(np.int64), digest, vocabulary))
        shards._memory, shards._readers, shards.prefetch_steps = tokens, [None], PREFETCH_STEPS
        shards._versions = [None]
        return shards

    @classmethod
    def concat(cls, parts: list[TokenShards]) -> TokenShards:
        """One stream of several shard directories, one after another (dtype: the widest)."""
        joined = cls.__new__(cls)
        joined.directory = parts[0].directory
        joined.prefetch_steps = max(part.prefetch_steps for part in parts)
        joined._set_layout(_concat([p._layout for p in parts]))
        joined._readers = [reader for part in parts for reader in part._readers]
        joined._versions = [version for part in parts for version in part._versions]
        return joined

    def __getstate__(self) -> dict:
        # Memory maps are reopened lazily in each worker process instead of being pickled as arrays.
        return {**self.__dict__, "_maps": {}}

    @property
    def remote(self) -> bool:
        """Whether the shards are read as byte ranges of a URL (not memory-mapped)."""
        return any(reader is not None for reader in self._readers)

    def _map(self, i: int) -> np.ndarray:
        if self._memory is not None:
            return self._memory
        tokens = self._maps.get(i)
        if tokens is None:
            shard = self._shards[i]
            mm = np.memmap(shard.path, dtype=shard.dtype, mode="r", offset=shard.offset, shape=(shard.num_tokens,))
            # A plain ndarray view of the map (which it keeps alive): slicing an np.memmap costs
            # about 1 us more per slice, as much as copying a whole window.
            tokens = self._maps[i] = mm.view(np.ndarray)
        return tokens

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Copy tokens ``[start, start + len(out))`` of the stream into ``out``."""
        if self.remote:
            out[:] = self.read_windows(np.array([start], dtype=np.int64), out.shape[0])[0]
            return
        pieces = list(self._pieces(start, out.shape[0]))
        for i, local, column, take in pieces:
            out[column : column + take] = self._map(i)[local : local + take]
        self._check_unchanged(i for i, _, _, _ in pieces)

    def _check_unchanged(self, read: Iterable[int]) -> None:
        """After a read of the shards ``read``: every ``CHECK_EVERY`` seconds, the local shards read since
        the last check must still be the files opened (size and mtime), since one rewritten in place would
        mix two versions in the windows. A stat per shard read in the interval: the cost follows the
        reads, not the number of shards (a shared filesystem's metadata server serves every rank)."""
        self._read_since_check.update(read)
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY:
            return
        self._checked_at, shards, self._read_since_check = now, self._read_since_check, set()
        for i in shards:
            if self._versions[i] is not None:
                path = str(self._shards[i].path)
                check_unchanged(path, self._versions[i], os.stat(path))

    def _pieces(self, start: int, count: int) -> Iterator[tuple[int, int, int, int]]:
        """Tokens ``[start, start + count)`` of the stream shard by shard: ``(shard, first token in
        it, offset in the span, tokens)``."""
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < count:
            local = start + done - int(self._starts[i])
            take = min(count - done, self._shards[i].num_tokens - local)
            yield i, local, done, take
            done += take
            i += 1

    def read_windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Tokens ``[s, s + width)`` of the stream for each ``s`` in ``starts``, one row each."""
        if self.remote:
            return self._read_remote(np.asarray(starts, dtype=np.int64), width)
        out = np.empty((len(starts), width), dtype=self.dtype)
        # Shards are looked up for all rows at once, so a row inside one shard costs a single slice
        # copy; only a window that crosses into the next shard takes the general path.
        shard = np.searchsorted(self._starts, starts, side="right") - 1
        local = starts - self._starts[shard]
        shards = shard.tolist()
        for row, (i, lo) in enumerate(zip(shards, local.tolist(), strict=True)):
            if lo + width <= self._shards[i].num_tokens:
                out[row] = self._map(i)[lo : lo + width]
            else:
                self.read_into(int(starts[row]), out[row])
        self._check_unchanged(shards)
        return out

    def _read_remote(self, starts: np.ndarray, width: int) -> np.ndarray:
        """The windows as byte ranges: one piece per (window, shard it touches), each reader's pieces
        in one round of requests (a local shard of a joined stream is sliced from its map)."""
        out = np.empty((len(starts), width), dtype=self.dtype)
        by_reader: dict[RangeReader, list[tuple[int, int, int, int, int]]] = {}  # (row, column, shard, first, count)
        for row, start in enumerate(starts.tolist()):
            for i, local, column, take in self._pieces(start, width):
                if self._readers[i] is None:
                    out[row, column : column + take] = self._map(i)[local : local + take]
                else:
                    by_reader.setdefault(self._readers[i], []).append((row, column, i, local, take))
        for reader, pieces in by_reader.items():
            paths, firsts, ends = [], [], []
            for _, _, i, local, take in pieces:
                shard, itemsize = self._shards[i], np.dtype(self._shards[i].dtype).itemsize
                paths.append(str(shard.path))
                firsts.append(shard.offset + local * itemsize)
                ends.append(shard.offset + (local + take) * itemsize)
            blobs = reader.read(paths, firsts, ends)
            for (row, column, i, _, take), blob in zip(pieces, blobs, strict=True):
                out[row, column : column + take] = np.frombuffer(blob, dtype=self._shards[i].dtype)
        return out
