"""The metadata file written next to token shards, and its validation.

It states what a reader must never guess: the dtype, each shard's token count, document boundaries,
the tokenizer and a content hash that fingerprints the data for exact resume.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METADATA_FILE = "metadata.json"
DOCUMENT_STARTS_FILE = "document_starts.npy"
SUPPORTED_DTYPES = ("uint16", "uint32", "int32", "int64")


EDGE_BYTES = 4096  # a shard is recognised by its size and its first and last EDGE_BYTES bytes


@dataclass
class ShardInfo:
    file: str
    num_tokens: int
    num_documents: int = 0
    edges: str = ""  # digest of the file's first and last EDGE_BYTES bytes when it was written ("": not recorded)


def edge_ranges(data_offset: int, num_tokens: int, itemsize: int) -> list[tuple[int, int]]:
    """The byte ranges of a shard file that identify it: its first and last ``EDGE_BYTES`` bytes
    (the whole file, twice, when it is shorter)."""
    size = data_offset + num_tokens * itemsize
    return [(0, min(EDGE_BYTES, size)), (max(0, size - EDGE_BYTES), size)]


def edges_digest(first: bytes, last: bytes) -> str:
    return hashlib.blake2b(first + last, digest_size=8).hexdigest()


@dataclass
class ShardMetadata:
    """Everything a reader needs to interpret a directory of token shards."""

    dtype: str
    shards: list[ShardInfo]
    num_tokens: int
    num_documents: int
    tokenizer: str = ""
    # digest of the tokenizer's vocabulary and special tokens ("": prepared before it was recorded)
    tokenizer_hash: str = ""
    eos_id: int | None = None  # the token ending every document (the separator)
    bos_id: int | None = None  # the token starting every document, if one was added
    max_token_id: int = 0
    content_hash: str = ""
    document_starts: str | None = DOCUMENT_STARTS_FILE
    source_fingerprint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"metadata dtype {self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        self.shards = [s if isinstance(s, ShardInfo) else ShardInfo(**s) for s in self.shards]
        total = sum(s.num_tokens for s in self.shards)
        if total != self.num_tokens:
            raise ValueError(f"metadata num_tokens={self.num_tokens} but its shards hold {total} tokens")

    @classmethod
    def read(cls, directory: Path) -> ShardMetadata:
        path = (Path(directory) if isinstance(directory, str) else directory) / METADATA_FILE
        return cls.parse(path.read_text(), path)

    @classmethod
    def parse(cls, text: str | bytes, path: Path) -> ShardMetadata:
        """The metadata in ``text``, read from ``path`` (named by the error when it does not parse)."""
        try:
            return cls(**json.loads(text))
        except (TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot parse shard metadata {path}: {err}") from err

    def vocabulary(self) -> dict[str, Any] | None:
        """What the ids mean, for comparing sources (``same_tokenizer``); ``None`` when not recorded."""
        if not self.tokenizer:
            return None
        hashed = {"tokenizer_hash": self.tokenizer_hash} if self.tokenizer_hash else {}
        return {"tokenizer": self.tokenizer, "eos_id": self.eos_id, **hashed}

    def write(self, directory: Path) -> None:
        path = Path(directory) / METADATA_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)


def smallest_token_dtype(max_token_id: int) -> str:
    """uint16 when every id fits, else uint32."""
    return "uint16" if max_token_id < 2**16 else "uint32"
