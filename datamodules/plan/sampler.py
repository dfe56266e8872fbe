"""The sampler every source shares: this rank's slice of each global micro-batch of plan positions.

It subclasses ``DistributedSampler`` so Lightning's default ``use_distributed_sampler=True`` passes it
through untouched (no second sharding, no re-created sampler).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.utils.data import Dataset, DistributedSampler


class PlanSampler(DistributedSampler):
    """Yields ``(first, stop)`` plan positions for this rank, one span per micro-batch.

    Global micro-batch ``s`` of an epoch covers positions ``[P + s*B*R, P + (s+1)*B*R)``; rank ``r``
    reads its contiguous slice ``[P + s*B*R + r*B, ... + B)``. Each ``iter()`` starts at the
    position the training loop has consumed and runs to the end of that epoch; every rank yields
    the same number of spans, so DDP ranks never fall out of step.

    Args:
        dataset: the plan dataset (only its length is used by ``DistributedSampler``).
        batch_size: samples per rank per micro-batch.
        num_replicas: data-parallel size.
        rank: data-parallel rank.
        num_batches: micro-batches per epoch.
        start_position: returns the first position to serve when iteration starts.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        num_replicas: int,
        rank: int,
        num_batches: int,
        start_position: Callable[[], int],
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.start_position = start_position
        self.batches_yielded = 0

    @property
    def positions_per_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[int, int]]:
        stride = self.positions_per_batch
        epoch_positions = self.num_batches * stride
        start = self.start_position()
        end = (start // epoch_positions + 1) * epoch_positions
        # Step over whole global micro-batches so every rank yields the same number of batches, even
        # when ``start`` is not a multiple of ``stride`` (a resume on a different number of ranks);
        # the last global batch may then run past ``end`` into the next epoch's positions.
        for batch_first in range(start, end, stride):
            first = batch_first + self.rank * self.batch_size
            self.batches_yielded += 1
            yield first, first + self.batch_size
