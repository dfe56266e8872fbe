"""The floor for reading token windows from object storage: a bare thread pool issuing the loader's
range GETs, nothing else (no plan, no arrays, no batches).

``window_ranges`` turns the windows the plan yields into the byte ranges a loader must request: per
shard a window touches, ``[header + first token * 2, header + end token * 2)``, ranges of one file that
touch or overlap merged within each round of requests (16 micro-batches), as the loader's range reader
merges them. ``floor_seconds`` issues them with boto3 ``get_object(Range=...)`` from ``io_threads``
threads, all queued at once so the pool never idles, in one process or several at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fsspec.utils import merge_offset_ranges

from benchmarks.common import started_together
from benchmarks.object_store.server import KEY, REGION, SECRET

ByteRange = tuple[str, int, int]  # (object key, first byte, end byte exclusive)


@dataclass(frozen=True)
class ShardLayout:
    """Where the tokens of a corpus of ``.npy`` shards lie: object keys, token counts, header sizes."""

    keys: list[str]
    tokens: list[int]
    offsets: list[int]
    itemsize: int

    @classmethod
    def of(cls, shards: Sequence[Path], prefix: str) -> ShardLayout:
        """The layout of local ``shards`` uploaded under ``prefix`` (``corpus/`` in the bucket)."""
        tokens, offsets = [], []
        for path in shards:
            with open(path, "rb") as f:
                fmt = np.lib.format
                read_header = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
                shape, _, dtype = read_header(f)
                offsets.append(f.tell())
            tokens.append(shape[0])
        return cls([f"{prefix}{p.name}" for p in shards], tokens, offsets, dtype.itemsize)


def window_ranges(layout: ShardLayout, windows: np.ndarray, seq_len: int, group_windows: int) -> list[list[ByteRange]]:
    """The byte ranges of ``windows`` (tokens ``[w * seq_len, w * seq_len + seq_len + 1)`` of the
    shards read one after another), per run of ``group_windows`` windows, merged within each run."""
    starts = np.concatenate([[0], np.cumsum(layout.tokens)])
    groups: list[list[ByteRange]] = []
    for lo in range(0, len(windows), group_windows):
        keys, firsts, ends = [], [], []
        for window in windows[lo : lo + group_windows].tolist():
            first, end = window * seq_len, window * seq_len + seq_len + 1
            shard = int(np.searchsorted(starts, first, side="right")) - 1
            while first < end:
                take = min(end, int(starts[shard + 1])) - first
                local = first - int(starts[shard])
                keys.append(layout.keys[shard])
                firsts.append(layout.offsets[shard] + local * layout.itemsize)
                ends.append(layout.offsets[shard] + (local + take) * layout.itemsize)
                first, shard = first + take, shard + 1
        groups.append(list(zip(*merge_offset_ranges(keys, firsts, ends, max_gap=0, sort=True), strict=True)))
    return groups


def _fetch_all(
    endpoint: str, bucket: str, ranges: list[ByteRange], io_threads: int, ready: Callable[[], object]
) -> float:
    """Seconds for ``io_threads`` threads to GET every range (after ``ready``: connections opened first)."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
        config=Config(max_pool_connections=io_threads),
    )

    def get(piece: ByteRange) -> int:
        key, first, end = piece
        return len(client.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{end - 1}")["Body"].read())

    with ThreadPoolExecutor(io_threads) as pool:
        list(pool.map(get, ranges[:io_threads]))  # warm: a kept-alive connection per thread
        ready()
        start = time.perf_counter()
        got = sum(pool.map(get, ranges))
        elapsed = time.perf_counter() - start
    if got != sum(end - first for _, first, end in ranges):
        raise RuntimeError(f"the floor read {got} bytes of {len(ranges)} ranges, not what they span")
    return elapsed


def floor_seconds(endpoint: str, bucket: str, groups: list[list[ByteRange]], io_threads: int, processes: int) -> float:
    """Seconds to GET every range of ``groups``: in this process, or (``processes`` > 1) dealt group by
    group to that many processes that start together (as a DataLoader deals worker messages), each
    with its own pool; then the slowest process's time. Forked, as a DataLoader's workers are (a
    spawned process would import the benchmark's main module, torch and Lightning, first)."""
    if processes <= 1:
        return _fetch_all(endpoint, bucket, [r for group in groups for r in group], io_threads, ready=lambda: None)
    shares = [[r for group in groups[i::processes] for r in group] for i in range(processes)]
    return max(started_together(_fetch_all, [(endpoint, bucket, share, io_threads) for share in shares], "fork"))
