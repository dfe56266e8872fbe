"""The sampler every source shares: this rank's slice of each global micro-batch of plan positions.

It subclasses ``DistributedSampler`` so Lightning's default ``use_distributed_sampler=True`` passes it
through untouched (no second sharding, no re-created sampler).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.utils.data import Dataset, DistributedSampler


class PlanSampler(DistributedSampler):
    """Yields ``(first, stop)`` plan positions for this rank, one span per micro-batch.

    The plan is one stream of positions and an epoch is a stretch of it: each ``iter()`` starts at
    the position the training loop has consumed, ``P``. Global micro-batch ``s`` of the epoch covers
    positions ``[P + s*B*R, P + (s+1)*B*R)``; rank ``r`` reads its contiguous slice
    ``[P + s*B*R + r*B, ... + B)``. A fresh epoch is ``num_batches`` micro-batches. An epoch resumed
    from a checkpoint runs to the checkpoint's ``epoch_end``, rounded up to whole optimizer steps of
    this run (a resume on another number of ranks is off this run's grid), and at most
    ``num_batches``; the next epoch starts where it ended. So no position is skipped or padded, and
    every rank yields the same number of spans: DDP ranks never fall out of step.

    Args:
        dataset: the plan dataset (only its length is used by ``DistributedSampler``).
        batch_size: samples per rank per micro-batch.
        num_replicas: data-parallel size.
        rank: data-parallel rank.
        num_batches: micro-batches per epoch, a whole number of optimizer steps.
        start_position: returns the first position to serve when iteration starts.
        accumulate: micro-batches per optimizer step (the Trainer's ``accumulate_grad_batches``).
        epoch_end: the position where the epoch in progress ends (from a checkpoint); ``None``: the
            next ``iter()`` starts a fresh epoch.
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
        accumulate: int = 1,
        epoch_end: int | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.start_position = start_position
        self.accumulate = accumulate
        self.epoch_end = epoch_end
        self.batches_yielded = 0
        # This rank's spans (by first position) already trained out of order before a resume: not served again.
        self.skip: set[int] = set()

    @property
    def positions_per_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def __len__(self) -> int:
        return self.num_batches

    def resumes_epoch(self, start: int) -> bool:
        """Whether an iteration starting at ``start`` continues an epoch begun before it."""
        return self.epoch_end is not None and start < self.epoch_end

    def batches_left(self, start: int) -> int:
        """Micro-batches an iteration starting at ``start`` yields before its epoch ends."""
        if not self.resumes_epoch(start):
            return self.num_batches
        step = self.positions_per_batch * self.accumulate
        steps = -(-(self.epoch_end - start) // step)
        return min(steps * self.accumulate, self.num_batches)

    def position_after(self, start: int, batches: int) -> int:
        """The position reached ``batches`` micro-batches after ``start``, across epochs."""
        return start + batches * self.positions_per_batch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        start = self.start_position()
        count = self.batches_left(start)
        self.epoch_end = self.position_after(start, count)
        for batch in range(count):
            first = self.position_after(start, batch) + self.rank * self.batch_size
            if first in self.skip:
                continue
            self.batches_yielded += 1
            yield first, first + self.batch_size
