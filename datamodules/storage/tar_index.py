"""Sample indexes of tar shards (the WebDataset format): where each sample's bytes lie, so a sample
is one ranged read instead of a pass through the whole shard.

A shard is indexed by walking its 512-byte headers (``TarWalk``), seeking over the members' data: a
local shard is read in place; a remote one through ranged reads of the headers only (``RangeReader``'s
retries), whose size grows while the headers lie close together (a shard of small members then costs
a few large requests, one of large members a small request per member). Each shard's index is kept
in a node-local folder, one file per shard named by the shard's location, size and version (ETag, or
mtime for a local file): a shard that changed is indexed again. The indexes of a set of shards are
then assembled into one table there (``sample_table``), which every process maps. Each sample keeps
a digest of its members' 512-byte headers, so a reader can check, on every read, that the headers it
finds are still the ones indexed.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec
import numpy as np

from datamodules.plan.parallelism import Job, pack_arrays, unpack_arrays
from datamodules.storage.locations import default_cache_dir, is_url, process_filesystem
from datamodules.storage.range_reader import RangeReader, local_version
from datamodules.storage.sample_table import IndexedShards, TarIndex, assemble_table, decompressed_copy, table_name
from datamodules.storage.tar_members import TarWalk, headers_digest, is_tar_end, samples_of

log = logging.getLogger(__name__)

INDEX_FORMAT = 3  # 2: the members' header digests; 3: a row a sample, assembled into a node table
_TAR_NAME = re.compile(r"\.(tar|tgz)(\.\w+)?$")  # a shard's name, compressed or not (no glob in it)
_COMPRESSIONS = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_FIRST_READ, _MOST_READ = 8 << 10, 1 << 20


def default_index_cache() -> str:
    """``$XDG_CACHE_HOME/datamodules/tar_index`` (``~/.cache`` when unset)."""
    return default_cache_dir("tar_index")


def compression_of(head: bytes) -> str | None:
    """The compression whose magic number ``head`` starts with, if any."""
    return next((kind for magic, kind in _COMPRESSIONS.items() if head.startswith(magic)), None)


class _HeaderReads:
    """A file of ``size`` bytes read through ``read(start, end)``, for ``TarWalk``: each miss fetches
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


def index_tar(fileobj: object, size: int, name: str) -> TarIndex:
    """The index of the tar in ``fileobj`` (``size`` bytes), read header by header."""
    walk = TarWalk(fileobj, size, name)
    starts, digests, keys, end, members = [], [], [], 0, 0
    fingerprint = hashlib.sha256()
    for key, sample in samples_of(walk):
        starts.append(sample[0].offset)
        digests.append(headers_digest(sample))
        keys.append(key.encode("utf-8", errors="surrogateescape"))
        end, members = sample[-1].data + sample[-1].size, members + len(sample)
        for member in sample:
            fingerprint.update(f"{member.name}\0{member.data}\0{member.size}\n".encode(errors="surrogateescape"))
    return TarIndex(
        starts=np.array(starts, dtype=np.int64),
        digests=np.array(digests, dtype=np.int64),
        keys=np.frombuffer(b"".join(keys), dtype=np.uint8),
        key_ends=np.cumsum([len(key) for key in keys], dtype=np.int64),
        end=end,
        members=members,
        fingerprint=fingerprint.hexdigest()[:32],
        lost_bytes=0 if is_tar_end(fileobj, walk.stopped_at) else size - walk.stopped_at,
    )


def described_shards(
    shards: str | list[str], storage_options: dict[str, Any] | None = None, io_threads: int = 16, job: Job | None = None
) -> tuple[list[str], list[tuple[int, str | None]]]:
    """The tar shards ``shards`` names (``shard_locations``) and each one's (size, ETag or mtime): listed
    and looked up by the job's rank 0 alone, sent to every rank as compact arrays, so a job's requests
    for them do not grow with its ranks."""

    def describe() -> dict[str, np.ndarray]:
        locations = shard_locations(shards, storage_options)
        _, versions = reader_and_versions(locations, storage_options, io_threads)
        return {
            "locations": np.array([location.encode("utf-8", "surrogateescape") for location in locations]),
            "sizes": np.array([size for size, _ in versions], dtype=np.int64),
            "tags": np.array([(tag or "").encode("utf-8", "surrogateescape") for _, tag in versions]),
            "tagged": np.array([tag is not None for _, tag in versions]),
        }

    found = (job or Job()).arrays_from_rank_zero(describe)
    decode = lambda values: [value.decode("utf-8", "surrogateescape") for value in values.tolist()]  # noqa: E731
    tags = [
        tag if tagged else None for tag, tagged in zip(decode(found["tags"]), found["tagged"].tolist(), strict=True)
    ]
    return decode(found["locations"]), list(zip(found["sizes"].tolist(), tags, strict=True))


