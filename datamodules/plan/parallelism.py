"""Where this process sits in the job, read from the Trainer's strategy: its data-parallel rank,
and the collectives a source's setup uses to read what describes its data once per job."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def data_parallel_rank_and_size(trainer: Any | None) -> tuple[int, int]:
    """``(rank, size)`` of the data-parallel group, or ``(0, 1)`` without a Trainer.

    ``strategy.distributed_sampler_kwargs`` is the data-parallel view for DDP, FSDP and
    ModelParallel (tensor-parallel peers share a rank there); ``global_rank`` is not.
    """
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
    size = int(kwargs.get("num_replicas", 1))
    rank = int(kwargs.get("rank", 0))
    if not 0 <= rank < size:
        raise ValueError(f"data-parallel rank {rank} is outside a group of size {size}")
    return rank, size


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """Named numpy arrays as one ``.npz`` blob: what a collective sends instead of Python objects per item."""
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def unpack_arrays(blob: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as saved:
        return {name: saved[name] for name in saved.files}


@dataclass(frozen=True)
class RankZeroFailed:
    """What ``Job(make)`` broadcasts when ``make`` raised on rank 0: the error, raised on every rank."""

    error: Exception


def _sendable(err: Exception, rank: int) -> Exception:
    """``err``, or where it does not survive pickling, a ``RuntimeError`` with ``rank``, its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 (any failure to pickle: sent as text)
        return RuntimeError(f"on rank {rank}: {type(err).__name__}: {err}")
    return err


@dataclass(frozen=True)
class Job:
    """The processes of a job as a source's setup sees them, and its collectives (the strategy's
    process group). Calling it, ``job(make)``, runs ``make`` on global rank 0 and hands its value to
    every rank (or the error it raised, raised on every rank). Every collective must be called by every
    rank at the same point. Without a Trainer, or with one process, this process is the whole job and
    the collectives cost nothing."""

    trainer: Any | None = None

    @property
    def distributed(self) -> bool:
        return getattr(self.trainer, "strategy", None) is not None and getattr(self.trainer, "world_size", 1) > 1

    @property
    def rank(self) -> int:
        """Global rank."""
        return int(getattr(self.trainer, "global_rank", 0)) if self.distributed else 0

    @property
    def size(self) -> int:
        """Processes in the job (every rank, of every parallel dimension)."""
        return int(getattr(self.trainer, "world_size", 1)) if self.distributed else 1

    @property
    def nodes(self) -> int:
        """Machines in the job: what one node writes to its node-local folders, the others do not see."""
        return int(getattr(self.trainer, "num_nodes", 1)) if self.distributed else 1

    @property
    def local_rank(self) -> int:
        """Rank inside this node: rank 0 of a node writes its node-local files."""
        return int(getattr(self.trainer, "local_rank", 0)) if self.distributed else 0

    def __call__(self, make: Callable[[], T]) -> T:
        if not self.distributed:
            return make()
        if self.rank != 0:
            value = self.trainer.strategy.broadcast(None, src=0)
            if isinstance(value, RankZeroFailed):
                raise value.error
            return value
        try:
            value = make()
        except Exception as err:
            # The other ranks wait for the value: they are sent the error, and every rank stops with it.
            self.trainer.strategy.broadcast(RankZeroFailed(_sendable(err, 0)), src=0)
            raise
        return self.trainer.strategy.broadcast(value, src=0)

    def arrays_from_rank_zero(self, make: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """``make()``'s arrays, made on global rank 0 and broadcast as one compact blob."""
        if not self.distributed:
            return make()
        return unpack_arrays(self(lambda: pack_arrays(make())))

    def everywhere(self, make: Callable[[], T]) -> T:
        """``make()`` on every rank, each its own share of a collective piece of work; where it raises on
        any rank, every rank raises (its own error, or the first rank's that failed), so that no rank
        waits in a later collective for one that stopped."""
        try:
            value, error = make(), None
        except Exception as err:
            if not self.distributed:
                raise
            value, error = None, err
        failed = [e for e in self.all_gather(None if error is None else _sendable(error, self.rank)) if e is not None]
        if error is not None:
            raise error
        if failed:
            raise failed[0]
        return value  # type: ignore[return-value]

    def all_gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order (small values: a blob of arrays, a flag)."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered
