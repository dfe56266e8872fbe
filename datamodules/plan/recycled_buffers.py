"""``RecycledBuffers``: the memory of large batches, reused once nothing refers to it any more.

A batch of hidden states is megabytes a row. Made fresh each time, its pages are zeroed by the kernel at
first touch; made in a DataLoader worker, in shared memory (so the main process maps it instead of
receiving a copy), each page of tmpfs costs ~3 us to allocate: 8.6 ms for a row of 2,048 tokens x
3 x 1,024 bf16, twice the copying of the states into it. A buffer is reused only when no tensor
refers to it:

- In the process that reads its batches (no workers), a buffer is free when the pool holds the only
  reference to its storage (``_storage_Use_Count``: every tensor and view of it holds one).
- In a worker, references live in the main process. Each buffer travels with a ``Ticket`` (the
  worker's shared array of free flags, its slot, the buffer). Unpickled in the main process, the
  ticket keeps the buffer's storage aside, so every batch received counts, even one the DataLoader
  drops unseen when an iterator is abandoned; ``release_returned`` (called for every batch) sets the
  slot's flag once that is the only reference left, and the worker reuses a slot only while its flag
  is set. A slot is never written while any tensor in the main process can see it.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import torch

SLOTS = 8  # buffers per process; more in flight at once are made fresh (and not reused)

# In the main process: the storages of workers' buffers received, with their flags and slots.
_returned: list[tuple[torch.UntypedStorage, torch.Tensor, int]] = []
_returned_lock = threading.Lock()


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _whole(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class Ticket:
    """A worker's buffer on its way to the main process; it arrives there as ``None``, having set the
    buffer aside to be given back (``release_returned``)."""

    def __init__(self, free: torch.Tensor, slot: int, buffer: torch.Tensor) -> None:
        self.free, self.slot, self.buffer = free, slot, buffer

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _receive, (self.free, self.slot, self.buffer)


def _receive(free: torch.Tensor, slot: int, buffer: torch.Tensor) -> None:
    with _returned_lock:
        _returned.append((buffer.untyped_storage(), free, slot))


def release_returned() -> None:
    """Give back to their workers the buffers received that nothing in this process refers to any more."""
    # A flag received under inference mode (a validation or test batch) is an inference tensor, which
    # only inference mode may write: a training batch after it gives it back all the same.
    with _returned_lock, torch.inference_mode():
        kept = []
        for storage, free, slot in _returned:
            if _use_count(storage) == 1:
                free[slot] = 1
            else:
                kept.append((storage, free, slot))
        _returned[:] = kept


class RecycledBuffers:
    """Buffers of at least ``nbytes`` (``take``), reused once released; one pool per process."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._storages: list[torch.UntypedStorage] = []
        self._free: torch.Tensor | None = None  # in a worker: set by the main process when it lets go

    def __getstate__(self) -> dict[str, Any]:
        return {"slots": self.slots}  # a worker starts with a pool of its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.slots = state["slots"]
        self._reset()

    def take(self, nbytes: int, shared: bool) -> tuple[torch.Tensor, Ticket | None]:
        """A flat uint8 tensor of at least ``nbytes`` (in shared memory if ``shared``, as in a worker),
        and the ticket to send with it (``None`` when none is needed). The pool keeps the storage; the
        tensor, and every view made of it, refer to it apart."""
        if self._pid != os.getpid():  # a forked worker: the parent's buffers are not its own
            self._reset()
        if shared and self._free is None:
            self._free = torch.zeros(self.slots, dtype=torch.uint8).share_memory_()
        for slot, storage in enumerate(self._storages):
            if not (self._free[slot] if shared else _use_count(storage) == 1):
                continue
            if storage.nbytes() < nbytes:
                storage = self._storages[slot] = self._new(nbytes, shared)
            if shared:
                self._free[slot] = 0
            return self._lent(storage, slot, shared)
        storage = self._new(nbytes, shared)
        if len(self._storages) == self.slots:
            return _whole(storage), None  # every slot in use: a one-off
        self._storages.append(storage)
        return self._lent(storage, len(self._storages) - 1, shared)

    def _lent(self, storage: torch.UntypedStorage, slot: int, shared: bool) -> tuple[torch.Tensor, Ticket | None]:
        buffer = _whole(storage)
        return buffer, Ticket(self._free, slot, buffer) if shared else None

    @staticmethod
    def _new(nbytes: int, shared: bool) -> torch.UntypedStorage:
        return torch.UntypedStorage._new_shared(nbytes) if shared else torch.UntypedStorage(nbytes)


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name: (shape, dtype)


def _span(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return -(-math.prod(shape) * dtype.itemsize // 64) * 64  # each tensor aligned to 64 bytes


def nbytes_of(layout: Layout) -> int:
    return sum(_span(shape, dtype) for shape, dtype in layout.values())


def views(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Tensors of the shapes and dtypes in ``layout``, one after another in ``buffer``'s storage."""
    storage, tensors, offset = buffer.untyped_storage(), {}, 0
    for name, (shape, dtype) in layout.items():
        tensors[name] = torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, shape)
        offset += _span(shape, dtype)
    return tensors
