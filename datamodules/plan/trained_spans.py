"""Which micro-batches a rank has trained when its loader hands them over out of order
(``in_order=False``): the trained prefix of its spans plus the spans trained beyond it."""

from __future__ import annotations

from collections.abc import Iterable

from datamodules.plan.sampler import PlanSampler


class TrainedSpans:
    """This rank's trained micro-batches since ``anchor``, each named by its span's first position.

    Micro-batch ``j`` after ``anchor`` starts at ``sampler.position_after(anchor, j)`` plus this rank's
    offset; ``prefix`` counts the micro-batches ``0..prefix-1`` all trained, ``ahead`` holds the first
    positions of those trained past a gap (a batch still in flight when a later one arrived).

    Args:
        sampler: this rank's plan sampler (its grid of spans).
        anchor: the plan position the count starts at.
        trained: first positions of spans already trained past ``anchor`` (from a checkpoint).
    """

    def __init__(self, sampler: PlanSampler, anchor: int, trained: Iterable[int] = ()) -> None:
        self.sampler, self.anchor = sampler, anchor
        self.prefix = 0
        self.ahead = set(trained)
        self._close_gaps()

    def first_position(self, batch: int, rank: int | None = None) -> int:
        """The first position of micro-batch ``batch`` after the anchor on ``rank`` (default: this rank)."""
        rank = self.sampler.rank if rank is None else rank
        return self.sampler.position_after(self.anchor, batch) + rank * self.sampler.batch_size

    @property
    def position(self) -> int:
        """The plan position this rank has trained every span up to."""
        return self.sampler.position_after(self.anchor, self.prefix)

    def record(self, first: int) -> None:
        self.ahead.add(first)
        self._close_gaps()

    def _close_gaps(self) -> None:
        while (first := self.first_position(self.prefix)) in self.ahead:
            self.ahead.remove(first)
            self.prefix += 1

    def saved(self, ranks: dict[int, tuple[int, list[int]]]) -> tuple[int, list[list[int]]]:
        """From every rank's ``(prefix, ahead)``: ``(position every rank has trained up to, per rank
        the first positions of its spans trained past it)``, the state a resume starts from."""
        common = min(prefix for prefix, _ in ranks.values())
        trained = [
            [self.first_position(b, rank) for b in range(common, ranks[rank][0])] + sorted(ranks[rank][1])
            for rank in range(len(ranks))
        ]
        return self.sampler.position_after(self.anchor, common), trained
