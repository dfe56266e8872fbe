"""Member indexes of tar shards (the WebDataset format): where each member's bytes lie, so a sample
is one ranged read instead of a pass through the whole shard.

A shard is indexed by walking its 512-byte headers with the standard library's ``tarfile``, seeking
over the members' data: a local shard is read in place; a remote one through ranged reads of the
headers only (``RangeReader``'s retries), whose size grows while the headers lie close together (a
shard of small members then costs a few large requests, one of large members a small request per
member). Indexes are kept in a node-local folder, one file per shard named by the shard's location,
size and version (ETag, or mtime for a local file): a shard that changed is indexed again. Each
member's 512-byte header is kept as an 8-byte digest, so a reader can check, on every read, that
the header before the member's data is still the one indexed (``header_digest``).

Samples follow webdataset's convention: a member's key is its name up to the first dot of its last
path component, its field the rest, lowercased (``a/b.c/x.seg.jpg``: key ``a/b.c/x``, field
``seg.jpg``); consecutive members with one key form a sample; directories, links and webdataset's
``__*__`` metadata members are not samples' members.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import shutil
import tarfile
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec
import numpy as np

from datamodules.storage.locations import is_url, process_filesystem
from datamodules.storage.range_reader import RangeReader, local_version

log = logging.getLogger(__name__)

INDEX_FORMAT = 2  # 2: the members' header digests
_KEY_AND_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_TAR_NAME = re.compile(r"\.(tar|tgz)(\.\w+)?$")  # a shard's name, compressed or not (no glob in it)
_COMPRESSIONS = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_FIRST_READ, _MOST_READ = 8 << 10, 1 << 20


def default_index_cache() -> str:
    """``$XDG_CACHE_HOME/datamodules/tar_index`` (``~/.cache`` when unset)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "datamodules", "tar_index")


def key_and_field(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member name by webdataset's rule; ``None`` for a name with no dot."""
    match = _KEY_AND_FIELD.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


def header_digest(block: bytes) -> int:
    """An 8-byte digest (a signed int64) of a member's 512-byte tar header: its name, size, mode,
    times and checksum; a header rewritten or shifted by any of these reads as another digest."""
    return int.from_bytes(hashlib.blake2b(block, digest_size=8).digest(), "little", signed=True)


def compression_of(head: bytes) -> str | None:
    """The compression whose magic number ``head`` starts with, if any."""
    return next((kind for magic, kind in _COMPRESSIONS.items() if head.startswith(magic)), None)


@dataclass
class TarIndex:
    """The regular members of one tar shard: ``names``, and where each one's data starts and how long
    it is (``offsets``, ``sizes``), and the digest of the header just before its data (``headers``);
    ``lost_bytes``: bytes after the last complete member of a truncated or corrupt shard (0 for a
    whole one)."""

    names: np.ndarray  # bytes: UTF-8 names, a byte a character (a str array takes four)
    offsets: np.ndarray  # int64
    sizes: np.ndarray  # int64
    headers: np.ndarray  # int64: header_digest of the 512 bytes before each member's data
    lost_bytes: int = 0
    decompressed: bool = False  # indexed (and read) from a decompressed copy beside the index

    def samples(self) -> list[tuple[str, dict[str, int]]]:
        """``(key, {field: member number})`` of each sample, in shard order (webdataset's grouping:
        consecutive members sharing a key). A field repeated inside a sample keeps its first member."""
        out: list[tuple[str, dict[str, int]]] = []
        for number, name in enumerate(self.member_names()):
            parts = key_and_field(name)
            if parts is None:
                continue
            key, field = parts
            if not out or out[-1][0] != key:
                out.append((key, {}))
            out[-1][1].setdefault(field, number)
        return out

    def member_names(self) -> list[str]:
        return [name.decode("utf-8", errors="surrogateescape") for name in self.names.tolist()]

    def save(self, path: Path) -> None:
        """Written to a temporary name, then renamed: a reader sees the whole index or none."""
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with partial.open("wb") as f:
            np.savez(f, names=self.names, offsets=self.offsets, sizes=self.sizes, headers=self.headers,
                     lost=self.lost_bytes, decompressed=self.decompressed)  # fmt: skip
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> TarIndex:
        with np.load(path) as saved:
            columns = (saved[name] for name in ("names", "offsets", "sizes", "headers"))
            return cls(*columns, int(saved["lost"]), bool(saved["decompressed"]))


class _HeaderReads:
    """A file of ``size`` bytes read through ``read(start, end)``, for ``tarfile``: each miss fetches
    from the position on, ``_FIRST_READ`` bytes, doubling (up to ``_MOST_READ``) while misses land
    within half a read of the previous one's end, so densely packed small members are read in few
    requests and large ones cost one small request each."""

    def __init__(self, read: Callable[[int, int], bytes], size: int) -> None:
        self._read, self.size = read, size
        self._position = 0
        self._start, self._data = 0, b""
        self._length = _FIRST_READ
        self.requests = self.bytes_read = 0

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        self._position = position + (self._position if whence == os.SEEK_CUR else 0)
        if whence == os.SEEK_END:
            self._position = self.size + position
        return self._position

    def tell(self) -> int:
        return self._position

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self._position + n)
        if not self._start <= self._position <= end <= self._start + len(self._data):
            near = bool(self._data) and 0 <= self._position - (self._start + len(self._data)) < self._length // 2
            self._length = min(_MOST_READ, self._length * 2) if near else _FIRST_READ
            self._start = self._position
            stop = min(self.size, self._position + max(self._length, end - self._position))
            self._data = self._read(self._position, stop)
            self.requests += 1
            self.bytes_read += len(self._data)
        out = self._data[self._position - self._start : end - self._start]
        self._position += len(out)
        return out


