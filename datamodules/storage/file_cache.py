"""A node-local cache of whole remote files under a byte budget, shared by the node's processes.

Each item is a file in ``<folder>/items``, named by its URL and its version (so a changed object is
never served from the cache), and a row of an SQLite index (``<folder>/index.sqlite``) holding its
size and its *rank*, the order in which items leave: the largest goes first. With a planned order
the rank is the position at which the node next reads the item (Belady's rule, optimal for a known
sequence): the item needed furthest in the future is evicted, and an item needed later than every
item that would have to leave to make room for it is not kept at all. Without one it is the time of
the item's last use, negated (least recently used first).

- One fetch per item per node: a process missing an item takes a lock (one of ``LOCK_STRIPES`` lock
  files, by the item's name) for the fetch and the admission; another process missing it meanwhile
  waits and then reads the copy that landed.
- Complete or absent: an item is written under ``<folder>/partial`` and renamed into ``items`` in the
  index's transaction, so a process killed mid-write leaves a partial file nobody serves (removed
  after an hour) and its locks are released by the kernel.
- The budget holds at all times: victims are deleted before an item is renamed in; the bytes over it
  are at most the partial files being written.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_STRIPES = 1024  # fetches of items whose names fall in one stripe wait for each other
_STALE_PARTIAL_S = 3600.0
NEVER = float("inf")  # the rank of an item not needed again as far as the plan is known: it leaves first


@dataclass
class CacheStats:
    """What a cache did in one process (or, added up, in a job): reads served from it (``hits``) and
    fetched (``misses``), bytes fetched from storage and bytes handed to samples, items evicted,
    and fetched items not kept (needed later than everything in the cache)."""

    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    bytes_read: int = 0
    evictions: int = 0
    not_kept: int = 0

    def add(self, counts: CacheStats | tuple[int, ...] | list[int]) -> None:
        for f, value in zip(fields(self), astuple(counts) if isinstance(counts, CacheStats) else counts, strict=True):
            setattr(self, f.name, getattr(self, f.name) + int(value))

    def since(self, before: tuple[int, ...]) -> tuple[int, ...]:
        """The counts added since ``before`` (an earlier ``astuple`` of these stats)."""
        return tuple(now - then for now, then in zip(astuple(self), before, strict=True))

    @property
    def hit_rate(self) -> float:
        reads = self.hits + self.misses
        return self.hits / reads if reads else 0.0

    def metrics(self, prefix: str = "file_cache") -> dict[str, float]:
        counts = {f"{prefix}/{f.name}": float(getattr(self, f.name)) for f in fields(self)}
        return {**counts, f"{prefix}/hit_rate": self.hit_rate}


class FileCache:
    """Items of ``folder`` (at most ``budget`` bytes), shared by every process given the same folder.

    Args:
        folder: a node-local folder; created if missing.
        budget: the most bytes the items hold.
    """

    def __init__(self, folder: str | os.PathLike, budget: int) -> None:
        self.folder = Path(folder)
        self.budget = budget
        self.stats = CacheStats()
        self._local = threading.local()  # this thread's connection to the index, and its process
        self._counting = threading.Lock()  # threads of a process (a loader's fetch threads) share the counts

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_local": None, "_counting": None}  # a connection is per process and thread

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _local=threading.local(), _counting=threading.Lock())

    def read(self, name: str, fetch: Callable[[], bytes], rank: float, planned: bool) -> bytes:
        """The item ``name``: the cached copy, else ``fetch()``, kept if the rule admits it.

        ``rank``: where the item stands in the eviction order after this read (its next use, or its
        last use negated); ``planned``: whether ranks are next uses, so an item needed later than
        every victim it would displace is not kept."""
        data = self.lookup(name, rank)
        if data is None:
            with self.fetching([name]):
                data = self.lookup(name, rank)  # fetched by another process while this one waited
                if data is None:
                    data = fetch()
                    self.keep(name, data, rank, planned)
        return data

    def lookup(self, name: str, rank: float) -> bytes | None:
        """The cached copy of ``name`` (its rank updated), or ``None``."""
        self._connection()  # the folders and the index exist
        data = self._cached(name, rank)
        if data is not None:
            self._count(hits=1, bytes_read=len(data))
        return data

    def _count(self, **counts: int) -> None:
        with self._counting:
            for name, value in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    @contextmanager
    def fetching(self, names: list[str]) -> Iterator[None]:
        """Held while this process fetches ``names``: another process missing one of them waits, then
        finds it in the cache. Stripes are taken in order, so two processes never wait on each other."""
        self._connection()
        stripes = sorted({zlib.crc32(name.encode()) % LOCK_STRIPES for name in names})
        with contextlib.ExitStack() as held:
            for stripe in stripes:
                lock = held.enter_context(open(self.folder / "locks" / f"{stripe:04d}", "a"))
                fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
            yield

    def keep(self, name: str, data: bytes, rank: float, planned: bool) -> None:
        """Count ``data`` (just fetched) and keep it as ``name`` if the rule admits it."""
        self._count(misses=1, bytes_fetched=len(data), bytes_read=len(data))
        self._admit(name, data, rank, planned)

    def _cached(self, name: str, rank: float) -> bytes | None:
        try:
            with open(self.folder / "items" / name, "rb") as f:  # an item evicted now still reads
                data = f.read()
        except FileNotFoundError:
            return None
        with self._transaction() as db:
            if not db.execute("UPDATE items SET rank = ? WHERE name = ?", (rank, name)).rowcount:
                # On disk but not in the index (a process died between the rename and the commit).
                db.execute("INSERT INTO items VALUES (?, ?, ?)", (name, len(data), rank))
                db.execute("UPDATE total SET bytes = bytes + ?", (len(data),))
        return data

    def _admit(self, name: str, data: bytes, rank: float, planned: bool) -> None:
        if len(data) > self.budget:
            self._count(not_kept=1)
            return
        partial = self.folder / "partial" / uuid.uuid4().hex
        partial.write_bytes(data)
        try:
            with self._transaction() as db:
                (total,) = db.execute("SELECT bytes FROM total").fetchone()
                stale = db.execute("SELECT size FROM items WHERE name = ?", (name,)).fetchone()
                if stale is not None:  # indexed, its file gone (a process died mid-eviction)
                    db.execute("DELETE FROM items WHERE name = ?", (name,))
                    total -= stale[0]
                victims, room = [], self.budget - total
                if room < len(data):
                    furthest_first = db.execute("SELECT name, size, rank FROM items ORDER BY rank DESC")
                    for victim, size, victim_rank in furthest_first:
                        if planned and victim_rank <= rank:  # this item is needed last of all: not kept
                            self._count(not_kept=1)
                            return
                        victims.append(victim)
                        room += size
                        if room >= len(data):
                            break
                for victim in victims:
                    db.execute("DELETE FROM items WHERE name = ?", (victim,))
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.folder / "items" / victim)
                db.execute("INSERT INTO items VALUES (?, ?, ?)", (name, len(data), rank))
                db.execute("UPDATE total SET bytes = ?", (self.budget - room + len(data),))
                os.replace(partial, self.folder / "items" / name)
                self._count(evictions=len(victims))
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.rollback()
            raise
        else:
            db.commit()

    def _connection(self) -> sqlite3.Connection:
        db, pid = getattr(self._local, "db", None), getattr(self._local, "pid", -1)
        if db is not None and pid == os.getpid():
            return db
        for part in ("items", "partial", "locks"):
            (self.folder / part).mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.folder / "index.sqlite", timeout=600, isolation_level=None)
        with self._locked_setup():  # one process at a time sets the journal up and creates the tables
            db.execute("PRAGMA journal_mode = WAL")  # readers never wait for a writer
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS items (name TEXT PRIMARY KEY, size INTEGER, rank REAL)")
            db.execute("CREATE INDEX IF NOT EXISTS by_rank ON items (rank)")
            db.execute("CREATE TABLE IF NOT EXISTS total (bytes INTEGER)")
            if db.execute("SELECT COUNT(*) FROM total").fetchone()[0] == 0:
                db.execute("INSERT INTO total VALUES (0)")
        self._remove_stale_partials()
        self._local.db, self._local.pid = db, os.getpid()
        return db

    @contextmanager
    def _locked_setup(self) -> Iterator[None]:
        with open(self.folder / "locks" / "setup", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _remove_stale_partials(self) -> None:
        """Partial files an hour old were left by processes killed mid-write."""
        now = time.time()
        for entry in os.scandir(self.folder / "partial"):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime > _STALE_PARTIAL_S:
                    os.unlink(entry.path)
                    log.debug("file cache %s: removed a partial file left by a killed process", self.folder)

    def cached_bytes(self) -> int:
        """The bytes the index says the items hold."""
        return self._connection().execute("SELECT bytes FROM total").fetchone()[0]
