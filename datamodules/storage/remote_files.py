"""Whole files (images, video clips, hidden-state files) named by local path or by URL, read through
the storage layer, with an optional node-local cache under a byte budget (``FileCache``).

A URL is read with the same retries as token-shard ranges (``storage.RangeReader``). With
``cache_dir``, a remote file is kept there after its first read, named by its URL and its version
(ETag, generation or modification time: one HEAD a read), so a changed object is fetched again. The
processes of a node share one ``cache_dir``. Which files leave when the budget is reached:

- ``cache_policy="planned"`` (default): a source that knows its order (image-text rows naming files
  by URL) gives the cache ``PlannedUses``, the position at which the node next reads each file, and
  ``reading_at`` the position being read: the file needed furthest ahead leaves first, and a file
  needed later than everything that would leave for it is not kept (Belady's rule). Reads outside
  the plan (validation) are kept only while there is room.
- ``cache_policy="lru"``: the least recently used file leaves first.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlparse

from datamodules.storage.file_cache import NEVER, FileCache
from datamodules.storage.locations import describe_error, is_url, object_version, storage_path
from datamodules.storage.range_reader import RangeReader, read_range

POLICIES = ("planned", "lru")


class NextUses(Protocol):
    """When the node next reads a file after a plan position (``NEVER``: not within what is known)."""

    def next_use(self, key: int, position: int) -> float: ...


def url_key(url: str) -> int:
    """The 64-bit key a file's URL has in a plan's uses (``PlannedUses``) and in the cache's names."""
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little")


def range_key(url: str, start: int, end: int) -> int:
    """The key of bytes ``[start, end)`` of the object ``url``, as ``url_key`` is a whole file's."""
    return url_key(f"{url}#{start}-{end}")