def walk_headers(fileobj: object, size: int, name: str) -> TarIndex:
    """The index of the tar in ``fileobj`` (``size`` bytes), read header by header."""
    names, offsets, sizes, headers = [], [], [], []
    stopped_at = None
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:  # type: ignore[call-overload]
            for member in tar:
                if member.offset_data + member.size > size:  # its data runs past the end
                    stopped_at = member.offset
                    break
                if member.isreg() and not _META.match(member.name):
                    names.append(member.name.encode("utf-8", errors="surrogateescape"))
                    offsets.append(member.offset_data)
                    sizes.append(member.size)
                    # The member's own header is the block just read (after any long-name or pax
                    # blocks): in the read buffer still. tarfile seeks back to its next header itself.
                    fileobj.seek(member.offset_data - tarfile.BLOCKSIZE)  # type: ignore[attr-defined]
                    headers.append(header_digest(fileobj.read(tarfile.BLOCKSIZE)))  # type: ignore[attr-defined]
            else:
                stopped_at = tar.offset
    except tarfile.ReadError as err:
        if not names and stopped_at is None:
            raise ValueError(f"{name} is not a tar file ({err})") from None
        stopped_at = tar.offset if stopped_at is None else stopped_at
    lost = 0
    fileobj.seek(stopped_at)  # type: ignore[attr-defined]
    if fileobj.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):  # type: ignore[attr-defined]
        lost = size - stopped_at  # no end-of-archive block where the members stop: truncated or corrupt
    numbers = (np.array(column, dtype=np.int64) for column in (offsets, sizes, headers))
    return TarIndex(np.array(names, dtype=bytes), *numbers, lost)


@dataclass
class Shards:
    """Tar shards and their indexes, built or loaded by ``index_shards``."""

    locations: list[str]
    indexes: list[TarIndex]
    versions: list[tuple[int, str | None]]  # (size, ETag or mtime) each index was built for
    bytes_read: int = 0  # by the header walks of this call (0 when every index came from the cache)
    reader: RangeReader | None = None  # reads the remote shards, their versions recorded
    read_locations: list[str] = field(default_factory=list)  # where members are read: the shard or its copy


