"""What describes a folder of token shards (``ShardLayout``) as a few compact arrays: read on global rank
0, sent to every rank in one broadcast, and kept in a per-node cache keyed by the folder's listing.

The arrays: ``names`` (each shard's path under the folder), ``dtypes`` and ``tags`` (its version's tag:
ETag, or local mtime) as fixed-width bytes; ``num_tokens``, ``offsets`` and ``sizes`` as int64;
``document_starts`` where known; ``facts``, one JSON string (dtype, fingerprint, vocabulary).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.plan.parallelism import pack_arrays, unpack_arrays
from datamodules.storage.locations import default_cache_dir, is_url

log = logging.getLogger(__name__)

# Raised when the arrays or what the layout readers compute change: a cache of another format is rebuilt.
FORMAT = 1
Version = tuple[int, str | None]  # (size, ETag or local mtime)


@dataclass(frozen=True)
class ShardFile:
    path: Path  # a pathlib.Path, or a UPath for a URL
    num_tokens: int
    offset: int  # byte offset of the first token inside the file (the .npy header)
    dtype: str


@dataclass
class ShardLayout:
    """What a layout reader finds: the shards in order, document starts, and the data's identity."""

    dtype: np.dtype
    shards: list[ShardFile]
    document_starts: np.ndarray | None
    fingerprint: str
    vocabulary: dict[str, Any] | None  # the tokenizer and EOS id that wrote the tokens, when recorded


def _fixed_width(strings: list[str]) -> np.ndarray:
    return np.array([s.encode() for s in strings], dtype=bytes)


def _strings(array: np.ndarray) -> list[str]:
    return [item.decode() for item in array.tolist()]


def layout_arrays(layout: ShardLayout, directory: Path, files: dict[str, Version]) -> dict[str, np.ndarray]:
    """``layout`` of the folder ``directory`` as arrays, with each shard's version from ``files`` (its listing)."""
    names = [str(shard.path.relative_to(directory)) for shard in layout.shards]
    facts = {"dtype": layout.dtype.name, "fingerprint": layout.fingerprint, "vocabulary": layout.vocabulary}
    arrays = {
        "facts": np.array(json.dumps(facts)),
        "names": _fixed_width(names),
        "dtypes": _fixed_width([shard.dtype for shard in layout.shards]),
        "num_tokens": np.array([shard.num_tokens for shard in layout.shards], dtype=np.int64),
        "offsets": np.array([shard.offset for shard in layout.shards], dtype=np.int64),
        "sizes": np.array([files[name][0] for name in names], dtype=np.int64),
        "tags": _fixed_width([files[name][1] or "" for name in names]),
    }
    if layout.document_starts is not None:
        arrays["document_starts"] = layout.document_starts.astype(np.int64)
    return arrays


def layout_from_arrays(arrays: dict[str, np.ndarray], directory: Path) -> tuple[ShardLayout, list[Version]]:
    """The layout of ``directory`` that ``arrays`` describe, and each shard's version."""
    facts = json.loads(str(arrays["facts"]))
    names, dtypes = _strings(arrays["names"]), _strings(arrays["dtypes"])
    shards = [
        ShardFile(directory / name, num_tokens, offset, dtype)
        for name, num_tokens, offset, dtype in zip(
            names, arrays["num_tokens"].tolist(), arrays["offsets"].tolist(), dtypes, strict=True
        )
    ]
    versions = [
        (size, tag or None) for size, tag in zip(arrays["sizes"].tolist(), _strings(arrays["tags"]), strict=True)
    ]
    layout = ShardLayout(
        np.dtype(facts["dtype"]), shards, arrays.get("document_starts"), facts["fingerprint"], facts["vocabulary"]
    )
    return layout, versions


class DescriptionCache:
    """Descriptions of shard folders kept on this node, one file per folder and ``file_pattern``, each
    holding the key of the listing it was read from: a listing that differs (an object added, removed,
    or changed: its size or ETag, or a local mtime) reads the folder again.

    Args:
        folder: where the files are kept; default ``$XDG_CACHE_HOME/datamodules/token_shards``.
    """

    def __init__(self, folder: str | None = None) -> None:
        self.folder = Path(folder or default_cache_dir("token_shards"))

    def path(self, directory: Path, file_pattern: str | None) -> Path:
        location = str(directory) if is_url(directory) else os.path.abspath(directory)
        name = hashlib.blake2b(f"{location}\0{file_pattern or ''}".encode(), digest_size=16).hexdigest()
        return self.folder / f"{name}.npz"

    @staticmethod
    def key(files: dict[str, Version], file_pattern: str | None) -> str:
        """What the description depends on: every listed file's name and version, and the options."""
        h = hashlib.blake2b(f"{FORMAT}\0{file_pattern or ''}".encode(), digest_size=16)
        for name in sorted(files):
            size, tag = files[name]
            h.update(f"\0{name}\0{size}\0{tag}".encode())
        return h.hexdigest()

    def read(self, directory: Path, file_pattern: str | None, key: str) -> dict[str, np.ndarray] | None:
        """The description of ``directory`` cached for the listing ``key``; ``None`` if there is none."""
        path = self.path(directory, file_pattern)
        try:
            arrays = unpack_arrays(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            log.warning("ignoring the unreadable shard description %s (%s); reading the folder again", path, err)
            return None
        return arrays if str(arrays.pop("listing_key", "")) == key else None

    def write(self, directory: Path, file_pattern: str | None, key: str, arrays: dict[str, np.ndarray]) -> None:
        """Keep ``arrays`` as the description of ``directory`` for the listing ``key`` (written under a
        temporary name, then renamed: a reader finds all of it or none)."""
        path = self.path(directory, file_pattern)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_bytes(pack_arrays({**arrays, "listing_key": np.array(key)}))
            os.replace(temporary, path)
        except OSError as err:  # a read-only or full disk: the next start reads the folder again
            log.warning("cannot cache the shard description at %s: %s", path, err)
