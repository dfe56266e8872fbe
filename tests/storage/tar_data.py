"""Tar files written by ``tarfile`` in the test, for what webdataset's writer will not make (awkward
names, members out of order, truncation)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np


def tar_of(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar holding ``members`` (name, data) in the order given, written by ``tarfile``."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def tiny_shards(folder: Path, shards: int, per_shard: int) -> list[Path]:
    """``shards`` tars of ``per_shard`` samples each, written fast (a million samples in seconds: the
    headers stamped on a template by numpy): sample ``n`` is one member, ``{n:07d}.txt`` holding
    ``tiny_caption(n)`` in one block after its header."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        path = folder / f"shard-{shard:05d}.tar"
        with path.open("wb") as f:
            f.write(_captions(np.arange(shard * per_shard, (shard + 1) * per_shard)).tobytes())
            f.write(bytes(2 * tarfile.BLOCKSIZE))  # the end-of-archive blocks
        paths.append(path)
    return paths


def tiny_caption(n: int) -> str:
    return f"caption {n:07d} of a tiny sample"


def _captions(numbers: np.ndarray) -> np.ndarray:
    """The header and data block of member ``{n:07d}.txt`` for each of ``numbers``, as an array of shape
    ``(len(numbers), 2, 512)``: a template's header and data with ``n`` and the checksum stamped."""
    template = tarfile.TarInfo("0000000.txt")
    text = tiny_caption(0).encode()
    template.mtime, template.mode, template.size = 1_700_000_000, 0o644, len(text)
    out = np.zeros((len(numbers), 2, tarfile.BLOCKSIZE), dtype=np.uint8)
    out[:, 0] = np.frombuffer(template.tobuf(tarfile.USTAR_FORMAT), dtype=np.uint8)
    out[:, 1, : len(text)] = np.frombuffer(text, dtype=np.uint8)
    at = text.index(b"0000000")
    out[:, 0, :7] = out[:, 1, at : at + 7] = _digits(numbers, 10, 7)
    out[:, 0, 148:156] = ord(" ")  # the checksum is summed over the header with its own field as spaces
    out[:, 0, 148:154] = _digits(out[:, 0].sum(axis=1, dtype=np.int64), 8, 6)
    out[:, 0, 154] = 0
    return out


def _digits(values: np.ndarray, base: int, width: int) -> np.ndarray:
    """``values`` written in ``base`` with ``width`` ASCII digits each, zero-padded: ``(len(values), width)``."""
    powers = base ** np.arange(width - 1, -1, -1)
    return (values[:, None] // powers % base + ord("0")).astype(np.uint8)