def index_shards(
    locations: list[str],
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    io_threads: int = 16,
    allow_compressed: bool = False,
) -> Shards:
    """The index of each shard: from ``cache_dir`` where it holds one for the shard's location, size
    and version, else by walking the shard's headers (``io_threads`` shards at once, with a progress
    bar) and kept there. All shards are local paths or all are URLs of one filesystem. A compressed
    shard is refused, or with ``allow_compressed`` decompressed once into ``cache_dir`` (read whole),
    its copy indexed and read in its place."""
    remote = [is_url(location) for location in locations]
    if any(remote) and not all(remote):
        raise ValueError(
            f"shards must be all local or all URLs; got {locations[remote.index(False)]!r} and "
            f"{locations[remote.index(True)]!r}"
        )
    reader = None
    if remote and remote[0]:
        reader = RangeReader(f"{urlparse(locations[0]).scheme}://", storage_options, io_threads)
        try:
            reader.expect(locations)
        except FileNotFoundError as err:
            raise ValueError(f"a tar shard does not exist: {err}") from None
        versions = [reader.expected[location] for location in locations]
    else:
        versions = [_local_version(location) for location in locations]
    folder = Path(cache_dir or default_index_cache())
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / _index_name(location, version) for location, version in zip(locations, versions, strict=True)]
    indexes: list[TarIndex | None] = [None] * len(locations)
    for i, path in enumerate(paths):
        try:
            index = TarIndex.load(path)
        except (OSError, ValueError, KeyError):
            continue
        if not index.decompressed or _copy_of(path).exists():
            indexes[i] = index
    todo = [i for i, index in enumerate(indexes) if index is None]
    read = 0
    if todo:
        from tqdm.auto import tqdm

        def build(i: int) -> tuple[int, TarIndex, int]:
            index, spent = _walk(locations[i], versions[i][0], reader, _copy_of(paths[i]) if allow_compressed else None)
            index.save(paths[i])
            return i, index, spent

        with (
            ThreadPoolExecutor(min(io_threads, len(todo))) as pool,
            tqdm(total=len(todo), desc="indexing tar shards", unit="shard", disable=len(todo) < 2) as bar,
        ):
            for i, index, spent in pool.map(build, todo):
                indexes[i], read = index, read + spent
                bar.update()
    for location, index in zip(locations, indexes, strict=True):
        if index is not None and index.lost_bytes:
            log.warning(
                "%s is truncated or corrupt: its last %d bytes hold no complete member (%d members used)",
                location, index.lost_bytes, len(index.names),
            )  # fmt: skip
    read_locations = [
        str(_copy_of(path)) if index.decompressed else location  # type: ignore[union-attr]
        for path, index, location in zip(paths, indexes, locations, strict=True)
    ]
    return Shards(list(locations), indexes, versions, read, reader, read_locations)  # type: ignore[arg-type]


def _local_version(location: str) -> tuple[int, str | None]:
    try:
        return local_version(os.stat(location))
    except OSError:
        raise ValueError(f"tar shard {location} does not exist") from None


def _index_name(location: str, version: tuple[int, str | None]) -> str:
    absolute = location if is_url(location) else os.path.abspath(location)
    key = hashlib.sha256(repr((INDEX_FORMAT, absolute, version)).encode()).hexdigest()[:32]
    return f"{Path(urlparse(location).path).stem}-{key}.npz"


def _copy_of(index_path: Path) -> Path:
    """Where a compressed shard's decompressed copy is kept: beside its index."""
    return index_path.with_suffix(".tar")


