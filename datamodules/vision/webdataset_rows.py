"""WebDataset tar shards as rows of a table: each sample's chosen members, read by offset.

``WebDatasetRows`` answers ``len`` and ``rows[i]`` as a ``datasets.Dataset`` does, so the image-text
and video samples read it as they read any dataset: a row is a dict of the chosen fields, a media
field as ``{"bytes", "path"}`` (``path`` names the member: ``shard.tar:key.jpg``), a text field as a
string; a sample without one of the fields, or whose text is not UTF-8, is a ``BadSample``. A row's
members are one byte range of its shard (a sample's members lie together): one request per sample,
and ``prefetch`` requests a micro-batch's ranges together.

A shard changed under the run is refused (``ChangedDuringRun``), never read by the old offsets: the
range starts 512 bytes early, so it holds the tar header of every member read, each checked against
the index's digest; a local shard's size and mtime are checked beside each read (one ``fstat``), a
bucket's ETag by the GET itself (``If-Match``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.plan.bad_samples import BadSample
from datamodules.storage.locations import is_url
from datamodules.storage.range_reader import ChangedDuringRun, changed_message, read_range, read_unchanged
from datamodules.storage.tar_index import Shards, header_digest, index_shards, shard_locations

log = logging.getLogger(__name__)

WEBDATASET = "webdataset"  # the ``path`` (as datasets' builder is named) that reads tar shards by member


def key_choices(option: str, value: str) -> list[str]:
    """``"jpg;png;json:caption"`` as ``["jpg", "png", "json:caption"]``; an error naming ``option`` if empty."""
    choices = [part.strip() for part in str(value).split(";") if part.strip()]
    if not choices:
        raise ValueError(f"{option} names no member field (e.g. 'jpg;png' or 'json:caption'), got {value!r}")
    return choices


class WebDatasetRows:
    """The samples of indexed tar shards, with ``fields`` chosen by key: ``{"image": "jpg;png",
    "text": "txt", "prompt": "json:prompt"}``: the first of a field's choices the sample has;
    ``"json:NAME"`` takes ``NAME`` from the sample's ``.json`` member. The fields named in ``media``
    are given as bytes, the others as text."""

    def __init__(self, shards: Shards, fields: dict[str, str], media: tuple[str, ...]) -> None:
        self.reader = shards.reader  # remote shards' ranges, with their sizes and ETags recorded
        self.media = media
        self.locations = shards.locations
        self.read_locations = shards.read_locations  # a compressed shard's members: its decompressed copy
        # (size, mtime) of each local shard read in place, checked at every read; a decompressed copy is
        # ours (what the original becomes no longer matters), a bucket's shard is checked by its ETag.
        self.local_versions = [
            version if read == location and not is_url(location) else None
            for location, read, version in zip(self.locations, self.read_locations, shards.versions, strict=True)
        ]
        self.column_names = list(fields)
        self._prefetched: dict[int, bytes] = {}
        # field -> its choices in order of preference, each (member field, name inside a .json or None)
        self.choices = {f: [_choice(c) for c in key_choices(f"{f}_key", spec)] for f, spec in fields.items()}
        shard_ids, keys, starts, ends, member_set_ids = [], [], [], [], []
        # field -> (offset, size, choice, header digest) a row
        chosen: dict[str, list[tuple[int, int, int, int]]] = {field: [] for field in fields}
        member_sets: dict[tuple[str, ...], int] = {}  # each distinct set of member fields, numbered (for messages)
        empty = []
        for number, index in enumerate(shards.indexes):
            offsets, sizes = index.offsets.tolist(), index.sizes.tolist()  # Python ints: this loop is per member
            headers = index.headers.tolist()
            samples = index.samples()
            if not samples:
                empty.append(self.locations[number])
            for key, present in samples:
                picks = {
                    field: next(((n, present[m]) for n, (m, _) in enumerate(choices) if m in present), None)
                    for field, choices in self.choices.items()
                }
                used = [pick[1] for pick in picks.values() if pick is not None] or [next(iter(present.values()))]
                start = min(offsets[m] for m in used) - tarfile.BLOCKSIZE  # the first member's header too
                end = max(offsets[m] + sizes[m] for m in used)
                shard_ids.append(number)
                keys.append(key)
                starts.append(start)
                ends.append(end)
                member_set_ids.append(member_sets.setdefault(tuple(present), len(member_sets)))
                for field, pick in picks.items():
                    if pick is None:
                        chosen[field].append((-1, 0, -1, 0))
                    else:
                        m = pick[1]
                        chosen[field].append((offsets[m] - start, sizes[m], pick[0], headers[m]))
        if empty:
            log.warning(
                "%d of %d tar shards hold no sample: %s%s", len(empty), len(self.locations), ", ".join(empty[:5]),
                f" and {len(empty) - 5} more" if len(empty) > 5 else "",
            )  # fmt: skip
        self.shard_ids = np.array(shard_ids, dtype=np.int32)
        self.keys = np.array([key.encode("utf-8", errors="surrogateescape") for key in keys], dtype=bytes)
        self.starts = np.array(starts, dtype=np.int64)
        self.ends = np.array(ends, dtype=np.int64)
        self.fields = {field: np.array(places, dtype=np.int64).reshape(-1, 4) for field, places in chosen.items()}
        self.member_sets = list(member_sets)
        self.member_set_ids = np.array(member_set_ids, dtype=np.int32)
        digest = hashlib.sha256(repr(sorted(fields.items())).encode())
        # What a changed shard changes: its members' names, sizes and places; in a bucket, its ETag too (a
        # local file's mtime is left out: a copy of the shards elsewhere resumes).
        for location, index, (_, tag) in zip(self.locations, shards.indexes, shards.versions, strict=True):
            digest.update(location.rsplit("/", 1)[-1].encode())
            for array in (index.offsets, index.sizes):
                digest.update(array.tobytes())
            digest.update(b"\n".join(index.names.tolist()))
            if is_url(location):
                digest.update(str(tag).encode())
        self._fingerprint = digest.hexdigest()[:32]

    def __len__(self) -> int:
        return len(self.starts)

    def describe(self, row: int) -> str:
        return f"{self.locations[self.shard_ids[row]]}:{self.keys[row].decode('utf-8', errors='surrogateescape')}"

    def prefetch(self, rows: list[int]) -> None:
        """Read the rows' members now, together (one request per row, concurrent, adjacent rows of a
        shard merged); the next ``self[row]`` of each takes them from memory."""
        rows = [int(r) for r in rows]
        paths = [self.read_locations[self.shard_ids[r]] for r in rows]
        starts, ends = self.starts[rows].tolist(), self.ends[rows].tolist()
        remote = [i for i, path in enumerate(paths) if is_url(path)]
        spans = [b""] * len(rows)
        if remote:
            fetched = self.reader.read(
                [paths[i] for i in remote], [starts[i] for i in remote], [ends[i] for i in remote]
            )
            for i, span in zip(remote, fetched, strict=True):
                spans[i] = span
        for i, path in enumerate(paths):
            version = self.local_versions[self.shard_ids[rows[i]]]
            if version is not None:
                spans[i] = read_unchanged(path, starts[i], ends[i], version)
            elif not is_url(path):
                spans[i] = read_range(Path(path), starts[i], ends[i])
        if len(self._prefetched) > 4 * len(rows):  # rows prefetched by a fetch that failed part-way
            self._prefetched.clear()
        self._prefetched.update(zip(rows, spans, strict=True))

    def __getitem__(self, row: int) -> dict[str, Any]:
        """The row's fields; a ``BadSample`` for a missing member, a text member that is not UTF-8 or
        a ``.json`` that is not a JSON object."""
        row = int(row)
        span = self._prefetched.pop(row, None)
        if span is None:
            self.prefetch([row])
            span = self._prefetched.pop(row)
        return self._row(row, span)

    def _row(self, row: int, span: bytes) -> dict[str, Any]:
        places = {field: places[row].tolist() for field, places in self.fields.items()}
        for field, (offset, _, choice, header) in places.items():
            if offset >= 0 and header_digest(span[offset - tarfile.BLOCKSIZE : offset]) != header:
                member = self.choices[field][choice][0]
                where = int(self.starts[row]) + offset - tarfile.BLOCKSIZE
                raise ChangedDuringRun(
                    changed_message(
                        self.locations[self.shard_ids[row]],
                        f"the tar header at byte {where} is no longer the one of its member "
                        f"{self.keys[row].decode('utf-8', errors='surrogateescape')}.{member} that the run indexed",
                    )
                )
        out: dict[str, Any] = {}
        for field, (offset, size, choice, _) in places.items():
            if offset < 0:
                wanted = " or ".join(f".{member}" for member, _ in self.choices[field])
                has = ", ".join(f".{member}" for member in self.member_sets[self.member_set_ids[row]])
                raise BadSample(f"it has no {wanted} member (its members: {has})")
            data = span[offset : offset + size]
            member, json_name = self.choices[field][choice]
            if field in self.media:
                out[field] = {"bytes": data, "path": f"{self.describe(row)}.{member}"}
            elif json_name is not None:
                try:
                    value = json.loads(data)
                except ValueError as err:
                    raise BadSample(f"its {member} member is not JSON ({err})") from None
                if not isinstance(value, dict):
                    raise BadSample(f"its {member} member is a JSON {type(value).__name__}, not an object")
                out[field] = value.get(json_name)
            else:
                try:
                    out[field] = data.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise BadSample(f"its {member} member is not UTF-8 text ({err})") from None
        return out


def _choice(text: str) -> tuple[str, str | None]:
    """``"json:caption"`` as ``("json", "caption")``, ``"txt"`` as ``("txt", None)``."""
    member, _, name = text.partition(":")
    return member.lower(), (name or None)


def fetch_each(fetch: Callable[..., dict[str, Any]]) -> Callable[[list[tuple[Any, dict]]], list[dict[str, Any]]]:
    """A samples' ``fetch_many`` that fetches each micro-batch in turn: for rows in a bucket, the loader
    in-process then reads and decodes the next micro-batch in a thread while this one trains."""
    return lambda calls: [fetch(indices, **extra) for indices, extra in calls]


def in_a_bucket(dataset: Any) -> bool:
    """Whether ``dataset``'s rows are tar shards read by URL (worth reading ahead in-process)."""
    return getattr(dataset, "reader", None) is not None


