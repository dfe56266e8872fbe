"""Whole files (images, video clips, hidden-state files) named by local path or by URL, read through
the storage layer, with an optional node-local cache under a byte budget.

A URL is read with the same retries as token-shard ranges (``storage.RangeReader``). With
``cache_dir``, a remote file is kept there after its first read: written to a temporary name and
renamed, so a file appears complete or not at all, and the least recently used files are deleted
when the budget would be passed. The processes of a node may share one ``cache_dir``: room is made
under a file lock, and a file deleted while another process reads it stays readable to that reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from datamodules.storage.locations import describe_error, is_url, storage_path
from datamodules.storage.range_reader import RangeReader, read_range

log = logging.getLogger(__name__)

_PARTIAL = ".partial-"  # a download still being written (or left by a killed process)
_LOCK, _TOTAL = ".lock", ".total"  # the lock file, and the bytes the cache holds (kept under the lock)
_STALE_PARTIAL_S = 3600.0


@dataclass
class RemoteFiles:
    """Reads whole files by local path or URL (``s3://``, ``gs://``, ``hf://``, ``http(s)://``).

    Args:
        storage_options: the fsspec filesystem's options for URLs (endpoint, credentials, ``anon``).
        cache_dir: a node-local folder that keeps remote files after their first read; ``None``:
            remote files are read into memory each time.
        cache_bytes: the most bytes ``cache_dir`` holds; least recently used files go first.
    """

    storage_options: dict[str, Any] | None = None
    cache_dir: str | None = None
    cache_bytes: int | None = None
    _readers: dict[str, RangeReader] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cache_dir is not None and (
            isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int) or self.cache_bytes < 1
        ):
            raise ValueError(f"a file cache needs cache_bytes, a positive number of bytes; got {self.cache_bytes!r}")
        if self.cache_dir is not None and is_url(self.cache_dir):
            raise ValueError(f"cache_dir must be a local folder, got {self.cache_dir!r}")

    def read_bytes(self, location: str | os.PathLike) -> bytes:
        """The whole file at ``location``."""
        with self.open(location) as f:
            return f.read()

    def open(self, location: str | os.PathLike) -> BinaryIO:
        """The file at ``location`` opened for reading: the local file, the cached copy of a remote
        one (fetched into the cache first), or, without a cache, its bytes in memory."""
        if not is_url(location):
            return storage_path(location).open("rb")
        url = str(location)
        if self.cache_dir is None:
            return io.BytesIO(self._fetch(url))
        path = Path(self.cache_dir) / (hashlib.sha256(url.encode()).hexdigest()[:32] + Path(urlparse(url).path).suffix)
        try:
            f = path.open("rb")
        except FileNotFoundError:
            pass
        else:
            with contextlib.suppress(FileNotFoundError):  # evicted since: the open file still reads
                os.utime(path)  # recently used: evicted last
            return f
        data = self._fetch(url)
        self._keep(path, data)
        return io.BytesIO(data)

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

    def _fetch(self, url: str) -> bytes:
        reader = self._reader(url)
        try:
            size = reader.request(f"reading the size of {url}", lambda fs: fs.size(url))
            return reader.read([url], [0], [size])[0] if size else b""
        except FileNotFoundError:
            raise FileNotFoundError(f"{url} does not exist") from None
        except OSError:
            raise
        except Exception as err:  # the store's own (no credentials, ...): one line naming the object
            raise OSError(f"cannot read {url}: {describe_error(err)}") from None

    def _keep(self, path: Path, data: bytes) -> None:
        """Put ``data`` in the cache as ``path``, making room first; a file over the budget is not kept."""
        assert self.cache_bytes is not None
        if len(data) > self.cache_bytes:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.parent / f"{_PARTIAL}{uuid.uuid4().hex}"
        partial.write_bytes(data)
        with _locked(path.parent):
            total = _read_total(path.parent)
            if path.exists():  # another process kept it meanwhile
                partial.unlink()
                return
            if total + len(data) > self.cache_bytes:  # down to 90%, so the next files need no scan
                total = _evict(path.parent, min(self.cache_bytes - len(data), self.cache_bytes * 9 // 10))
            os.replace(partial, path)  # complete or absent, never torn
            (path.parent / _TOTAL).write_text(str(total + len(data)))


LOCAL_FILES = RemoteFiles()  # local paths, and URLs a filesystem reads without options, uncached


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / _LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_total(directory: Path) -> int:
    try:
        return int((directory / _TOTAL).read_text())
    except (FileNotFoundError, ValueError):
        return _evict(directory, None)  # not recorded yet: counted


def _evict(directory: Path, keep_at_most: int | None) -> int:
    """Delete the least recently used files until at most ``keep_at_most`` bytes stay (``None``: only
    count); partial files older than an hour (left by killed processes) go too. The bytes kept."""
    files, now = [], time.time()
    for entry in os.scandir(directory):
        if entry.name in (_LOCK, _TOTAL) or not entry.is_file():
            continue
        stat = entry.stat()
        if entry.name.startswith(_PARTIAL):
            if now - stat.st_mtime > _STALE_PARTIAL_S:
                os.unlink(entry.path)
            continue
        files.append((stat.st_mtime, stat.st_size, entry.path))
    total = sum(size for _, size, _ in files)
    if keep_at_most is not None:
        evicted = 0
        for _, size, name in sorted(files):
            if total <= keep_at_most:
                break
            os.unlink(name)
            total -= size
            evicted += 1
        log.debug("file cache %s: evicted %d files, %d bytes kept", directory, evicted, total)
    return total