def _walk(location: str, size: int, reader: RangeReader | None, copy: Path | None) -> tuple[TarIndex, int]:
    """The shard's index, and the bytes read to build it; a compressed shard is refused, or (given
    where to ``copy`` it) decompressed there and its copy indexed."""
    if reader is None:
        fd = os.open(location, os.O_RDONLY)
        try:
            read: Callable[[int, int], bytes] = lambda start, end: os.pread(fd, end - start, start)  # noqa: E731
            kind = compression_of(read(0, 8))
            if kind is None:
                return _walk_through(read, location, size)
        finally:
            os.close(fd)
    else:
        read = lambda start, end: reader.read([location], [start], [end])[0]  # noqa: E731
        kind = compression_of(read(0, min(size, 8)))
        if kind is None:
            return _walk_through(read, location, size)
    tool, suffix = _DECOMPRESS[kind]
    if copy is None:
        raise ValueError(
            f"{location} is a {kind}-compressed tar: its members cannot be read by offset. Store the shards "
            f"uncompressed (e.g. `{tool} < shard.tar.{suffix} > shard.tar`; WebDataset's images and clips are "
            "compressed already, so the tar's compression saves little), or allow_compressed_tar=True to "
            "decompress each shard once into the index cache"
        )
    options = reader.storage_options if reader is not None else {}
    partial = copy.with_name(f".{copy.name}.{uuid.uuid4().hex}")
    with fsspec.open(location, "rb", compression=_FSSPEC_CODECS[kind], **options) as src, partial.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(partial, copy)
    index, _ = _walk(str(copy), copy.stat().st_size, None, None)
    index.decompressed = True
    return index, size


def _walk_through(read: Callable[[int, int], bytes], location: str, size: int) -> tuple[TarIndex, int]:
    reads = _HeaderReads(read, size)
    return walk_headers(reads, size, location), reads.bytes_read


_FSSPEC_CODECS = {"gzip": "gzip", "bzip2": "bz2", "xz": "xz", "zstd": "zstd"}
_DECOMPRESS = {
    "gzip": ("gzip -dc", "gz"),
    "bzip2": ("bzip2 -dc", "bz2"),
    "xz": ("xz -dc", "xz"),
    "zstd": ("zstd -dc", "zst"),
}


def shard_locations(shards: str | list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """The tar shards ``shards`` names, in order: brace patterns expanded as webdataset expands them
    (``s3://b/{00000..00099}.tar``), a glob (``data/*.tar``) and a folder (its ``.tar`` files) listed in
    sorted order; a list is each of its items in turn. An error names a pattern that matches nothing."""
    from braceexpand import braceexpand

    found: list[str] = []
    for item in [shards] if isinstance(shards, str) else list(shards):
        for location in braceexpand(str(item)):
            found += _matches(location, storage_options)
    if not found:
        raise ValueError(f"no tar shards in {shards!r}")
    repeated = sorted(location for location, count in Counter(found).items() if count > 1)
    if repeated:
        raise ValueError(f"tar shards named twice: {repeated[:3]}")
    return found


def _matches(location: str, storage_options: dict[str, Any] | None) -> list[str]:
    if not is_url(location):
        path = os.path.expanduser(location)
        if any(c in path for c in "*?["):
            matches = sorted(glob.glob(path, recursive=True))
        elif os.path.isdir(path):
            matches = sorted(glob.glob(os.path.join(path, "*.tar")))
        else:
            return [path]  # a missing file is named when its size is read
        if not matches:
            raise ValueError(f"tar shard pattern {location!r} matches no file")
        return matches
    globbed = any(c in location for c in "*?[")
    if not globbed and _TAR_NAME.search(location):  # a shard: no request (its size is read with the others')
        return [location]
    fs = process_filesystem(location, storage_options)
    protocol = urlparse(location).scheme
    if globbed:
        matches = sorted(fs.glob(location))
    elif fs.isdir(location):
        matches = sorted(name for name in fs.ls(location, detail=False) if str(name).endswith(".tar"))
    else:
        return [location]
    if not matches:
        raise ValueError(f"tar shard pattern {location!r} matches no object")
    return [name if is_url(name) else f"{protocol}://{name}" for name in map(str, matches)]
