"""A directory of token shards read as one memory-mapped token stream.

Layouts, by what the directory holds: shards written by prepare (``metadata.json``); a directory of
prepared parts (``part-00000/``, ...), read in part order; Megatron-LM ``.bin``/``.idx`` pairs; or
bare ``.npy`` files (dtype from the header). A ``.bin`` without metadata or index is refused, never
guessed, and so are signed ids without metadata.

The directory may be a URL (``s3://bucket/corpus``, see ``datamodules.storage``): its layout is
read the same way, and windows are read as byte ranges, the windows of one batch in one round of
concurrent requests, adjacent ranges of a file merged.

In a job, the layout is read on global rank 0 from one listing of the directory and sent to every
rank (``shard_description``); a node cache keyed by that listing spares a restart the reading.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.plan.loader import same_tokenizer
from datamodules.plan.parallelism import Job
from datamodules.storage.locations import describe_error, is_url, storage_path
from datamodules.storage.range_reader import (
    RangeReader,
    check_unchanged,
    folder_versions,
    local_version,
    read_ranges,
)
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles, range_key
from datamodules.text.megatron import parse_index
from datamodules.text.shard_description import (
    DescriptionCache,
    ShardFile,
    ShardLayout,
    Version,
    layout_arrays,
    layout_from_arrays,
)
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

Files = dict[str, Version]  # a folder's listing: every file's path under it -> its version


def _read_files(directory: Path, names: list[str], files: Files) -> list[bytes]:
    """Whole listed files of ``directory``, in one round of requests: their sizes are listed, so a
    ranged GET each (no HEAD first, as opening a remote file would send)."""
    return read_ranges([directory / name for name in names], [0] * len(names), [files[name][0] for name in names])


def _metadata(directory: Path, files: Files) -> ShardMetadata:
    return ShardMetadata.parse(_read_files(directory, [METADATA_FILE], files)[0], directory / METADATA_FILE)


def _npy_shards(directory: Path, names: list[str], files: Files) -> tuple[list[ShardFile], list[bytes]]:
    """1-D ``.npy`` files as shards, reading only their first bytes (for URLs, all in one round of
    requests), and those bytes: the header, and the first edge of the fingerprint."""
    paths, sizes = [directory / name for name in names], [files[name][0] for name in names]
    heads = read_ranges(paths, [0] * len(paths), [min(size, _NPY_HEAD) for size in sizes])  # errors name the file
    return [_npy_shard(path, size, head) for path, size, head in zip(paths, sizes, heads, strict=True)], heads


def _npy_shard(path: Path, size: int, head: bytes) -> ShardFile:
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
    return ShardFile(path, int(shape[0]), offset, dtype.name)


def _bin_shard(path: Path, size: int, dtype: np.dtype) -> ShardFile:
    if size % dtype.itemsize:
        raise ValueError(f"shard {path} is {size} bytes, not a multiple of the {dtype} item size {dtype.itemsize}")
    return ShardFile(path, size // dtype.itemsize, 0, dtype.name)


def _edges(shards: list[ShardFile], itemsize: int, heads: list[bytes] | None = None) -> list[tuple[bytes, bytes]]:
    """Every shard's first and last ``EDGE_BYTES`` bytes, read in one round (cheap for thousands of
    files); a range inside the shard's first bytes already read (``heads``) is taken from them."""
    heads = heads or [b""] * len(shards)
    ranges = [edge_ranges(shard.offset, shard.num_tokens, itemsize) for shard in shards]
    wanted = [(i, start, end) for i, pair in enumerate(ranges) for start, end in pair if end > len(heads[i])]
    blobs = read_ranges([shards[i].path for i, _, _ in wanted], [s for _, s, _ in wanted], [e for _, _, e in wanted])
    read = dict(zip(wanted, blobs, strict=True))

    def edge(i: int, start: int, end: int) -> bytes:
        return read[i, start, end] if (i, start, end) in read else heads[i][start:end]

    return [(edge(i, *first), edge(i, *last)) for i, (first, last) in enumerate(ranges)]


