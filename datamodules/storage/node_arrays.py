"""Arrays a node computes once and every process on it maps read-only (``node_arrays``).

A per-sample table that each rank and dataloader worker would otherwise compute and hold itself (a
packing of conversations into rows, the rows of a split) is written by the first process of the node
that needs it, under a file lock, as a folder of ``.npy`` files renamed into place whole: a process
sees all of it or none, and one killed while writing leaves only a hidden partial folder that the next
writer removes. The others wait on the lock, then map the files: their resident cost is shared page
cache, not private memory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from datamodules.storage.locations import default_cache_dir

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
_unwritable: set[str] = set()  # roots already warned about


def node_arrays(kind: str, name: str, make: Callable[[], Arrays]) -> Arrays:
    """The arrays ``make`` returns, computed once on this node: mapped read-only from
    ``<cache>/<kind>/<name>/`` (``default_cache_dir``) when that folder holds them, else made by this
    process (the others of the node wait for it) and written there first. ``name`` must change with
    anything that changes the arrays. Where the cache cannot be written, each process makes its own."""
    folder = Path(default_cache_dir(kind)) / name
    for _ in range(3):  # a folder pruned (``drop_node_arrays``) between the check and the map is made again
        try:
            if not folder.is_dir():
                _write(folder, make)
            return {path.stem: _map(path) for path in folder.glob("*.npy")}
        except _MakeFailed as failed:
            raise failed.__cause__ from None  # make's own error (bad input), not the cache's
        except FileNotFoundError:
            continue
        except OSError as error:
            root = str(folder.parent)
            if root not in _unwritable:
                _unwritable.add(root)
                log.warning("cannot share arrays through %s (%s): each process computes its own", root, error)
            return make()
    return make()


def is_mapped(array: np.ndarray | None) -> bool:
    """Whether ``array`` is one ``node_arrays`` mapped (not a process's own)."""
    return array is not None and isinstance(array.base, np.memmap)


def node_array_names(kind: str, folder: str) -> list[str]:
    """The names (``folder/<name>``) of the arrays the node holds under ``folder``, partial ones aside."""
    parent = Path(default_cache_dir(kind)) / folder
    if not parent.is_dir():
        return []
    return [f"{folder}/{path.name}" for path in parent.iterdir() if path.is_dir() and not path.name.startswith(".")]


def drop_node_arrays(kind: str, name: str) -> None:
    """Remove ``name``'s arrays from the node's cache (a process mapping them keeps its map)."""
    folder = Path(default_cache_dir(kind)) / name
    doomed = folder.with_name(f".{folder.name}.dropped-{uuid.uuid4().hex}")
    try:
        os.rename(folder, doomed)  # gone at once for every other process, never half deleted
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _write(folder: Path, make: Callable[[], Arrays]) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{folder.name}.lock"):
        if folder.is_dir():  # another process made them while this one waited
            return
        for stale in folder.parent.glob(f".{folder.name}.partial-*"):  # left by a writer that was killed
            shutil.rmtree(stale, ignore_errors=True)
        partial = folder.with_name(f".{folder.name}.partial-{uuid.uuid4().hex}")
        partial.mkdir()
        try:
            try:
                arrays = make()
            except Exception as error:
                raise _MakeFailed from error
            for key, array in arrays.items():
                np.save(partial / f"{key}.npy", np.asarray(array))
            os.rename(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


class _MakeFailed(Exception):
    pass


def _map(path: Path) -> np.ndarray:
    # A plain array over the map: numpy's memmap class costs microseconds an index.
    return np.load(path, mmap_mode="r").view(np.ndarray)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
