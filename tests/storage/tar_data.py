"""Tar files written by ``tarfile`` in the test, for what webdataset's writer will not make (awkward
names, members out of order, truncation)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def tar_of(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar holding ``members`` (name, data) in the order given, written by ``tarfile``."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