def _content_fingerprint(shards: list[ShardFile], itemsize: int, heads: list[bytes] | None = None) -> str:
    # Names, sizes and both ends of every shard.
    h = hashlib.blake2b(digest_size=16)
    for shard, (first, last) in zip(shards, _edges(shards, itemsize, heads), strict=True):
        h.update(f"{shard.path.name}:{shard.num_tokens}".encode())
        h.update(first)
        h.update(last)
    return h.hexdigest()


def _check_edges(
    directory: Path, metadata: ShardMetadata, shards: list[ShardFile], itemsize: int, heads: list[bytes]
) -> None:
    """Shards whose ends differ from what ``metadata.json`` recorded when they were written: refused, by name."""
    recorded = [i for i, info in enumerate(metadata.shards) if info.edges]
    if not recorded:
        return  # prepared by an earlier version: the content hash alone fingerprints the folder
    found = _edges([shards[i] for i in recorded], itemsize, [heads[i] for i in recorded])
    changed = [
        metadata.shards[i].file
        for i, ends in zip(recorded, found, strict=True)
        if edges_digest(*ends) != metadata.shards[i].edges
    ]
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ValueError(
            f"token shards in {directory} changed since they were prepared: {', '.join(changed[:3])}{more} (its first "
            f"or last {EDGE_BYTES} bytes differ from {METADATA_FILE}'s record); prepare the folder again"
        )


def _glob_match(name: str, pattern: str) -> bool:
    """Whether the path ``name`` matches the glob ``pattern`` as ``Path.glob`` would (``*`` stays in a folder)."""
    parts, wanted = name.split("/"), pattern.split("/")
    return len(parts) == len(wanted) and all(fnmatchcase(p, w) for p, w in zip(parts, wanted, strict=True))


def _matching(files: Files, suffixes: tuple[str, ...], file_pattern: str | None) -> list[str]:
    """The listed files with one of ``suffixes`` selected by ``file_pattern`` (default: the folder's own)."""
    names = [name for name in files if name.endswith(suffixes) and _glob_match(name, file_pattern or "*")]
    return sorted(names, key=lambda name: name.split("/"))


def _under(files: Files, folder: str) -> Files:
    """The listing of the sub-folder ``folder``, paths relative to it."""
    prefix = folder + "/"
    return {name.removeprefix(prefix): version for name, version in files.items() if name.startswith(prefix)}


def _prepared_layout(directory: Path, files: Files, metadata: ShardMetadata | None = None) -> ShardLayout:
    metadata = metadata or _metadata(directory, files)
    dtype = np.dtype(metadata.dtype)
    for info in metadata.shards:
        if info.file not in files:
            raise FileNotFoundError(f"shard {info.file!r} listed in {directory / METADATA_FILE} is missing")
    npy = [info.file for info in metadata.shards if info.file.endswith(".npy")]
    npy_shards, npy_heads = _npy_shards(directory, npy, files)
    found = dict(zip(npy, zip(npy_shards, npy_heads, strict=True), strict=True))
    shards, heads = [], []
    for info in metadata.shards:
        path = directory / info.file
        shard, head = found.get(info.file) or (_bin_shard(path, files[info.file][0], dtype), b"")
        if shard.dtype != dtype.name:
            raise ValueError(f"shard {path} has dtype {shard.dtype}, expected {dtype}")
        if shard.num_tokens != info.num_tokens:
            raise ValueError(f"shard {path} holds {shard.num_tokens} tokens but {METADATA_FILE} says {info.num_tokens}")
        shards.append(shard)
        heads.append(head)
    starts = None
    if metadata.document_starts:
        path = directory / metadata.document_starts
        if metadata.document_starts not in files:
            raise FileNotFoundError(f"{path}, named in {directory / METADATA_FILE}, is missing")
        starts = np.load(io.BytesIO(_read_files(directory, [metadata.document_starts], files)[0])).astype(np.int64)
    vocabulary = metadata.vocabulary()
    _check_edges(directory, metadata, shards, dtype.itemsize, heads)
    fingerprint = metadata.content_hash or _content_fingerprint(shards, dtype.itemsize, heads)
    return ShardLayout(dtype, shards, starts, fingerprint, vocabulary)


