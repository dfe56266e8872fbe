"""What a checkpoint of a streamed source gathers, across real gloo processes: every rank's readers
and leftovers reach global rank 0, which alone writes the checkpoint, and no other rank receives
another's (what a checkpoint costs a rank does not grow with the rank count)."""

from __future__ import annotations

import os

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from datamodules.plan.stream import gathered
from tests.distributed_support import free_port

WORLD = 3


def each_rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        leftovers = {rank: np.full(4, rank)}  # a rank's windows left over, say
        reads = rank != 2  # rank 2 a broadcast_within peer: it reads nothing of its own
        to_root = gathered(leftovers, reads)
        everywhere = gathered({rank: rank * 10}, everywhere=True)
        results[rank] = ({r: v.tolist() for r, v in to_root.items()}, everywhere)
    finally:
        dist.destroy_process_group()


def test_parts_reach_rank_zero_only_and_a_rank_that_does_not_read_gives_nothing() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(each_rank, args=(free_port(), results), nprocs=WORLD, start_method="fork")
        results = dict(results)
    assert results[0][0] == {0: [0] * 4, 1: [1] * 4}  # rank 2's stale part never wins
    assert results[1][0] == {1: [1] * 4}  # its own: nothing received
    assert results[2][0] == {}
    assert all(everywhere == {0: 0, 1: 10, 2: 20} for _, everywhere in results.values())