def index_shards(
    locations: list[str],
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    io_threads: int = 16,
    allow_compressed: bool = False,
    versions: list[tuple[int, str | None]] | None = None,
    job: Job | None = None,
) -> IndexedShards:
    """The shards' samples, as a node table in ``cache_dir`` (``assemble_table``): kept there for the
    shards' locations, sizes and versions (``versions`` where known, else looked up), else assembled
    from each shard's index file, itself kept there or built (``build_shard_indexes``). All shards are
    local paths or all are URLs of one filesystem. A compressed shard is refused, or with
    ``allow_compressed`` decompressed once into ``cache_dir`` (read whole), its copy indexed and read in
    its place. A truncated shard is logged.

    In a ``job`` of several processes (a collective: every rank calls it), the indexes that some node
    lacks are built once for the job, dealt among all its ranks (each shard by one rank), and sent
    to the other nodes; rank 0 of each node then assembles its table and every rank maps it."""
    job = job or Job()
    reader, versions = reader_and_versions(locations, storage_options, io_threads, versions)
    folder = Path(cache_dir or default_index_cache())
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / table_name(locations, versions, INDEX_FORMAT)
    kept = _kept_table(table)
    needed = kept is None or _copy_removed(kept)
    paths = [index_file(folder, location, version) for location, version in zip(locations, versions, strict=True)]
    todo = _missing_in_job([needed and not kept_index(path) for path in paths], job)
    mine = todo[job.rank :: job.size]
    _, read = job.everywhere(  # a shard refused on one rank stops every rank, none left at the barrier
        lambda: build_shard_indexes(
            [locations[i] for i in mine], [versions[i] for i in mine], folder, reader, io_threads, allow_compressed
        )
    )
    if todo:
        log.info("indexed %d of the %d tar shards the job lacked here (rank %d of %d)", len(mine), len(todo),
                 job.rank, job.size)  # fmt: skip
    if todo and job.nodes > 1:
        _send_to_every_node(paths, mine, job)

    def node_table() -> int:
        """Rank 0 of each node assembles its table (the others wait in ``everywhere``'s gather)."""
        spent = 0
        if needed and job.local_rank == 0:
            if job.nodes > 1:  # a compressed shard indexed on another node: this node decompresses its copy
                spent = build_shard_indexes(locations, versions, folder, reader, io_threads, allow_compressed)[1]
            if kept is None:
                assemble_table(table, locations, versions, paths)
        return spent

    shards = IndexedShards(table, reader, read + job.everywhere(node_table))
    for location, lost, members in zip(shards.locations, shards.lost_bytes, shards.members, strict=True):
        if lost:
            log.warning(
                "%s is truncated or corrupt: its last %d bytes hold no complete member (%d members used)",
                location, lost, members,
            )  # fmt: skip
    return shards


def _missing_in_job(missing: list[bool], job: Job) -> list[int]:
    """The shards whose index any node of the job lacks (each rank says what its node lacks)."""
    masks = job.all_gather(np.packbits(np.array(missing, dtype=bool)).tobytes())
    union = np.bitwise_or.reduce([np.frombuffer(mask, dtype=np.uint8) for mask in masks])
    return np.flatnonzero(np.unpackbits(union, count=len(missing))).tolist()