@dataclass
class RemoteFiles:
    """Reads whole files by local path or URL (``s3://``, ``gs://``, ``hf://``, ``http(s)://``).

    Args:
        storage_options: the fsspec filesystem's options for URLs (endpoint, credentials, ``anon``).
        cache_dir: a node-local folder that keeps remote files after their first read, shared by the
            node's processes; ``None``: remote files are read into memory each time.
        cache_bytes: the most bytes ``cache_dir`` holds.
        cache_policy: which files leave when ``cache_bytes`` is reached: ``"planned"``, the file the
            plan needs furthest ahead (a file needed later than all of those is not kept), or
            ``"lru"``, the least recently used.
    """

    storage_options: dict[str, Any] | None = None
    cache_dir: str | None = None
    cache_bytes: int | None = None
    cache_policy: str = "planned"
    _readers: dict[str, RangeReader] = field(default_factory=dict, init=False, repr=False, compare=False)
    _cache: FileCache | None = field(default=None, init=False, repr=False, compare=False)
    _clock: threading.local = field(default_factory=threading.local, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cache_dir is not None and (
            isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int) or self.cache_bytes < 1
        ):
            raise ValueError(f"a file cache needs cache_bytes, a positive number of bytes; got {self.cache_bytes!r}")
        if self.cache_dir is not None and is_url(self.cache_dir):
            raise ValueError(f"cache_dir must be a local folder, got {self.cache_dir!r}")
        if self.cache_policy not in POLICIES:
            raise ValueError(f"cache_policy must be one of {POLICIES}, got {self.cache_policy!r}")
        if self.cache_dir is not None:
            self._cache = FileCache(self.cache_dir, self.cache_bytes)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_clock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _clock=threading.local())

    @property
    def plans_ahead(self) -> bool:
        """Whether reads go through a cache that evicts by the plan's next use."""
        return self._cache is not None and self.cache_policy == "planned"

    def summary(self) -> str | None:
        """One line on the cache (for the data summary); ``None`` without one."""
        if self._cache is None:
            return None
        rule = "the file the plan reads furthest ahead" if self.plans_ahead else "the least recently used file"
        return f"file cache {self.cache_dir}: {self.cache_bytes:,} bytes shared by the node; full, {rule} leaves"

    @property
    def stats(self) -> Any:
        """The cache's counts in this process (``CacheStats``); ``None`` without a cache."""
        return None if self._cache is None else self._cache.stats

    @contextlib.contextmanager
    def reading_at(self, uses: NextUses | None, position: int) -> Iterator[None]:
        """Reads in this block (this thread's) are for the sample at ``position`` of the plan whose
        next uses of the files are ``uses`` (``None``: reads outside a known order)."""
        self._clock.at = (uses, position)
        try:
            yield
        finally:
            self._clock.at = None

    def read_bytes(self, location: str | os.PathLike) -> bytes:
        """The whole file at ``location``."""
        if not is_url(location):
            return storage_path(location).read_bytes()
        url = str(location)
        if self._cache is None:
            return self._fetch(url, self._info(url)["size"])
        info = self._info(url)
        size, tag = object_version(info)
        key = url_key(url)
        version = hashlib.blake2b(f"{size}:{tag}".encode(), digest_size=8).hexdigest()
        name = f"{key:016x}-{version}{Path(urlparse(url).path).suffix}"
        rank, planned = self._rank(key)
        return self._cache.read(name, lambda: self._fetch(url, size), rank, planned)

    def _rank(self, key: int, at: tuple[NextUses | None, int] | None = None) -> tuple[float, bool]:
        """An item's place in the eviction order after this read, and whether it is a planned one;
        ``at``: the plan's uses and the position read (default: this thread's, ``reading_at``)."""
        if self.cache_policy == "lru":
            return -time.time(), False
        uses, position = at or getattr(self._clock, "at", None) or (None, 0)
        return (NEVER if uses is None else uses.next_use(key, position)), True

    def read_ranges(
        self,
        reader: RangeReader,
        paths: list[str],
        starts: list[int],
        ends: list[int],
        uses: NextUses | None = None,
        positions: list[int] | None = None,
    ) -> list[bytes]:
        """Ranges ``[start, end)`` of objects whose versions ``reader`` recorded (``RangeReader.expect``),
        through the cache: each range an item named by its object, version and bounds (``range_key``),
        the misses fetched together by ``reader`` (merged and concurrent as it reads), one fetch per
        node. ``uses`` and ``positions``: the plan's next uses of the ranges and where each is read."""
        if self._cache is None:
            return reader.read(paths, starts, ends)
        names, ranks = [], []
        for i, (path, start, end) in enumerate(zip(paths, starts, ends, strict=True)):
            key = range_key(path, start, end)
            version = hashlib.blake2b(repr(reader.expected.get(path)).encode(), digest_size=8).hexdigest()
            names.append(f"{key:016x}-{version}")
            ranks.append(self._rank(key, None if positions is None else (uses, positions[i])))
        out = [self._cache.lookup(name, rank) for name, (rank, _) in zip(names, ranks, strict=True)]
        missing = [i for i, data in enumerate(out) if data is None]
        if missing:
            with self._cache.fetching([names[i] for i in missing]):
                for i in missing:  # fetched by another process while this one waited
                    out[i] = self._cache.lookup(names[i], ranks[i][0])
                missing = [i for i in missing if out[i] is None]
                ranges = ([column[i] for i in missing] for column in (paths, starts, ends))
                fetched = reader.read(*ranges) if missing else []
                for i, data in zip(missing, fetched, strict=True):
                    out[i] = data
                    self._cache.keep(names[i], data, *ranks[i])
        return out

    def open(self, location: str | os.PathLike) -> BinaryIO:
        """The file at ``location`` opened for reading: the local file, or a remote one's bytes."""
        if not is_url(location):
            return storage_path(location).open("rb")
        return io.BytesIO(self.read_bytes(location))

    def read_range(self, location: str | os.PathLike, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the file at ``location`` (one ranged request for a URL, retried)."""
        if not is_url(location):
            return read_range(storage_path(location), start, end)
        return self._reader(str(location)).read([str(location)], [start], [end])[0]  # a missing one: FileNotFoundError

    def list_names(self, folder: str | os.PathLike) -> list[str]:
        """The names in ``folder`` (one listing; none if it does not exist)."""
        try:
            if not is_url(folder):
                return os.listdir(folder)
            names = self._reader(str(folder)).request(f"listing {folder}", lambda fs: fs.ls(str(folder), detail=False))
            return [str(name) for name in names]
        except FileNotFoundError:
            return []

    def write_bytes(self, url: str, data: bytes) -> None:
        """Store ``data`` as the object ``url`` (one PUT: readers see the old object or the new one)."""
        self._reader(url).request(f"writing {url}", lambda fs: fs.pipe_file(url, data))

    def delete(self, url: str) -> None:
        """Delete the object ``url``, if there is one."""
        with contextlib.suppress(FileNotFoundError):
            self._reader(url).request(f"deleting {url}", lambda fs: fs.rm_file(url))

    def _reader(self, url: str) -> RangeReader:
        protocol = urlparse(url).scheme
        reader = self._readers.get(protocol)
        if reader is None:
            reader = self._readers[protocol] = RangeReader(f"{protocol}://", self.storage_options)
        return reader

    def _info(self, url: str) -> dict[str, Any]:
        """The object's size and version, asked of the store (one HEAD, never a listing's old copy)."""

        def head(fs: Any) -> dict[str, Any]:
            fs.invalidate_cache(url)
            return fs.info(url)

        return self._named(url, lambda: self._reader(url).request(f"reading the size of {url}", head))

    def _fetch(self, url: str, size: int) -> bytes:
        return self._named(url, lambda: self._reader(url).read([url], [0], [size])[0] if size else b"")

    @staticmethod
    def _named(url: str, call: Any) -> Any:
        try:
            return call()
        except FileNotFoundError:
            raise FileNotFoundError(f"{url} does not exist") from None
        except OSError:
            raise
        except Exception as err:  # the store's own (no credentials, ...): one line naming the object
            raise OSError(f"cannot read {url}: {describe_error(err)}") from None


LOCAL_FILES = RemoteFiles()  # local paths, and URLs a filesystem reads without options, uncached
