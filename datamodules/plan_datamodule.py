"""The LightningDataModule base every plan-driven source shares: rank views, state and resume.

A subclass only builds its sources; slicing by rank, exact resume and plan checks live here.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from datamodules.parallelism import data_parallel_rank_and_size
from datamodules.plan_loader import PlanDataLoader, PlanDataset, Source
from datamodules.plan_sampler import PlanSampler
from datamodules.sample_plan import PlannedSource, SamplePlan, describe_changes

log = logging.getLogger(__name__)


class PlanDataModule(LightningDataModule):
    """Serves a source through the global sample plan.

    Its state is rank-agnostic: the plan positions the training loop has consumed plus the plan's
    fingerprint. Positions are counted from Lightning's own count of processed training batches, so
    prefetching loaders and worker processes never make the state run ahead of training.

    Args:
        batch_size: samples per data-parallel rank per micro-batch.
        seed: seed of the data order, separate from the model's seed.
        num_workers: DataLoader worker processes; the order does not depend on it.
        allow_plan_change: resume from a checkpoint whose plan differs (other data or seed),
            continuing at the saved position of the new plan instead of refusing.
    """

    def __init__(self, batch_size: int, seed: int = 0, num_workers: int = 0, allow_plan_change: bool = False) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.allow_plan_change = allow_plan_change
        self.plan: SamplePlan | None = None
        self._train: Source | None = None
        self._val: Source | None = None
        self._sampler: PlanSampler | None = None
        self._anchor_positions = 0
        self._anchor_batches: int | None = None
        self._pending_state: dict[str, Any] | None = None

    def build_sources(self) -> tuple[Source, Source | None]:
        """The training source and the validation source (or ``None``)."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self._train is None:
            self._train, self._val = self.build_sources()
            planned = PlannedSource("train", len(self._train), self._train.fingerprint)
            self.plan = SamplePlan((planned,), seed=self.seed)
            log.info("%s: %d training samples, plan %s", type(self).__name__, len(self._train), self.plan.fingerprint)
        self.dp_rank, self.dp_size = data_parallel_rank_and_size(self.trainer)
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)

    def _require_setup(self) -> Source:
        if self._train is None:
            raise RuntimeError(f"call {type(self).__name__}.setup('fit') before asking for a dataloader")
        return self._train

    def _batches_trained(self) -> int:
        fit_loop = getattr(self.trainer, "fit_loop", None)
        if fit_loop is not None:
            return fit_loop.epoch_loop.batch_progress.total.processed
        return self._sampler.batches_yielded if self._sampler is not None else 0

    @property
    def positions_consumed(self) -> int:
        """Plan positions trained so far, over all ranks and all restarts."""
        if self._anchor_batches is None or self._sampler is None:
            return self._anchor_positions
        trained = self._batches_trained() - self._anchor_batches
        return self._anchor_positions + trained * self._sampler.positions_per_batch

    def _start_position(self) -> int:
        # Anchored at the first iter(), after Lightning has restored its loop counters.
        if self._anchor_batches is None:
            self._anchor_batches = self._batches_trained()
        return self.positions_consumed

    def train_dataloader(self) -> DataLoader:
        train = self._require_setup()
        self._anchor_positions, self._anchor_batches = self.positions_consumed, None
        dataset = PlanDataset(train, self.plan)
        self._sampler = PlanSampler(
            dataset,
            batch_size=self.batch_size,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            num_batches=max(1, len(train) // (self.batch_size * self.dp_size)),
            start_position=self._start_position,
        )
        return PlanDataLoader(dataset, self._sampler, self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        self._require_setup()
        if self._val is None:
            return []
        val = self._val
        plan = SamplePlan((PlannedSource("val", len(val), val.fingerprint),), shuffle=False)
        dataset = PlanDataset(val, plan, limit=len(val))
        # Padding rows (no loss) keep every rank at the same batch count, each window seen once.
        sampler = PlanSampler(
            dataset,
            batch_size=self.batch_size,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            num_batches=math.ceil(len(val) / (self.batch_size * self.dp_size)),
            start_position=lambda: 0,
        )
        return PlanDataLoader(dataset, sampler, self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"positions_consumed": self.positions_consumed}
        if self.plan is not None:
            state.update(plan_fingerprint=self.plan.fingerprint, plan=self.plan.describe())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.plan is None:
            self._pending_state = state_dict
            return
        self._pending_state = None
        saved = state_dict.get("plan_fingerprint")
        if saved is not None and saved != self.plan.fingerprint:
            changes = describe_changes(state_dict.get("plan", {}), self.plan.describe()) or ["plan definition"]
            message = (
                f"{type(self).__name__}: the data plan differs from the checkpoint's ({'; '.join(changes)}). "
                "Resuming would not continue the same data order."
            )
            if not self.allow_plan_change:
                raise ValueError(message + " Pass allow_plan_change=True to resume on the new plan anyway.")
            log.warning(
                "%s Continuing at position %d because allow_plan_change=True.",
                message,
                state_dict["positions_consumed"],
            )
        self._anchor_positions = int(state_dict["positions_consumed"])
        self._anchor_batches = None
