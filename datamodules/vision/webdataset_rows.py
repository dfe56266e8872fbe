"""WebDataset tar shards as rows of a table: each sample's chosen members, read by offset.

``WebDatasetRows`` answers ``len`` and ``rows[i]`` as a ``datasets.Dataset`` does, so the image-text
and video samples read it as they read any dataset: a row is a dict of the chosen fields, a media
field as ``{"bytes", "path"}`` (``path`` names the member: ``shard.tar:key.jpg``), a text field as a
string; a sample without one of the fields, or whose text is not UTF-8, is a ``BadSample``. A row is
one byte range of its shard, from its first tar header to the next sample's: one request per sample
(members not asked for, and any non-sample member before the next sample, are read and dropped: a
sample's members are found by their headers, which are read anyway), and ``prefetch`` requests a
micro-batch's ranges together. The rows' places come from the shards' node table (``IndexedShards``),
mapped: a process holds a few numbers per shard, not per sample.

A shard changed under the run is refused (``ChangedDuringRun``), never read by the old offsets: the
tar headers of the sample's members, found in the range, are checked against the index's digest; a
local shard's size and mtime are checked beside each read (one ``fstat``), a bucket's ETag by the GET
itself (``If-Match``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.plan.bad_samples import BadSample
from datamodules.plan.parallelism import Job
from datamodules.storage.locations import is_url
from datamodules.storage.range_reader import ChangedDuringRun, changed_message, read_range, read_unchanged
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles, range_key
from datamodules.storage.sample_table import IndexedShards
from datamodules.storage.tar_index import described_shards, index_shards
from datamodules.storage.tar_members import Member, TarWalk, headers_digest, key_and_field

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
    are given as bytes, the others as text; a media field taken from the ``.json`` is a list naming
    the sample's image members in order (an interleaved document's), each given as bytes."""

    def __init__(
        self, shards: IndexedShards, fields: dict[str, str], media: tuple[str, ...], files: RemoteFiles = LOCAL_FILES
    ) -> None:
        self.shards = shards
        self.reader = shards.reader  # remote shards' ranges, with their sizes and ETags recorded
        self.files = files  # its cache keeps remote samples' ranges
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
        empty = [location for number, location in enumerate(self.locations) if shards.samples_in(number) == 0]
        if empty:
            log.warning(
                "%d of %d tar shards hold no sample: %s%s", len(empty), len(self.locations), ", ".join(empty[:5]),
                f" and {len(empty) - 5} more" if len(empty) > 5 else "",
            )  # fmt: skip
        digest = hashlib.sha256(repr(sorted(fields.items())).encode())
        digest.update(shards.fingerprint.encode())  # the shards' members' names, sizes and places; ETags
        self._fingerprint = digest.hexdigest()[:32]

    def __len__(self) -> int:
        return len(self.shards)

    def describe(self, row: int) -> str:
        return f"{self.locations[int(self.shards.shard_of(row))]}:{self.shards.key(row)}"

    def file_keys(self, rows: np.ndarray) -> np.ndarray:
        """The ``range_key`` of each row's range in a shard in a bucket (0: a local shard), as the
        plan's next uses of a file cache know them."""
        shards, starts, ends = (column.tolist() for column in self.shards.spans(np.asarray(rows, dtype=np.int64)))
        paths = [self.read_locations[shard] for shard in shards]
        keys = [range_key(p, s, e) if is_url(p) else 0 for p, s, e in zip(paths, starts, ends, strict=True)]
        return np.array(keys, dtype=np.uint64)

    def prefetch(self, rows: list[int], uses: Any = None, positions: list[int] | None = None) -> None:
        """Read the rows' members now, together (one request per row, concurrent, adjacent rows of a
        shard merged; with a file cache, the rows it holds from there); the next ``self[row]`` of each
        takes them from memory. ``uses``, ``positions``: the plan's next uses and each row's position."""
        rows = [int(r) for r in rows]
        shards, starts, ends = (column.tolist() for column in self.shards.spans(np.array(rows, dtype=np.int64)))
        paths = [self.read_locations[shard] for shard in shards]
        remote = [i for i, path in enumerate(paths) if is_url(path)]
        spans = [b""] * len(rows)
        if remote:
            fetched = self.files.read_ranges(
                self.reader, *([column[i] for i in remote] for column in (paths, starts, ends)),
                uses, None if positions is None else [positions[i] for i in remote],
            )  # fmt: skip
            for i, span in zip(remote, fetched, strict=True):
                spans[i] = span
        for i, path in enumerate(paths):
            version = self.local_versions[shards[i]]
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

    def _members(self, row: int, span: bytes) -> dict[str, Member]:
        """The row's members in ``span`` by field (a field repeated keeps its first member), their
        headers checked against the index: a shard changed under the run is refused."""
        found: list[tuple[str, Member]] = []
        try:
            for member in TarWalk(io.BytesIO(span), len(span), f"row {row}"):
                parts = key_and_field(member.name)
                if parts is not None:
                    found.append((parts[1], member))
        except ValueError:  # no tar header where the sample starts
            found = []
        if not found or headers_digest(member for _, member in found) != self.shards.digest(row):
            shard, start, _ = (int(column[0]) for column in self.shards.spans(np.array([row])))
            raise ChangedDuringRun(
                changed_message(
                    self.locations[shard],
                    f"the tar header at byte {start} is no longer the one of its sample {self.shards.key(row)} "
                    "that the run indexed",
                )
            )
        members: dict[str, Member] = {}
        for field, member in found:
            members.setdefault(field, member)
        return members

    def _row(self, row: int, span: bytes) -> dict[str, Any]:
        members = self._members(row, span)
        out: dict[str, Any] = {}
        for field, choices in self.choices.items():
            picked = next(((name, json_name) for name, json_name in choices if name in members), None)
            if picked is None:
                wanted = " or ".join(f".{name}" for name, _ in choices)
                raise BadSample(f"it has no {wanted} member (its members: {', '.join(f'.{m}' for m in members)})")
            name, json_name = picked
            found = members[name]
            data = span[found.data : found.data + found.size]
            if field in self.media and json_name is None:
                out[field] = self._media(row, span, found, name)
            elif json_name is not None:
                try:
                    value = json.loads(data)
                except ValueError as err:
                    raise BadSample(f"its {name} member is not JSON ({err})") from None
                if not isinstance(value, dict):
                    raise BadSample(f"its {name} member is a JSON {type(value).__name__}, not an object")
                value = value.get(json_name)
                out[field] = self._named_members(row, span, members, value, name) if field in self.media else value
            else:
                try:
                    out[field] = data.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise BadSample(f"its {name} member is not UTF-8 text ({err})") from None
        return out

    def _media(self, row: int, span: bytes, member: Member, field: str) -> dict[str, Any]:
        """A media member as a media column's value: its bytes, and its path naming shard, key and field."""
        return {"bytes": span[member.data : member.data + member.size], "path": f"{self.describe(row)}.{field}"}

    def _named_members(self, row: int, span: bytes, members: dict[str, Member], value: Any, where: str) -> Any:
        """A ``.json`` list naming the sample's image members in document order (``["0.jpg", null,
        "1.png"]``, OBELICS's; or entries ``{"image": "0.jpg", ...}``, MMC4's), each name as the
        member's ``{"bytes", "path"}``; the sample's key before a name is optional."""

        def member(name: Any) -> Any:
            if not isinstance(name, str):
                return name
            field = name.removeprefix(f"{self.shards.key(row)}.").lower()
            if field not in members:
                raise BadSample(f"its {where} names member {name!r}, which it does not have")
            return self._media(row, span, members[field], field)

        if not isinstance(value, list):
            raise BadSample(f"its {where}'s image list is a {type(value).__name__}, not a list of member names")
        return [{**v, "image": member(v.get("image"))} if isinstance(v, dict) else member(v) for v in value]


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
    shards: str | list[str],
    cache_dir: str | None,
    storage_options: dict[str, Any] | None,
    allow_compressed: bool,
    job: Job | None = None,
) -> IndexedShards:
    """The shards ``shards`` names, indexed (or their indexes read from ``cache_dir``), without the
    rows: listed by the job's rank 0, indexed once for the job (``index_shards``)."""
    locations, versions = described_shards(shards, storage_options, job=job)
    return index_shards(
        locations, cache_dir, storage_options, allow_compressed=allow_compressed, versions=versions, job=job
    )