def _send_to_every_node(paths: list[Path], mine: list[int], job: Job) -> None:
    """Every rank's newly built index files, gathered by all; rank 0 of each node keeps those its node
    lacks (a node-local cache does not see what another node wrote)."""
    built = {str(i): np.frombuffer(paths[i].read_bytes(), dtype=np.uint8) for i in mine}
    for blob in job.all_gather(pack_arrays(built)):
        for name, data in unpack_arrays(blob).items():
            path = paths[int(name)]
            if job.local_rank == 0 and not path.exists():
                partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
                partial.write_bytes(data.tobytes())
                os.replace(partial, path)


def build_shard_indexes(
    locations: list[str],
    versions: list[tuple[int, str | None]],
    folder: Path,
    reader: RangeReader | None = None,
    io_threads: int = 16,
    allow_compressed: bool = False,
) -> tuple[list[Path], int]:
    """The index file in ``folder`` of each shard (of ``versions``; a remote one read through
    ``reader``), and the bytes read to build them: an index kept there is used, others are built by
    walking the shards' headers, ``io_threads`` shards at once with a progress bar. Each index is
    written as soon as it is built: a build stopped half way keeps what it finished."""
    paths = [index_file(folder, location, version) for location, version in zip(locations, versions, strict=True)]
    todo = [i for i, path in enumerate(paths) if not kept_index(path)]
    read = 0
    if todo:
        from tqdm.auto import tqdm

        def build(i: int) -> int:
            copy = decompressed_copy(paths[i]) if allow_compressed else None
            index, spent = _walk(locations[i], versions[i][0], reader, copy)
            index.save(paths[i])
            return spent

        with (
            ThreadPoolExecutor(min(io_threads, len(todo))) as pool,
            tqdm(total=len(todo), desc="indexing tar shards", unit="shard", disable=len(todo) < 2) as bar,
        ):
            for spent in pool.map(build, todo):
                read += spent
                bar.update()
    return paths, read


def reader_and_versions(
    locations: list[str],
    storage_options: dict[str, Any] | None,
    io_threads: int,
    versions: list[tuple[int, str | None]] | None = None,
) -> tuple[RangeReader | None, list[tuple[int, str | None]]]:
    """The reader of remote shards (none for local ones) and each shard's (size, ETag or mtime):
    ``versions`` where given (the reader records them, no request), else looked up."""
    remote = [is_url(location) for location in locations]
    if any(remote) and not all(remote):
        raise ValueError(
            f"shards must be all local or all URLs; got {locations[remote.index(False)]!r} and "
            f"{locations[remote.index(True)]!r}"
        )
    if not remote or not remote[0]:
        return None, versions or [_local_version(location) for location in locations]
    reader = RangeReader(f"{urlparse(locations[0]).scheme}://", storage_options, io_threads)
    try:
        reader.expect(locations, versions)
    except FileNotFoundError as err:
        raise ValueError(f"a tar shard does not exist: {err}") from None
    return reader, [reader.expected[location] for location in locations]


def _kept_table(table: Path) -> IndexedShards | None:
    try:
        return IndexedShards(table)
    except (OSError, ValueError, KeyError):
        return None


def _copy_removed(shards: IndexedShards) -> bool:
    """Whether a compressed shard's decompressed copy was removed since its table was assembled."""
    copies = [read for read, location in zip(shards.read_locations, shards.locations, strict=True) if read != location]
    return not all(map(os.path.exists, copies))


def kept_index(path: Path) -> bool:
    """Whether ``path`` holds a whole index (and its decompressed copy, for a compressed shard)."""
    try:
        about = TarIndex.about(path)
    except (OSError, ValueError, KeyError):
        return False
    return not about["decompressed"] or decompressed_copy(path).exists()


def _local_version(location: str) -> tuple[int, str | None]:
    try:
        return local_version(os.stat(location))
    except OSError:
        raise ValueError(f"tar shard {location} does not exist") from None


def index_file(folder: Path, location: str, version: tuple[int, str | None]) -> Path:
    """Where ``folder`` keeps the index of the shard at ``location`` of ``version``."""
    absolute = location if is_url(location) else os.path.abspath(location)
    key = hashlib.sha256(repr((INDEX_FORMAT, absolute, version)).encode()).hexdigest()[:32]
    return folder / f"{Path(urlparse(location).path).stem}-{key}.npz"


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
    return index_tar(reads, size, location), reads.bytes_read


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