def _megatron_layout(directory: Path, files: Files, file_pattern: str | None) -> ShardLayout:
    shards, starts, dtypes = [], [], set()
    offset = 0
    names = _matching(files, (".idx",), file_pattern)
    for name, data in zip(names, _read_files(directory, names, files), strict=True):
        idx = directory / name
        index = parse_index(data, idx)
        tokens = name.removesuffix(".idx") + ".bin"
        if tokens not in files:
            raise FileNotFoundError(f"Megatron index {idx} has no data file {Path(tokens).name}")
        shard = _bin_shard(directory / tokens, files[tokens][0], index.dtype)
        if shard.num_tokens != index.num_tokens:
            raise ValueError(
                f"{shard.path} holds {shard.num_tokens} tokens but its index {idx.name} says {index.num_tokens}"
            )
        shards.append(shard)
        starts.append(index.document_starts + offset)
        dtypes.add(index.dtype)
        offset += shard.num_tokens
    if len(dtypes) != 1:
        raise ValueError(f"Megatron shards in {directory} have several dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    return ShardLayout(dtype, shards, np.concatenate(starts), _content_fingerprint(shards, dtype.itemsize), None)


def _npy_layout(directory: Path, files: Files, file_pattern: str | None) -> ShardLayout:
    names = _matching(files, SHARD_SUFFIXES, file_pattern)
    bins = [Path(name).name for name in names if name.endswith(".bin")]
    if bins:
        raise ValueError(
            f"{directory} holds raw .bin shards ({bins[0]}, ...) but no {METADATA_FILE} or Megatron .idx; a .bin "
            "file does not record its dtype, so write metadata (python -m datamodules.text.prepare) or use .npy"
        )
    if not names:
        where = f" matching {file_pattern!r}" if file_pattern else ""
        raise ValueError(f"no token shards (*.npy or *.bin){where} in {directory}")
    shards, heads = _npy_shards(directory, names, files)
    dtypes = {s.dtype for s in shards}
    if len(dtypes) != 1:
        raise ValueError(f"token shards in {directory} have several dtypes {sorted(dtypes)}")
    dtype = np.dtype(dtypes.pop())
    if dtype.kind == "i":
        raise ValueError(
            f"token shards in {directory} hold signed integers ({dtype}) and no {METADATA_FILE}: negative ids "
            "cannot be token ids; store unsigned ids, or write metadata.json stating the dtype"
        )
    return ShardLayout(dtype, shards, None, _content_fingerprint(shards, dtype.itemsize, heads), None)


def _parts_layout(directory: Path, files: Files, parts: list[str]) -> ShardLayout:
    layouts, indices = [], []
    names = [f"{part}/{METADATA_FILE}" for part in parts]
    for part, name, text in zip(parts, names, _read_files(directory, names, files), strict=True):
        metadata = ShardMetadata.parse(text, directory / name)
        layouts.append(_prepared_layout(directory / part, _under(files, part), metadata))
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


def _concat(layouts: list[ShardLayout]) -> ShardLayout:
    offsets = np.cumsum([0] + [sum(s.num_tokens for s in layout.shards) for layout in layouts])
    starts = [layout.document_starts for layout in layouts]
    vocabulary = layouts[0].vocabulary
    fingerprint = hashlib.blake2b("+".join(layout.fingerprint for layout in layouts).encode(), digest_size=16)
    return ShardLayout(
        np.result_type(*(layout.dtype for layout in layouts)),
        [shard for layout in layouts for shard in layout.shards],
        None
        if any(s is None for s in starts)
        else np.concatenate([s + o for s, o in zip(starts, offsets, strict=False)]),
        fingerprint.hexdigest(),
        vocabulary if all(same_tokenizer(vocabulary, layout.vocabulary) for layout in layouts[1:]) else None,
    )


def _read_layout(directory: Path, files: Files, file_pattern: str | None) -> ShardLayout:
    """The layout of ``directory``, whose listing is ``files``."""
    if METADATA_FILE in files:
        if file_pattern:
            raise ValueError(f"file_pattern selects shards of directories without {METADATA_FILE}; {directory} has one")
        return _prepared_layout(directory, files)
    if _matching(files, (".idx",), file_pattern):
        return _megatron_layout(directory, files, file_pattern)
    parts = sorted(
        name.split("/")[0]
        for name in files
        if name.count("/") == 1 and name.endswith("/" + METADATA_FILE) and fnmatchcase(name.split("/")[0], PART_GLOB)
    )
    if parts and not file_pattern:
        return _parts_layout(directory, files, parts)
    return _npy_layout(directory, files, file_pattern)


def _listing(directory: Path, reader: RangeReader | None) -> Files:
    """Every file under ``directory`` and its version (``folder_versions``); a folder that does not
    exist (in a bucket: one with nothing under it) is refused."""
    missing = FileNotFoundError(f"token shard directory {str(directory)!r} does not exist")
    if reader is None:
        if not directory.is_dir():
            raise missing
        return folder_versions(directory)
    try:
        files = folder_versions(directory, reader)
    except FileNotFoundError:  # no such bucket
        raise missing from None
    if not files:
        raise missing
    return files


def describe_folder(
    directory: Path, reader: RangeReader | None, file_pattern: str | None, cache: DescriptionCache | None
) -> dict[str, np.ndarray]:
    """What describes the shards of ``directory`` (``shard_description``'s arrays), from one listing of
    it: from ``cache`` where it holds that listing's description, else read (and then cached)."""
    files = _listing(directory, reader)
    key = DescriptionCache.key(files, file_pattern)
    arrays = cache.read(directory, file_pattern, key) if cache else None
    if arrays is None:
        arrays = layout_arrays(_read_layout(directory, files, file_pattern), directory, files)
        if cache:
            cache.write(directory, file_pattern, key, arrays)
    return arrays


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
        job: the job this process belongs to: the layout is read on its global rank 0 (or taken from
            that node's cache of it) and sent to every rank, which sends no request for it. Default
            ``None``: this process reads it, uncached.
    """

    def __init__(
        self,
        directory: str | Path,
        file_pattern: str | None = None,
        storage_options: dict[str, Any] | None = None,
        prefetch_steps: int = PREFETCH_STEPS,
        io_threads: int = IO_THREADS,
        job: Job | None = None,
        files: RemoteFiles = LOCAL_FILES,
    ) -> None:
        self.directory = storage_path(directory, storage_options)
        self.prefetch_steps = prefetch_steps
        self.files = files  # its cache keeps the windows' ranges of shards behind a URL
        reader = RangeReader(str(directory), storage_options, io_threads) if is_url(directory) else None
        cache = None if job is None else DescriptionCache()
        describe = functools.partial(self._describe, str(directory), reader, file_pattern, cache)
        layout, versions = layout_from_arrays(
            describe() if job is None else job.arrays_from_rank_zero(describe), self.directory
        )
        self._set_layout(layout)
        self._readers = [reader] * len(self._shards)  # per shard: a mixture may join local and remote streams
        if reader is not None:  # every ranged read sends the ETag listed (If-Match): a changed object is refused
            reader.expect([str(shard.path) for shard in self._shards], versions)
        # A local shard is checked against its (size, mtime) as rank 0 listed it; the other ranks note
        # theirs when they first map it (another node may hold a copy of its own, with other mtimes).
        local = reader is None and (job is None or job.rank == 0)
        self._versions: list[Version | None] = versions if local else [None] * len(self._shards)

    def _describe(
        self, location: str, reader: RangeReader | None, file_pattern: str | None, cache: DescriptionCache | None
    ) -> dict[str, np.ndarray]:
        try:
            return describe_folder(self.directory, reader, file_pattern, cache)
        except ImportError as err:  # the URL's fsspec filesystem is not installed (gcsfs, ...)
            raise ImportError(f"cannot read token shards at {location!r}: {err}") from None
        except Exception as err:
            if reader is None or isinstance(err, FileNotFoundError | ValueError):
                raise
            # The store's own errors (no credentials, access denied, ...): one line naming the URL.
            raise OSError(f"cannot read token shards at {location!r}: {describe_error(err)}") from None

    def _set_layout(self, layout: ShardLayout) -> None:
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
        shard = ShardFile(Path(f"<memory:{name}>"), len(tokens), 0, tokens.dtype.name)
        shards._set_layout(ShardLayout(tokens.dtype, [shard], document_starts.astype(np.int64), digest, vocabulary))
        shards._memory, shards._readers, shards.prefetch_steps = tokens, [None], PREFETCH_STEPS
        shards.files = LOCAL_FILES
        shards._versions = [None]
        return shards

    @classmethod
    def concat(cls, parts: list[TokenShards]) -> TokenShards:
        """One stream of several shard directories, one after another (dtype: the widest)."""
        joined = cls.__new__(cls)
        joined.directory = parts[0].directory
        joined.prefetch_steps = max(part.prefetch_steps for part in parts)
        joined.files = next((p.files for p in parts if p.files.stats is not None), parts[0].files)
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
            if self._versions[i] is None and self._readers[i] is None:  # a rank other than 0: the file as opened
                self._versions[i] = local_version(os.stat(shard.path))
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

    def read_windows(
        self, starts: np.ndarray, width: int, uses: Any = None, positions: np.ndarray | None = None
    ) -> np.ndarray:
        """Tokens ``[s, s + width)`` of the stream for each ``s`` in ``starts``, one row each. Behind a
        URL, through ``files``' cache: ``uses``, the plan's next uses, and each row's plan position."""
        if self.remote:
            return self._read_remote(np.asarray(starts, dtype=np.int64), width, uses, positions)
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

    def window_keys(self, starts: np.ndarray, width: int) -> np.ndarray:
        """The ``range_key`` of each window's pieces in shards behind a URL, ``[windows, 2]`` (a window
        touches at most two shards when a shard holds a window or more; 0: no piece, or a local one)."""
        keys = np.zeros((len(starts), 2), dtype=np.uint64)
        for row, start in enumerate(np.asarray(starts).tolist()):
            for piece, (i, local, _, take) in enumerate(itertools.islice(self._pieces(start, width), 2)):
                if self._readers[i] is not None:
                    keys[row, piece] = range_key(*self._piece_range(i, local, take))
        return keys

    def _piece_range(self, i: int, local: int, take: int) -> tuple[str, int, int]:
        shard, itemsize = self._shards[i], np.dtype(self._shards[i].dtype).itemsize
        return str(shard.path), shard.offset + local * itemsize, shard.offset + (local + take) * itemsize

    def _read_remote(
        self, starts: np.ndarray, width: int, uses: Any = None, positions: np.ndarray | None = None
    ) -> np.ndarray:
        """The windows as byte ranges: one piece per (window, shard it touches), each reader's pieces
        in one round of requests (a local shard of a joined stream is sliced from its map); a piece
        the cache holds is read from there."""
        out = np.empty((len(starts), width), dtype=self.dtype)
        by_reader: dict[RangeReader, list[tuple[int, int, int, int, int]]] = {}  # (row, column, shard, first, count)
        for row, start in enumerate(starts.tolist()):
            for i, local, column, take in self._pieces(start, width):
                if self._readers[i] is None:
                    out[row, column : column + take] = self._map(i)[local : local + take]
                else:
                    by_reader.setdefault(self._readers[i], []).append((row, column, i, local, take))
        for reader, pieces in by_reader.items():
            ranges = [self._piece_range(i, local, take) for _, _, i, local, take in pieces]
            paths, firsts, ends = ([r[k] for r in ranges] for k in range(3))
            at = None if positions is None else [int(positions[row]) for row, *_ in pieces]
            blobs = self.files.read_ranges(reader, paths, firsts, ends, uses, at)
            for (row, column, i, _, take), blob in zip(pieces, blobs, strict=True):
                out[row, column : column + take] = np.frombuffer(blob, dtype=self._shards[i].dtype)
        return out
