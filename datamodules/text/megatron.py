"""Megatron-LM's ``MMIDIDX`` index (``.idx`` beside a raw ``.bin``): dtype and document boundaries.

Layout (Megatron-Core ``indexed_dataset.py``): the 9-byte header ``MMIDIDX\\0\\0``; version ``<Q`` (1);
dtype code ``<B``; sequence count ``<Q``; document count ``<Q``; then ``int32`` sequence lengths,
``int64`` sequence byte offsets into the ``.bin``, and ``int64`` document indices (the first sequence
of each document, then the sequence count).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEAD_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # the header, version, dtype code and the two counts
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


@dataclass(frozen=True)
class MegatronIndex:
    """What a reader needs from an ``.idx``: the token dtype, the token count and document starts."""

    dtype: np.dtype
    num_tokens: int
    document_starts: np.ndarray  # token offset of every document inside the .bin


def read_index(path: str | Path) -> MegatronIndex:
    """Parse ``path``; a file that is not a version-1 ``MMIDIDX`` index is refused, naming it."""
    path = Path(path) if isinstance(path, str) else path  # a Path, or a UPath for a URL
    return parse_index(path.read_bytes(), path)


def parse_index(data: bytes, path: Path) -> MegatronIndex:
    """The index in ``data``, the bytes of ``path`` (named by the errors)."""
    head = data[:_HEAD_BYTES]
    if len(head) < _HEAD_BYTES or head[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise ValueError(f"{path} is not a Megatron MMIDIDX index (header {head[:9]!r})")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
    if version != 1:
        raise ValueError(f"{path}: Megatron index version {version} is not supported (only 1)")
    if code not in DTYPE_CODES:
        raise ValueError(f"{path}: unknown Megatron dtype code {code}; known: {DTYPE_CODES}")
    if len(data) < _HEAD_BYTES + 12 * sequences + 8 * documents:
        raise ValueError(f"{path} is truncated: it names {sequences} sequences and {documents} document indices")
    lengths = np.frombuffer(data, dtype="<i4", count=sequences, offset=_HEAD_BYTES)
    pointers = np.frombuffer(data, dtype="<i8", count=sequences, offset=_HEAD_BYTES + 4 * sequences)
    document_indices = np.frombuffer(data, dtype="<i8", count=documents, offset=_HEAD_BYTES + 12 * sequences)
    dtype = np.dtype(DTYPE_CODES[code])
    expected = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * dtype.itemsize
    if not np.array_equal(pointers, expected[: len(pointers)]):
        raise ValueError(f"{path}: sequences are not stored back to back in the .bin; this layout is not supported")
    sequence_starts = expected // dtype.itemsize
    # The last document index is the sequence count (the end), not the start of a document.
    firsts = document_indices[:-1] if len(document_indices) and document_indices[-1] == sequences else document_indices
    return MegatronIndex(dtype, int(lengths.astype(np.int64).sum()), sequence_starts[firsts].astype(np.int64))
