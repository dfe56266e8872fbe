"""Where a source's files live: a local path, or a URL that fsspec reads (``s3://``, ``gs://``,
``hf://``, ``http(s)://``, ``file://``), with ``storage_options`` as ``datasets`` and pandas take them
(``{"endpoint_url": ..., "key": ..., "secret": ..., "anon": True}``).

A local path stays a ``pathlib.Path``: memory-mapped, as fast as before. A URL becomes a
``universal_pathlib`` path, so listing folders and reading small files (metadata, headers, indexes)
is the same code for both. Byte ranges of large remote files go through ``RangeReader``: adjacent
ranges of one file are merged into one request, requests run concurrently, and the filesystem
object is re-created in every process that reads (fsspec's async clients are not fork-safe).
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec
from fsspec.utils import merge_offset_ranges

log = logging.getLogger(__name__)

LOCAL_PROTOCOLS = ("", "file", "local")


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a remote filesystem (``file://`` and plain paths are local)."""
    text = os.fspath(location)
    return "://" in text and urlparse(text).scheme not in LOCAL_PROTOCOLS


def storage_path(location: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Path:
    """``location`` as a path object: ``pathlib.Path`` for local paths (``file://`` stripped), a
    ``UPath`` over the URL's fsspec filesystem otherwise."""
    if not is_url(location):
        if storage_options:
            raise ValueError(f"storage_options are for URLs (s3://, gs://, ...); {str(location)!r} is a local path")
        text = os.fspath(location)
        return Path(text[len("file://") :] if text.startswith("file://") else text)
    from upath import UPath

    try:
        return UPath(str(location), **(storage_options or {}))
    except (ImportError, ValueError) as err:
        scheme = urlparse(str(location)).scheme
        raise ValueError(f"cannot read {location!r}: {err}. Is the fsspec package for {scheme}:// installed?") from None


def read_range(path: Path, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a local or remote file (fewer past its end). For a URL, one ranged
    request: ``open()`` would read ahead a whole block (50 MB for s3fs) to serve a small read."""
    if start >= end:
        return b""
    fs = getattr(path, "fs", None)  # a UPath's filesystem; a pathlib.Path has none
    if fs is None:
        with path.open("rb") as f:
            f.seek(start)
            return f.read(end - start)
    return fs.cat_file(path.path, start=start, end=end)


class RangeReader:
    """Reads byte ranges of the files under one remote root; picklable, one filesystem per process.

    A range that fails (an error response, a reset connection, a short body) is requested again, up
    to ``attempts`` times in all, after an exponential backoff with jitter; then the read fails with
    one message naming the object. A missing object or a refused permission is not retried.
    """

    def __init__(
        self, root: str, storage_options: dict[str, Any] | None = None, attempts: int = 5, backoff: float = 0.2
    ) -> None:
        self.root = root
        self.storage_options = dict(storage_options or {})
        self.attempts = attempts
        self.backoff = backoff
        self.retries = 0  # ranges requested again in this process
        self._fs: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}

    @property
    def fs(self) -> Any:
        if self._pid != os.getpid():  # a new process (fork or spawn): its own client and event loop
            self._fs = fsspec.url_to_fs(self.root, skip_instance_cache=True, **self.storage_options)[0]
            self._pid = os.getpid()
        return self._fs

    def read(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """The bytes ``[start, end)`` of each path, in order. Ranges of one file that touch are one request."""
        merged_paths, merged_starts, merged_ends = merge_offset_ranges(
            list(paths), list(starts), list(ends), max_gap=0, sort=True
        )
        merged = list(zip(merged_paths, merged_starts, merged_ends, strict=True))
        blobs = self._fetch(merged)
        found: dict[str, list[tuple[int, int, bytes]]] = {}
        for (path, start, end), blob in zip(merged, blobs, strict=True):
            found.setdefault(path, []).append((start, end, blob))
        out = []
        for path, start, end in zip(paths, starts, ends, strict=True):
            lo, _, blob = next(piece for piece in found[path] if piece[0] <= start and end <= piece[1])
            out.append(blob[start - lo : end - lo])
        return out

    def _fetch(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        blobs: list[bytes | None] = [None] * len(ranges)
        pending = list(range(len(ranges)))
        for attempt in range(1, self.attempts + 1):
            asked = [ranges[i] for i in pending]
            got = self.fs.cat_ranges(
                [r[0] for r in asked], [r[1] for r in asked], [r[2] for r in asked], on_error="return"
            )
            failed = []
            for i, blob in zip(pending, got, strict=True):
                path, start, end = ranges[i]
                if isinstance(blob, FileNotFoundError | PermissionError):
                    raise type(blob)(f"cannot read {path}: {blob}") from None
                if isinstance(blob, BaseException) or len(blob) != end - start:
                    failed.append((i, blob))
                else:
                    blobs[i] = blob
            if not failed:
                return blobs  # type: ignore[return-value]
            i, blob = failed[0]
            path, start, end = ranges[i]
            what = repr(blob) if isinstance(blob, BaseException) else f"{len(blob)} of {end - start} bytes"
            if attempt == self.attempts:
                raise OSError(f"reading bytes {start}-{end} of {path} failed {self.attempts} times; last: {what}")
            self.retries += len(failed)
            log.warning(
                "retrying %d byte ranges (attempt %d of %d), e.g. %s: %s",
                len(failed),
                attempt + 1,
                self.attempts,
                path,
                what,
            )
            time.sleep(min(10.0, self.backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5))
            pending = [i for i, _ in failed]
        raise AssertionError("unreachable")