def split_shards(data_files: str | list[str] | dict[str, Any] | None, split: str) -> str | list[str]:
    """The shards of ``split``: ``data_files`` (a pattern, a folder or a list: the ``"train"`` split),
    or its entry for ``split`` (a dict by split, as ``datasets`` takes ``data_files``)."""
    if data_files is None:
        raise ValueError(
            f"path={WEBDATASET!r} reads the tar shards named by data_files (e.g. 's3://bucket/{{00000..00099}}.tar', "
            "a folder, or a dict by split); got none"
        )
    if isinstance(data_files, dict):
        if split not in data_files:
            raise ValueError(f"data_files has no split {split!r}; its splits are {sorted(data_files)}")
        return data_files[split]
    if split != "train":
        raise ValueError(
            f"split {split!r}: data_files names one set of shards (the 'train' split); give a dict such as "
            f"{{'train': ..., {split!r}: ...}}"
        )
    return data_files


def indexed_shards(
    shards: str | list[str], cache_dir: str | None, storage_options: dict[str, Any] | None, allow_compressed: bool
) -> Shards:
    """The shards ``shards`` names, indexed (or their indexes read from ``cache_dir``): what
    ``prepare_data`` builds once per node, without the rows."""
    locations = shard_locations(shards, storage_options)
    return index_shards(locations, cache_dir, storage_options, allow_compressed=allow_compressed)
