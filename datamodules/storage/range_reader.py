"""Byte ranges of local and remote files. Remote ones go through ``RangeReader``: adjacent ranges of
one file are merged into one request, requests run concurrently and are retried within one budget,
and objects are checked for changes during a run: on S3, every ranged GET of an object whose ETag
was recorded carries it (``If-Match``), so a replaced object answers 412 instead of other bytes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import fsspec
import fsspec.asyn
from fsspec.utils import merge_offset_ranges

from datamodules.storage.locations import describe_error, object_version, process_filesystem

log = logging.getLogger(__name__)

T = TypeVar("T")
LIST_AT_LEAST = 16  # objects of one folder whose sizes and ETags are read by listing it, not by HEADs
# Requests in flight for what setup reads on one rank of the job (headers and ends of 10,000 shards:
# a few seconds at 64 against 50 ms of latency, half a minute at 16).
SETUP_IO_THREADS = 64


class ChangedDuringRun(OSError):
    """A file read by offset changed after the run recorded its version: reading on would mix two
    versions of the data. Not a bad sample (no policy skips it): the run stops."""


def changed_message(path: str, detail: str) -> str:
    return (
        f"{path} changed during the run: {detail}. Its data is read by offset, so reading on would mix "
        "two versions of it; start again from the new version."
    )


def _versions_differ(path: str, tag_name: str, was: tuple[int, str | None], now: tuple[int, str | None]) -> str:
    (size, tag), (new_size, new_tag) = was, now
    detail = f"{size} bytes, {tag_name} {tag} when the run started; now {new_size} bytes, {tag_name} {new_tag}"
    return changed_message(path, detail)


def local_version(stat: os.stat_result) -> tuple[int, str]:
    """A local file's version, as a bucket's is ``(size, ETag)``: its size and modification time (ns)."""
    return stat.st_size, str(stat.st_mtime_ns)


def check_unchanged(path: str, recorded: tuple[int, str | None], stat: os.stat_result) -> None:
    """Refuse (``ChangedDuringRun``) the local file ``path`` whose ``stat`` is no longer ``recorded``."""
    found = local_version(stat)
    if found != recorded:
        raise ChangedDuringRun(_versions_differ(path, "mtime_ns", recorded, found))


def read_unchanged(path: str, start: int, end: int, version: tuple[int, str | None]) -> bytes:
    """Bytes ``[start, end)`` of the local file ``path``, refused when its ``local_version`` is no longer
    ``version``: one ``fstat`` beside the read, taken after it, so a write before or during the read is seen."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, end - start, start)
        check_unchanged(path, version, os.fstat(fd))
    finally:
        os.close(fd)
    return data


def folder_versions(directory: Path, reader: RangeReader | None = None) -> dict[str, tuple[int, str | None]]:
    """The version of every file under ``directory``, at any depth, by its ``/``-separated path relative
    to it. A bucket's folder (``reader``: its root's reader) is one listing, a request per 1,000 objects on
    S3, their sizes and ETags with it; a local folder is walked, a ``stat`` per file (``local_version``)."""
    if reader is None:
        found = {}
        for folder, _, names in os.walk(directory, followlinks=True):
            for name in names:
                path = os.path.join(folder, name)
                found[os.path.relpath(path, directory).replace(os.sep, "/")] = local_version(os.stat(path))
        return found

    def listing(fs: Any) -> dict[str, tuple[int, str | None]]:
        root = fs._strip_protocol(str(directory)).rstrip("/") + "/"
        found = {}
        for name, info in fs.find(root, detail=True).items():
            relative = name.removeprefix(root)
            if name.startswith(root) and relative and not relative.endswith("/"):  # not a folder marker
                found[relative] = object_version(info)
        return found

    return reader.request(f"listing {directory}", listing)


