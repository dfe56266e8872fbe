"""The samples of tar shards as fixed-width arrays: one index file per shard (``TarIndex``), assembled
into one node-local table per set of shards that every process maps read-only (``IndexedShards``).

The table holds, a sample, where its first tar header starts and the digest of its members' headers
(16 bytes), and its key (its UTF-8 bytes and an 8-byte offset): at a billion samples, 16 GB plus the
keys on the node's disk, shared through the page cache by every process of the node, each holding
only a few numbers per shard. A sample's bytes run from its start to the next sample's (the shard's
last one to ``end``): one read, members not asked for included.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.storage.locations import is_url
from datamodules.storage.range_reader import RangeReader

SAMPLE = np.dtype([("start", "<i8"), ("digest", "<i8")])  # a sample's row of the table: 16 bytes
_TABLE_FILES = ("samples", "keys", "key_offsets")
_ARRAYS = ("starts", "digests", "keys", "key_ends")  # a shard's index: its arrays, then its numbers
_ABOUT = ("end", "members", "fingerprint", "lost_bytes", "decompressed")


@dataclass
class TarIndex:
    """The samples of one tar shard, in shard order: where each one's first header block starts
    (``starts``), the digest of its members' headers (``digests``, ``headers_digest``), its key
    (``keys``: their UTF-8 bytes one after another, each ending at its ``key_ends``); ``end``: where
    the last sample's data ends; ``members``: the regular members indexed; ``fingerprint``: of their
    names, sizes and places; ``lost_bytes``: bytes after the last complete member of a truncated or
    corrupt shard (0 for a whole one); ``decompressed``: indexed (and read) from a decompressed copy
    beside the index."""

    starts: np.ndarray  # int64
    digests: np.ndarray  # int64
    keys: np.ndarray  # uint8
    key_ends: np.ndarray  # int64
    end: int
    members: int
    fingerprint: str
    lost_bytes: int = 0
    decompressed: bool = False

    def save(self, path: Path) -> None:
        """Written to a temporary name, then renamed: a reader sees the whole index or none."""
        about = {name: getattr(self, name) for name in _ABOUT}
        about.update(samples=len(self.starts), key_bytes=len(self.keys))
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with partial.open("wb") as f:
            np.savez(f, **{name: getattr(self, name) for name in _ARRAYS}, about=np.array(json.dumps(about)))
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> TarIndex:
        with np.load(path) as saved:
            about = json.loads(str(saved["about"]))
            return cls(*(saved[name] for name in _ARRAYS), **{name: about[name] for name in _ABOUT})

    @staticmethod
    def about(path: Path) -> dict[str, Any]:
        """The index's numbers (``samples``, ``key_bytes``, ``end``, ``members``, ``fingerprint``,
        ``lost_bytes``, ``decompressed``), without its arrays."""
        with np.load(path) as saved:
            return json.loads(str(saved["about"]))


def decompressed_copy(index_path: Path) -> Path:
    """Where a compressed shard's decompressed copy is kept: beside its index."""
    return index_path.with_suffix(".tar")


def table_name(locations: list[str], versions: list[tuple[int, str | None]], index_format: int) -> str:
    """The table's folder name: a digest of the shards' locations and versions."""
    absolute = [location if is_url(location) else os.path.abspath(location) for location in locations]
    named = list(zip(absolute, map(list, versions), strict=True))
    return f"samples-{hashlib.sha256(repr((index_format, named)).encode()).hexdigest()[:32]}"


def assemble_table(
    table: Path, locations: list[str], versions: list[tuple[int, str | None]], index_paths: list[Path]
) -> None:
    """The node table ``table`` (a folder) of the shards at ``locations`` (of ``versions``) whose index
    files are ``index_paths``, read in order, one index in memory at a time. Written under a temporary
    name and renamed: a process sees the whole table or none; processes of a node assembling it at
    once write the same table, and the first rename wins."""
    abouts = [TarIndex.about(path) for path in index_paths]
    read_locations = [
        str(decompressed_copy(path)) if about["decompressed"] else location
        for location, path, about in zip(locations, index_paths, abouts, strict=True)
    ]
    firsts = np.cumsum([0] + [about["samples"] for about in abouts]).tolist()
    partial = table.with_name(f".{table.name}.{uuid.uuid4().hex}")
    partial.mkdir(parents=True)
    try:
        _write_arrays(partial, index_paths, firsts[-1], sum(about["key_bytes"] for about in abouts))
        columns = zip(locations, read_locations, versions, firsts[:-1], abouts, strict=True)
        shards = [
            {"location": location, "read_location": read, "version": list(version), "first": first}
            | {name: about[name] for name in ("end", "members", "lost_bytes")}
            for location, read, version, first, about in columns
        ]
        described = {"fingerprint": _fingerprint(locations, versions, abouts), "samples": firsts[-1]}
        (partial / "shards.json").write_text(json.dumps({**described, "shards": shards}))
        os.rename(partial, table)
    except OSError:
        if not table.is_dir():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _write_arrays(folder: Path, index_paths: list[Path], samples: int, key_bytes: int) -> None:
    """The table's ``.npy`` files, streamed shard by shard."""
    shapes = {"samples": (SAMPLE, samples), "keys": (np.uint8, key_bytes), "key_offsets": (np.int64, samples + 1)}
    files = {name: (folder / f"{name}.npy").open("wb") for name in _TABLE_FILES}
    try:
        for name, (dtype, length) in shapes.items():
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False}
            np.lib.format.write_array_header_1_0(files[name], {**header, "shape": (length,)})
        files["key_offsets"].write(np.zeros(1, np.int64).tobytes())
        key_base = 0
        for path in index_paths:
            index = TarIndex.load(path)
            rows = np.empty(len(index.starts), SAMPLE)
            rows["start"], rows["digest"] = index.starts, index.digests
            files["samples"].write(rows.tobytes())
            files["keys"].write(index.keys.tobytes())
            files["key_offsets"].write((index.key_ends + key_base).astype(np.int64).tobytes())
            key_base += len(index.keys)
    finally:
        for f in files.values():
            f.close()


