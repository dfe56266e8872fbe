"""Where this process sits in the data-parallel group, read from the Trainer's strategy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

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


def computed_on_rank_zero(trainer: Any | None, make: Callable[[], T]) -> T:
    """``make()`` run on global rank 0 only, its value sent to every rank by the strategy's broadcast.

    Every rank must call it at the same point (it is a collective); without a Trainer or with one
    process, ``make()`` simply runs here.
    """
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or getattr(trainer, "world_size", 1) == 1:
        return make()
    return strategy.broadcast(make() if trainer.global_rank == 0 else None, src=0)
