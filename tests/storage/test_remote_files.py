"""Whole files read by URL from an S3 server on 127.0.0.1 (moto), with and without a node-local cache
that processes share."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest

from benchmarks.object_store.server import S3Proxy, create_bucket, storage_options
from datamodules.storage.remote_files import RemoteFiles

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "files"
SIZES = [3_000 + 997 * i for i in range(24)]


@pytest.fixture(scope="module")
def stored(endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """URL -> content of files of different sizes uploaded to the server."""
    local = tmp_path_factory.mktemp("files")
    rng = random.Random(0)
    contents = {}
    for i, size in enumerate(SIZES):
        data = rng.randbytes(size)
        (local / f"clip_{i:02d}.bin").write_bytes(data)
        contents[f"s3://{BUCKET}/clips/clip_{i:02d}.bin"] = data
    create_bucket(endpoint, BUCKET)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(local), f"{BUCKET}/clips", recursive=True)
    return contents


def cached_files(cache: Path) -> list[Path]:
    return list((cache / "items").iterdir())


def test_a_url_reads_the_whole_object_and_a_local_path_reads_the_file(
    tmp_path: Path, endpoint: str, stored: dict[str, bytes]
) -> None:
    files = RemoteFiles(storage_options(endpoint))
    for url, data in list(stored.items())[:3]:
        assert files.read_bytes(url) == data
    (tmp_path / "local.bin").write_bytes(b"local bytes")
    assert files.read_bytes(tmp_path / "local.bin") == b"local bytes"
    assert RemoteFiles().read_bytes(f"file://{tmp_path / 'local.bin'}") == b"local bytes"


def test_a_cached_file_is_read_once_from_the_server(tmp_path: Path, endpoint: str, stored: dict[str, bytes]) -> None:
    proxy = S3Proxy(endpoint)
    try:
        files = RemoteFiles(storage_options(proxy.url), cache_dir=str(tmp_path / "cache"), cache_bytes=10**6)
        url, data = next(iter(stored.items()))
        assert files.read_bytes(url) == data
        assert proxy.ranged_gets == 1
        assert files.read_bytes(url) == data
        assert proxy.ranged_gets == 1  # the second read is the cached copy
        (kept,) = cached_files(tmp_path / "cache")
        assert kept.read_bytes() == data
    finally:
        proxy.close()


def test_the_least_recently_used_files_are_evicted_first(
    tmp_path: Path, endpoint: str, stored: dict[str, bytes]
) -> None:
    urls = list(stored)[:4]
    budget = sum(len(stored[u]) for u in urls[:3])  # room for three
    files = RemoteFiles(storage_options(endpoint), cache_dir=str(tmp_path), cache_bytes=budget, cache_policy="lru")
    for url in urls[:3] + urls[:1]:  # the first read again: now the most recent
        files.read_bytes(url)
        time.sleep(0.01)
    files.read_bytes(urls[3])
    kept = {p.read_bytes() for p in cached_files(tmp_path)}
    assert stored[urls[0]] in kept and stored[urls[3]] in kept
    assert stored[urls[1]] not in kept  # the least recently used
    assert sum(p.stat().st_size for p in cached_files(tmp_path)) <= budget


def read_all(options: dict, cache: str, budget: int, expected: dict[str, str], seed: int, queue: object) -> None:
    """A process of the node: reads every file three times in its own order, checking every byte."""
    files = RemoteFiles(options, cache_dir=cache, cache_bytes=budget, cache_policy="lru")
    order = list(expected) * 3
    random.Random(seed).shuffle(order)
    bad = [url for url in order if hashlib.sha256(files.read_bytes(url)).hexdigest() != expected[url]]
    queue.put(bad)


def test_two_processes_sharing_a_cache_see_no_torn_file_and_keep_the_budget(
    tmp_path: Path, endpoint: str, stored: dict[str, bytes]
) -> None:
    expected = {url: hashlib.sha256(data).hexdigest() for url, data in stored.items()}
    budget = sum(SIZES) // 3  # a third of the files fit: the processes evict each other's files
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    cache = str(tmp_path / "shared")
    processes = [
        context.Process(target=read_all, args=(storage_options(endpoint), cache, budget, expected, seed, queue))
        for seed in (1, 2)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results == [[], []]  # every read returned the whole file
    kept = cached_files(Path(cache))
    assert kept and sum(p.stat().st_size for p in kept) <= budget
    by_digest = set(expected.values())
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() in by_digest for p in kept)  # none torn
    assert not list((Path(cache) / "partial").iterdir())


def test_a_missing_object_and_a_cache_without_a_budget_are_one_line(tmp_path: Path, endpoint: str) -> None:
    with pytest.raises(FileNotFoundError, match=f"s3://{BUCKET}/clips/missing.bin does not exist"):
        RemoteFiles(storage_options(endpoint)).read_bytes(f"s3://{BUCKET}/clips/missing.bin")
    with pytest.raises(ValueError, match="a file cache needs cache_bytes, a positive number of bytes; got None"):
        RemoteFiles(cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="cache_dir must be a local folder, got 's3://bucket/cache'"):
        RemoteFiles(cache_dir="s3://bucket/cache", cache_bytes=10)
    assert not os.listdir(tmp_path)


def test_an_object_changed_between_reads_is_fetched_again_never_served_from_the_cache(
    tmp_path: Path, endpoint: str
) -> None:
    store = s3fs.S3FileSystem(**storage_options(endpoint))
    url = f"s3://{BUCKET}/changing/clip.bin"
    proxy = S3Proxy(endpoint)
    try:
        files = RemoteFiles(storage_options(proxy.url), cache_dir=str(tmp_path), cache_bytes=10**6)
        for version, fetches in ((b"first version", 1), (b"second version", 2), (b"second,version", 3)):
            store.pipe(url, version)  # the last keeps the size: only its ETag tells it apart
            assert files.read_bytes(url) == files.read_bytes(url) == version
            assert proxy.ranged_gets == fetches  # fetched once, then read from the cache
        other = RemoteFiles(storage_options(proxy.url), cache_dir=str(tmp_path), cache_bytes=10**6)
        assert other.read_bytes(url) == b"second,version" and proxy.ranged_gets == 3  # the node's copy
    finally:
        proxy.close()
