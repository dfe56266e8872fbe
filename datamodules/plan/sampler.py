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
        pad_to_epoch_end: when a start off the global-batch grid (a resume on another number of
            ranks) makes the epoch's last global batch run past the epoch end, serve the positions
            past it as padding rows (no loss), so the epoch ends exactly where the plan's does.
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
        pad_to_epoch_end: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.start_position = start_position
        self.pad_to_epoch_end = pad_to_epoch_end
        self.batches_yielded = 0
        # This rank's spans (by first position) already trained out of order before a resume: not served again.
        self.skip: set[int] = set()

    @property
    def positions_per_batch(self) -> int:
        return self.batch_size * self.num_replicas

    @property
    def epoch_positions(self) -> int:
        return self.num_batches * self.positions_per_batch

    def __len__(self) -> int:
        return self.num_batches

    def epoch_end(self, start: int) -> int:
        """The end of the plan epoch that position ``start`` falls in."""
        return (start // self.epoch_positions + 1) * self.epoch_positions

    def batches_left(self, start: int) -> int:
        """Micro-batches an iteration starting at ``start`` yields before its epoch ends."""
        return -(-(self.epoch_end(start) - start) // self.positions_per_batch)

    def position_after(self, start: int, batches: int) -> int:
        """The position reached ``batches`` micro-batches after ``start``, across epochs."""
        stride, left = self.positions_per_batch, self.batches_left(start)
        if not self.pad_to_epoch_end or batches < left:
            return start + batches * stride
        # The padded last batch of the first epoch ends at the epoch end; later epochs are whole batches.
        return self.epoch_end(start) + (batches - left) * stride

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        stride = self.positions_per_batch
        start = self.start_position()
        end = self.epoch_end(start)
        # Step over whole global micro-batches so every rank yields the same number of batches, even
        # when ``start`` is not a multiple of ``stride`` (a resume on a different number of ranks);
        # the last global batch then runs past ``end``: into the next epoch's positions, or as
        # padding rows when ``pad_to_epoch_end``.
        for batch_first in range(start, end, stride):
            first = batch_first + self.rank * self.batch_size
            if first in self.skip:
                continue
            self.batches_yielded += 1
            if self.pad_to_epoch_end and batch_first + stride > end:
                yield first, first + self.batch_size, end
            else:
                yield first, first + self.batch_size