def _fingerprint(locations: list[str], versions: list[tuple[int, str | None]], abouts: list[dict]) -> str:
    """What a changed shard changes: its members' names, sizes and places; in a bucket, its ETag too (a
    local file's mtime is left out: a copy of the shards elsewhere resumes)."""
    digest = hashlib.sha256()
    for location, (_, tag), about in zip(locations, versions, abouts, strict=True):
        digest.update(f"{location.rsplit('/', 1)[-1]}\n{about['fingerprint']}\n".encode())
        if is_url(location):
            digest.update(f"{tag}\n".encode())
    return digest.hexdigest()[:32]


class IndexedShards:
    """Tar shards and their samples, as the node table in ``folder`` holds them (``index_shards`` builds
    it): the shards' ``locations``, where their members are read (``read_locations``: a compressed
    shard's decompressed copy), the ``versions`` (size, ETag or mtime) indexed and each shard's first
    sample (``firsts``, one more entry: the sample count). The per-sample arrays are mapped read-only
    on first use, in each process (they are not pickled): a process holds a few numbers per shard.

    ``reader`` reads remote shards, their versions recorded; ``bytes_read``: by the header walks that
    built the indexes (0 when every index came from the cache)."""

    def __init__(self, folder: Path, reader: RangeReader | None = None, bytes_read: int = 0) -> None:
        described = json.loads((folder / "shards.json").read_text())
        shards = described["shards"]
        self.folder, self.reader, self.bytes_read = folder, reader, bytes_read
        self.fingerprint: str = described["fingerprint"]
        self.locations: list[str] = [shard["location"] for shard in shards]
        self.read_locations: list[str] = [shard["read_location"] for shard in shards]
        self.versions: list[tuple[int, str | None]] = [tuple(shard["version"]) for shard in shards]  # type: ignore[misc]
        self.firsts = np.array([shard["first"] for shard in shards] + [described["samples"]], dtype=np.int64)
        self.ends = np.array([shard["end"] for shard in shards], dtype=np.int64)
        self.members: list[int] = [shard["members"] for shard in shards]
        self.lost_bytes: list[int] = [shard["lost_bytes"] for shard in shards]
        self._maps: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.firsts[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}  # a worker maps the table itself

    def _map(self, name: str) -> np.ndarray:
        if self._maps is None:
            # Plain arrays over the maps: numpy's memmap class costs microseconds an index.
            maps = {name: np.load(self.folder / f"{name}.npy", mmap_mode="r") for name in _TABLE_FILES}
            self._maps = {name: array.view(np.ndarray) for name, array in maps.items()}
        return self._maps[name]

    def shard_of(self, rows: np.ndarray) -> np.ndarray:
        """The shard number of each of ``rows``."""
        return np.searchsorted(self.firsts, rows, side="right") - 1

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(shards, starts, ends)`` of ``rows``: each one's shard and byte range in it (its first header
        to the next sample's, or to ``end`` for a shard's last)."""
        rows = np.asarray(rows, dtype=np.int64)
        shards = self.shard_of(rows)
        starts = self._map("samples")["start"]
        last = rows + 1 == self.firsts[shards + 1]
        ends = np.where(last, self.ends[shards], starts[np.minimum(rows + 1, len(self) - 1)])
        return shards, starts[rows], ends

    def digest(self, row: int) -> int:
        """The digest of the row's members' headers (``headers_digest``) when it was indexed."""
        return int(self._map("samples")["digest"][row])

    def key(self, row: int) -> str:
        start, end = self._map("key_offsets")[row : row + 2].tolist()
        return self._map("keys")[start:end].tobytes().decode("utf-8", errors="surrogateescape")

    def samples_in(self, shard: int) -> int:
        return int(self.firsts[shard + 1] - self.firsts[shard])
