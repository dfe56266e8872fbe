"""Streaming writer of token shards: ``.npy`` files of at most ``shard_tokens`` tokens, document
starts and the content hash, with memory bounded by one batch of documents, not by the corpus."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from datamodules.text.shard_metadata import DOCUMENT_STARTS_FILE, ShardInfo, ShardMetadata, edge_ranges, edges_digest

# A fixed-size .npy header (format 1.0), written first with a placeholder length and rewritten
# with the real one when the shard closes; 128 bytes keeps the data 64-byte aligned, as numpy does.
_HEADER_BYTES = 128
_MAGIC = b"\x93NUMPY\x01\x00"


def npy_header(dtype: np.dtype, num_tokens: int) -> bytes:
    """The header of a 1-D little-endian ``.npy`` array of ``num_tokens`` items of ``dtype``."""
    described = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (num_tokens,)})
    body = described.ljust(_HEADER_BYTES - len(_MAGIC) - 2 - 1) + "\n"
    return _MAGIC + struct.pack("<H", len(body)) + body.encode("latin1")


class ShardWriter:
    """Appends documents to ``shard_00000.npy, ...`` in ``directory``; ``close()`` returns the metadata.

    Args:
        directory: where shards and ``document_starts.npy`` go (created if missing).
        dtype: the stored token dtype (``uint16`` when the vocabulary fits, else ``uint32``).
        shard_tokens: tokens per shard file (the last one may hold fewer); documents may span files.
    """

    def __init__(self, directory: str | Path, dtype: np.dtype | str, shard_tokens: int) -> None:
        if shard_tokens <= 0:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.num_tokens = 0
        self._digest = hashlib.blake2b(digest_size=16)
        self._document_starts: list[np.ndarray] = []
        self._shards: list[ShardInfo] = []
        self._file: BinaryIO | None = None
        self._in_shard = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: their ``tokens`` one after another, and each one's length."""
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"document lengths sum to {int(lengths.sum())}, but {len(tokens)} tokens were given")
        self._document_starts.append(self.num_tokens + np.cumsum(lengths) - lengths)
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._digest.update(tokens.data)
        done = 0
        while done < len(tokens):
            if self._file is None:
                self._open_shard()
            take = min(len(tokens) - done, self.shard_tokens - self._in_shard)
            self._file.write(tokens[done : done + take].data)
            self._in_shard += take
            done += take
            if self._in_shard == self.shard_tokens:
                self._close_shard()
        self.num_tokens += len(tokens)

    def _open_shard(self) -> None:
        self._file = open(self.directory / f"shard_{len(self._shards):05d}.npy", "wb")  # noqa: SIM115
        self._file.write(npy_header(self.dtype, 0))
        self._in_shard = 0

    def _close_shard(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, self._in_shard))
        self._file.close()
        with open(self._file.name, "rb") as written:  # its edges, so a later overwrite is noticed
            ends = []
            for start, stop in edge_ranges(_HEADER_BYTES, self._in_shard, self.dtype.itemsize):
                written.seek(start)
                ends.append(written.read(stop - start))
        self._shards.append(ShardInfo(Path(self._file.name).name, self._in_shard, edges=edges_digest(*ends)))
        self._file = None

    def close(self) -> ShardMetadata:
        """Finish the last shard and write ``document_starts.npy``; the metadata is not written yet."""
        if self._file is not None:
            self._close_shard()
        starts = np.concatenate(self._document_starts) if self._document_starts else np.empty(0, dtype=np.int64)
        np.save(self.directory / DOCUMENT_STARTS_FILE, starts.astype(np.int64))
        bounds = np.cumsum([0] + [s.num_tokens for s in self._shards])
        for shard, lo, hi in zip(self._shards, bounds[:-1], bounds[1:], strict=True):
            shard.num_documents = int(np.searchsorted(starts, hi) - np.searchsorted(starts, lo))
        return ShardMetadata(
            dtype=self.dtype.name,
            shards=self._shards,
            num_tokens=self.num_tokens,
            num_documents=int(starts.size),
            content_hash=self._digest.hexdigest(),
        )
