"""``FileCache``, the node-local folder the sources' remote files go through: which items it keeps
under a planned order, one fetch per item among the node's processes, and nothing torn served after a
process dies mid-write."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from datamodules.storage.file_cache import NEVER, FileCache


def item(size: int, tag: int) -> bytes:
    return bytes([tag]) * size


def kept(cache: FileCache) -> set[str]:
    return {p.name for p in (cache.folder / "items").iterdir()}


def test_a_full_cache_evicts_the_item_needed_furthest_ahead_and_keeps_out_one_needed_later_still(
    tmp_path: Path,
) -> None:
    cache = FileCache(tmp_path, budget=300)
    for name, next_use in (("a", 5), ("b", 9), ("c", 7)):
        cache.read(name, lambda n=name: item(100, ord(n)), next_use, planned=True)
    cache.read("d", lambda: item(100, 1), 6, planned=True)  # b (9) is needed last: it leaves
    assert kept(cache) == {"a", "c", "d"}
    cache.read("e", lambda: item(100, 2), 8, planned=True)  # later than all of a, c, d: not kept
    assert kept(cache) == {"a", "c", "d"} and cache.stats.not_kept == 1
    cache.read("f", lambda: item(150, 3), NEVER, planned=True)  # needed again nowhere in sight: not kept
    assert kept(cache) == {"a", "c", "d"}
    # room for 150 bytes takes c (7) and d (6), and d is needed before it: not kept
    cache.read("g", lambda: item(150, 4), 6.5, planned=True)
    assert kept(cache) == {"a", "c", "d"} and cache.stats.not_kept == 3
    cache.read("h", lambda: item(200, 5), 1, planned=True)  # c (7) and d (6) leave for it
    assert kept(cache) == {"a", "h"} and cache.stats.evictions == 3
    assert cache.cached_bytes() == 300 == sum(p.stat().st_size for p in (tmp_path / "items").iterdir())
    assert cache.read("a", lambda: b"never fetched", 20, planned=True) == item(100, ord("a"))
    assert (cache.stats.hits, cache.stats.misses) == (1, 8)


def test_an_item_over_the_budget_is_read_and_not_kept(tmp_path: Path) -> None:
    cache = FileCache(tmp_path, budget=99)
    assert cache.read("big", lambda: item(100, 7), 1, planned=False) == item(100, 7)
    assert not kept(cache) and cache.stats.not_kept == 1


def count_fetches(folder: str, names: list[str], fetched: object, start: object) -> None:
    """A process of the node: reads every item, counting the fetches it made in ``fetched``."""
    cache = FileCache(folder, budget=10**6)
    start.wait()

    def fetch(name: str) -> bytes:
        with fetched.get_lock():
            fetched.value += 1
        time.sleep(0.05)  # a slow store: the other processes ask for the item meanwhile
        return item(1000, ord(name[-1]))

    for name in names:
        assert cache.read(name, lambda n=name: fetch(n), 1, planned=False) == item(1000, ord(name[-1]))


def test_four_processes_reading_the_same_items_at_once_fetch_each_once(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    fetched, start = context.Value("i", 0), context.Barrier(4)
    names = [f"item{i}" for i in range(8)]
    processes = [context.Process(target=count_fetches, args=(str(tmp_path), names, fetched, start)) for _ in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    assert fetched.value == len(names)


def die_writing(folder: str, written: object) -> None:
    """Fetches an item and is killed halfway through writing it into the cache."""
    cache = FileCache(folder, budget=10**6)
    original = Path.write_bytes

    def half_then_hang(path: Path, data: bytes) -> int:
        original(path, data[: len(data) // 2])
        written.set()
        time.sleep(600)
        return 0

    Path.write_bytes = half_then_hang
    cache.read("clip.mp4", lambda: item(10_000, 9), 1, planned=False)


def test_a_process_killed_mid_write_leaves_nothing_served_and_no_lock_held(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    written = context.Event()
    process = context.Process(target=die_writing, args=(str(tmp_path), written))
    process.start()
    assert written.wait(timeout=120)
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=60)
    (partial,) = (tmp_path / "partial").iterdir()  # the half-written file, under no item's name
    assert partial.stat().st_size == 5_000 and not kept(FileCache(tmp_path, 10**6))
    cache = FileCache(tmp_path, budget=10**6)
    assert cache.read("clip.mp4", lambda: item(10_000, 9), 1, planned=False) == item(10_000, 9)
    assert cache.stats.misses == 1 and (tmp_path / "items" / "clip.mp4").read_bytes() == item(10_000, 9)
    old = time.time() - 7200
    os.utime(partial, (old, old))  # an hour on, the next process to open the cache removes it
    FileCache(tmp_path, budget=10**6).cached_bytes()
    assert not partial.exists()
