"""``RecycledBuffers``: the memory of large batches, reused once nothing refers to it any more.

A batch of hidden states is megabytes a row. Made fresh each time, its pages are zeroed by the kernel at
first touch; made in a DataLoader worker, in shared memory (so the main process maps it instead of
receiving a copy), each page of tmpfs costs ~3 us to allocate: 8.6 ms for a row of 2,048 tokens x
3 x 1,024 bf16, twice the copying of the states into it. A buffer is reused only when no tensor
refers to it:

- In the process that reads its batches (no workers), a buffer is free when the pool holds the only
  reference to its storage (``_storage_Use_Count``: every tensor and view of it holds one).
- In a worker, references live in the main process. Each buffer travels with a ticket (the worker's
  shared array of free flags, and its slot); the main process keeps the batch's storage when it
  receives it (``hold``) and, once it holds the only reference, sets the slot's flag (``release``);
  the worker reuses a slot only while its flag is set. A slot is never written while any tensor in
  the main process can see it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

SLOTS = 8  # buffers per process; more in flight at once are made fresh (and not reused)


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _whole(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class RecycledBuffers:
    """Buffers of at least ``nbytes`` (``take``), reused once released; one pool per process."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._storages: list[torch.UntypedStorage] = []
        self._free: torch.Tensor | None = None  # in a worker: set by the main process when it lets go
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor, int]] = []  # main process: tickets received

    def __getstate__(self) -> dict[str, Any]:
        return {"slots": self.slots}  # a worker starts with a pool of its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.slots = state["slots"]
        self._reset()

    def take(self, nbytes: int, shared: bool) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """A flat uint8 tensor of at least ``nbytes`` (in shared memory if ``shared``, as in a worker),
        and the ticket the main process returns it with (``None`` when none is needed). The pool keeps
        the storage; the tensor, and every view made of it, refer to it apart."""
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
            return _whole(storage), self._ticket(slot, shared)
        storage = self._new(nbytes, shared)
        if len(self._storages) == self.slots:
            return _whole(storage), None  # every slot in use: a one-off
        self._storages.append(storage)
        return _whole(storage), self._ticket(len(self._storages) - 1, shared)

    @staticmethod
    def _new(nbytes: int, shared: bool) -> torch.UntypedStorage:
        return torch.UntypedStorage._new_shared(nbytes) if shared else torch.UntypedStorage(nbytes)

    def _ticket(self, slot: int, shared: bool) -> dict[str, Any] | None:
        return {"free": self._free, "slot": slot} if shared else None

    def hold(self, tensor: torch.Tensor, ticket: dict[str, Any] | None) -> None:
        """In the main process: ``tensor``'s storage came from a worker with ``ticket``; give it back
        once nothing else refers to it. Also gives back every held storage already let go."""
        if ticket is not None:
            self._held.append((tensor.untyped_storage(), ticket["free"], ticket["slot"]))
        self.release()

    def release(self) -> None:
        kept = []
        for storage, free, slot in self._held:
            if _use_count(storage) == 1:
                free[slot] = 1
            else:
                kept.append((storage, free, slot))
        self._held = kept


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
