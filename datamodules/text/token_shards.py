"""A directory of token shards read as one memory-mapped token stream.

Shards are ``.npy`` files (dtype in the header) or raw ``.bin`` files whose dtype comes from
``metadata.json``; a ``.bin`` without metadata is refused, never guessed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datamodules.text.shard_metadata import METADATA_FILE, ShardMetadata

log = logging.getLogger(__name__)

SHARD_SUFFIXES = (".npy", ".bin")


@dataclass(frozen=True)
class _Shard:
    path: str
    num_tokens: int
    offset: int  # byte offset of the first token inside the file (the .npy header)
    dtype: str


def _npy_layout(path: Path) -> tuple[np.dtype, int, int]:
    """dtype, token count and data offset of a 1-D ``.npy`` file, reading only its header."""
    array = np.load(path, mmap_mode="r")
    if array.ndim != 1:
        raise ValueError(f"token shard {path} must be 1-D, got shape {array.shape}")
    return array.dtype, int(array.shape[0]), int(array.offset)


class TokenShards:
    """The tokens of every shard in ``directory``, concatenated in order, read without loading them.

    Args:
        directory: folder holding ``.npy``/``.bin`` shards and, optionally, ``metadata.json``
            (required for ``.bin`` shards and for document boundaries).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"token shard directory {str(self.directory)!r} does not exist")
        self.metadata = ShardMetadata.read(self.directory) if (self.directory / METADATA_FILE).exists() else None
        self.dtype, self._shards = self._open_shards()
        sizes = np.array([s.num_tokens for s in self._shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self._starts[-1])
        self.document_starts = self._read_document_starts()
        self.fingerprint = self._fingerprint()
        self._maps: dict[int, np.ndarray] = {}

    def _open_shards(self) -> tuple[np.dtype, list[_Shard]]:
        if self.metadata is not None:
            names = [s.file for s in self.metadata.shards]
            dtype = np.dtype(self.metadata.dtype)
        else:
            names = sorted(p.name for p in self.directory.iterdir() if p.suffix in SHARD_SUFFIXES)
            dtype = None
            bins = [n for n in names if n.endswith(".bin")]
            if bins:
                raise ValueError(
                    f"{self.directory} holds raw .bin shards ({bins[0]}, ...) but no {METADATA_FILE}; "
                    "a .bin file does not record its dtype, so write metadata (python -m datamodules.text.prepare) "
                    "or convert the shards to .npy"
                )
        if not names:
            raise ValueError(f"no token shards (*.npy or *.bin) in {self.directory}")
        shards = []
        for i, name in enumerate(names):
            path = self.directory / name
            if not path.is_file():
                raise FileNotFoundError(f"shard {name!r} listed in {self.directory / METADATA_FILE} is missing")
            if path.suffix == ".npy":
                file_dtype, count, offset = _npy_layout(path)
                if dtype is None:
                    dtype = file_dtype
                if file_dtype != dtype:
                    raise ValueError(f"shard {path} has dtype {file_dtype}, expected {dtype}")
            else:
                size = path.stat().st_size
                if size % dtype.itemsize:
                    raise ValueError(
                        f"shard {path} is {size} bytes, not a multiple of the {dtype} item size {dtype.itemsize}"
                    )
                count, offset = size // dtype.itemsize, 0
            if self.metadata is not None and self.metadata.shards[i].num_tokens != count:
                raise ValueError(
                    f"shard {path} holds {count} tokens but {METADATA_FILE} says {self.metadata.shards[i].num_tokens}"
                )
            shards.append(_Shard(str(path), count, offset, dtype.name))
        if dtype.kind not in "iu":
            raise ValueError(f"token shards must hold integers, {self.directory} holds {dtype}")
        return dtype, shards

    def _read_document_starts(self) -> np.ndarray | None:
        if self.metadata is None or not self.metadata.document_starts:
            return None
        starts = np.load(self.directory / self.metadata.document_starts)
        if starts.ndim != 1 or (starts.size and (starts[0] != 0 or starts[-1] >= self.num_tokens)):
            raise ValueError(f"document starts in {self.directory} do not fit {self.num_tokens} tokens")
        return starts.astype(np.int64)

    def _fingerprint(self) -> str:
        if self.metadata is not None and self.metadata.content_hash:
            return self.metadata.content_hash
        # Without metadata, hash names, sizes and both ends of every shard: cheap for thousands of files.
        h = hashlib.blake2b(digest_size=16)
        for shard in self._shards:
            h.update(f"{Path(shard.path).name}:{shard.num_tokens}".encode())
            with open(shard.path, "rb") as f:
                h.update(f.read(4096))
                f.seek(max(0, shard.offset + shard.num_tokens * self.dtype.itemsize - 4096))
                h.update(f.read(4096))
        return h.hexdigest()

    @classmethod
    def concat(cls, parts: list[TokenShards]) -> TokenShards:
        """One stream of several shard directories, one after another (dtype: the widest)."""
        joined = cls.__new__(cls)
        offsets = np.cumsum([0] + [p.num_tokens for p in parts])
        joined.directory = parts[0].directory
        joined.metadata = None
        joined.dtype = np.result_type(*(p.dtype for p in parts))
        joined._shards = [shard for p in parts for shard in p._shards]
        joined._starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in joined._shards])])
        joined.num_tokens = int(offsets[-1])
        docs = [p.document_starts for p in parts]
        joined.document_starts = (
            None
            if any(d is None for d in docs)
            else np.concatenate([d + o for d, o in zip(docs, offsets, strict=False)])
        )
        joined.fingerprint = "+".join(p.fingerprint for p in parts)
        joined._maps = {}
        return joined

    def __getstate__(self) -> dict:
        # Memory maps are reopened lazily in each worker process instead of being pickled as arrays.
        return {**self.__dict__, "_maps": {}}

    def _map(self, i: int) -> np.ndarray:
        tokens = self._maps.get(i)
        if tokens is None:
            shard = self._shards[i]
            mm = np.memmap(shard.path, dtype=shard.dtype, mode="r", offset=shard.offset, shape=(shard.num_tokens,))
            # A plain ndarray view of the map (which it keeps alive): slicing an np.memmap costs
            # about 1 us more per slice, as much as copying a whole window.
            tokens = self._maps[i] = mm.view(np.ndarray)
        return tokens

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Copy tokens ``[start, start + len(out))`` of the stream into ``out``."""
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < out.shape[0]:
            local = start + done - int(self._starts[i])
            take = min(out.shape[0] - done, self._shards[i].num_tokens - local)
            out[done : done + take] = self._map(i)[local : local + take]
            done += take
            i += 1

    def read_windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Tokens ``[s, s + width)`` of the stream for each ``s`` in ``starts``, one row each."""
        out = np.empty((len(starts), width), dtype=self.dtype)
        # Shards are looked up for all rows at once, so a row inside one shard costs a single slice
        # copy; only a window that crosses into the next shard takes the general path.
        shard = np.searchsorted(self._starts, starts, side="right") - 1
        local = starts - self._starts[shard]
        for row, (i, lo) in enumerate(zip(shard.tolist(), local.tolist(), strict=True)):
            if lo + width <= self._shards[i].num_tokens:
                out[row] = self._map(i)[lo : lo + width]
            else:
                self.read_into(int(starts[row]), out[row])
        return out