def read_ranges(paths: list[Path], starts: list[int], ends: list[int]) -> list[bytes]:
    """``read_range`` of many files at once: for URLs, one round of concurrent requests per filesystem,
    ``SETUP_IO_THREADS`` in flight (setup reads a header or two per shard, on one rank of the job:
    thousands of them must not wait one round trip each), retried as ``RangeReader`` retries; a remote
    range must lie within its file."""
    out: list[bytes] = [b""] * len(paths)
    remote: dict[int, list[int]] = {}  # filesystem object id -> indices read through it
    for i, path in enumerate(paths):
        fs = getattr(path, "fs", None)
        if fs is None:
            out[i] = read_range(path, starts[i], ends[i])
        elif starts[i] < ends[i]:
            remote.setdefault(id(fs), []).append(i)
    for indices in remote.values():
        # Through a RangeReader: the same retry budget as training's reads, and a failure names the object.
        first = paths[indices[0]]
        scheme, options = urlparse(str(first)).scheme, getattr(first, "storage_options", None)
        reader = RangeReader(f"{scheme}://", options, SETUP_IO_THREADS)
        blobs = reader.read([str(paths[i]) for i in indices], [starts[i] for i in indices], [ends[i] for i in indices])
        for i, blob in zip(indices, blobs, strict=True):
            out[i] = blob
    return out


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

    At most ``io_threads`` requests are in flight at once. A range that fails (an error response, a
    reset connection, a short body) is requested again, up to ``attempts`` times in all, after an
    exponential backoff with jitter; then the read fails with one message naming the object. A
    missing object or a refused permission is not retried. Other requests (a HEAD, a listing, a PUT)
    go through ``request``, with the same budget.

    Objects given to ``expect`` are checked against the size and ETag recorded then: on S3 by every
    ranged GET (``If-Match``: a changed object answers 412, free of any extra request); on every
    store, whenever a read of one comes ``verify_every`` seconds or more after its last check (in this
    process, or before it, in the process that recorded it): one HEAD per due object, all at once. An
    object that changed is refused (``ChangedDuringRun``): its windows would mix two versions.
    """

    verify_every = 600.0

    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any] | None = None,
        io_threads: int = 16,
        attempts: int = 5,
        backoff: float = 0.2,
    ) -> None:
        self.root = root
        self.storage_options = _pool_for(root, dict(storage_options or {}), io_threads)
        self.io_threads = io_threads
        self.attempts = attempts
        self.backoff = backoff
        self.retries = 0  # ranges requested again in this process
        self.expected: dict[str, tuple[int, str | None]] = {}  # path -> (size, ETag) recorded at setup
        self._checked: dict[str, float] = {}  # path -> when it was last checked (time.monotonic)

    @property
    def fs(self) -> Any:
        """This process's filesystem (a new one after a fork or spawn), its own retry loop off (s3fs
        retries some errors itself): each range is requested at most ``attempts`` times in all."""
        fs = process_filesystem(self.root, self.storage_options)
        if hasattr(fs, "retries"):
            fs.retries = 1
        return fs

    def expect(self, paths: list[str], versions: list[tuple[int, str | None]] | None = None) -> None:
        """Record the size and ETag of ``paths``: ``versions`` where given (from a listing, or sent by the
        rank that listed them: no request), else asked for now. Reads refuse them if either changes."""
        found = self._versions(paths) if versions is None else versions
        self.expected.update(zip(paths, found, strict=True))
        self._checked.update(dict.fromkeys(paths, time.monotonic()))

    def _versions(self, paths: list[str]) -> list[tuple[int, str | None]]:
        """Size and ETag of each path: from a listing of its folder where ``LIST_AT_LEAST`` or more of
        the paths share it (one request per 1,000 objects on S3), else from one HEAD each, concurrent."""
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        return self.request(f"reading the size and ETag of {paths[0]}{more}", lambda fs: self._look_up(fs, paths))

    def _look_up(self, fs: Any, paths: list[str]) -> list[tuple[int, str | None]]:
        keys = [fs._strip_protocol(path) for path in paths]
        by_folder: dict[str, int] = {}
        for key in keys:
            by_folder[fs._parent(key)] = by_folder.get(fs._parent(key), 0) + 1
        infos: dict[str, dict[str, Any]] = {}
        for folder, count in by_folder.items():
            if count >= LIST_AT_LEAST:
                infos.update(
                    (fs._strip_protocol(info["name"]), info) for info in fs.ls(folder, detail=True, refresh=True)
                )
        rest = [key for key in keys if key not in infos]
        for key in rest:  # a HEAD, not what an earlier listing left in the filesystem's cache
            fs.invalidate_cache(key)
        if rest and getattr(fs, "async_impl", False):
            found = fsspec.asyn.sync(fs.loop, _gather, [fs._info(key) for key in rest], self.io_threads)
            infos.update(zip(rest, found, strict=True))
        else:
            infos.update((key, fs.info(key)) for key in rest)
        return [object_version(infos[key]) for key in keys]

    def request(self, what: str, call: Callable[[Any], T]) -> T:
        """``call(fs)`` (a request other than a ranged read: a HEAD, a listing, a PUT, a DELETE), made
        again on failure with the ranges' budget: ``attempts`` in all, the same backoff. An error no
        retry can mend (``_permanent``) is raised at once."""
        for attempt in range(1, self.attempts + 1):
            try:
                return call(self.fs)
            except Exception as err:  # noqa: BLE001 (the store's errors have no common base: retried, then named)
                if _permanent(err):
                    raise
                if attempt == self.attempts:
                    raise OSError(f"{what} failed {self.attempts} times; last: {describe_error(err)}") from None
                self.retries += 1
                log.warning("retrying %s (attempt %d of %d): %s", what, attempt + 1, self.attempts, describe_error(err))
                time.sleep(self._pause(attempt))
        raise AssertionError("unreachable")

    def _pause(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt``: exponential, jittered, capped."""
        return min(10.0, self.backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)

    def _verify(self, paths: list[str]) -> None:
        now = time.monotonic()
        due = [
            p
            for p in dict.fromkeys(paths)
            if p in self.expected and now - self._checked.get(p, -math.inf) > self.verify_every
        ]
        if not due:
            return
        for path, found in zip(due, self._versions(due), strict=True):
            if found != self.expected[path]:
                self._refuse_changed(path, found)
            self._checked[path] = now

    def _refuse_changed(self, path: str, found: tuple[int, str | None] | None = None) -> None:
        """Raise ``ChangedDuringRun`` for ``path``, saying what it was and what it is now (``found``, or
        asked for here: one HEAD, on the way out)."""
        if found is None:
            try:
                found = self._versions([path])[0]
            except OSError as err:
                found = (-1, f"unknown ({err})")
        raise ChangedDuringRun(_versions_differ(path, "ETag", self.expected[path], found))

    def read(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """The bytes ``[start, end)`` of each path, in order. Ranges of one file that touch are one request."""
        self._verify(paths)
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
            got = self._cat([ranges[i] for i in pending])
            failed = []
            for i, blob in zip(pending, got, strict=True):
                path, start, end = ranges[i]
                if isinstance(blob, FileNotFoundError | PermissionError):
                    raise type(blob)(f"cannot read {path}: {blob}") from None
                if _precondition_failed(blob):
                    self._refuse_changed(path)
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
            time.sleep(self._pause(attempt))
            pending = [i for i, _ in failed]
        raise AssertionError("unreachable")

    def _cat(self, ranges: list[tuple[str, int, int]]) -> list[bytes | BaseException]:
        """Each range's bytes, or the exception reading it raised; ``io_threads`` requests at a time."""
        fs = self.fs
        paths, starts, ends = (list(column) for column in zip(*ranges, strict=True))
        if urlparse(self.root).scheme in ("s3", "s3a"):
            tags = [self.expected.get(path, (0, None))[1] for path in paths]
            gets = [_s3_get(fs, *r, tag) for r, tag in zip(ranges, tags, strict=True)]
            return fsspec.asyn.sync(fs.loop, _gather, gets, self.io_threads)
        if getattr(fs, "async_impl", False):
            return fs.cat_ranges(paths, starts, ends, on_error="return", batch_size=self.io_threads)

        def cat(path: str, start: int, end: int) -> bytes | BaseException:
            try:
                return fs.cat_file(path, start=start, end=end)
            except Exception as err:  # noqa: BLE001 (returned, judged and retried by the caller)
                return err

        with ThreadPoolExecutor(self.io_threads) as pool:
            return list(pool.map(cat, paths, starts, ends))


def _permanent(err: BaseException) -> bool:
    """Whether a request's error is one no retry can mend: a missing object, a refused permission,
    missing credentials (botocore's ``NoCredentialsError``, ...), a filesystem not installed."""
    return (
        isinstance(err, FileNotFoundError | PermissionError | ImportError) or "credential" in type(err).__name__.lower()
    )


def _pool_for(root: str, options: dict[str, Any], io_threads: int) -> dict[str, Any]:
    """``options`` with room for ``io_threads`` connections (s3fs's client keeps 10 unless told, its
    ``max_pool_connections``, which would cap the requests in flight below ``io_threads``) and without
    the client's own retries (botocore's): ``RangeReader``'s attempts are the only retry budget."""
    if urlparse(root).scheme in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", max(io_threads, 10))
        config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
        options = {**options, "config_kwargs": config}
    return options


async def _s3_get(fs: Any, path: str, start: int, end: int, etag: str | None) -> bytes | BaseException:
    """Bytes ``[start, end)`` of an S3 object, sent with ``If-Match: etag`` where one is known (s3fs's
    own ranged reads take no headers), or the exception the request raised."""
    bucket, key, version = fs.split_path(path)
    conditions = {"IfMatch": etag} if etag else {}
    if version:
        conditions["VersionId"] = version
    try:
        response = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **conditions
        )
        try:
            return await response["Body"].read()
        finally:
            response["Body"].close()
    except Exception as err:  # noqa: BLE001 (returned, judged and retried by the caller)
        return err


def _precondition_failed(result: bytes | BaseException) -> bool:
    """Whether a ranged read was answered 412: its ``If-Match`` ETag is no longer the object's."""
    if not isinstance(result, BaseException):
        return False
    response = getattr(result.__cause__, "response", None) or getattr(result, "response", None) or {}
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412 or (
        response.get("Error", {}).get("Code") == "PreconditionFailed"
    )


async def _gather(coroutines: list[Any], limit: int) -> list[Any]:
    """The coroutines' results in order, at most ``limit`` running at once."""
    gate = asyncio.Semaphore(limit)

    async def gated(coroutine: Any) -> Any:
        async with gate:
            return await coroutine

    return await asyncio.gather(*map(gated, coroutines))
