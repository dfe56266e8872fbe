"""The LightningDataModule base every plan-driven source shares: rank views, state and resume.

A subclass only builds its sources (and, for a mixture, its schedule); slicing by rank, exact
resume and plan checks live here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from datamodules.plan.loader import PlanDataLoader, PlanDataset, Source
from datamodules.plan.parallelism import data_parallel_rank_and_size
from datamodules.plan.sample_plan import PlannedSource, SamplePlan, Segment, describe_changes
from datamodules.plan.sampler import PlanSampler

log = logging.getLogger(__name__)


class PlanDataModule(LightningDataModule):
    """Serves sources through the global sample plan.

    Its state is rank-agnostic: the plan positions the training loop has consumed, the plan's
    fingerprint and, for a mixture, the schedule segments already trained. Positions are counted
    from Lightning's own count of processed training batches, so prefetching loaders and worker
    processes never make the state run ahead of training.

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
        self.sources: list[PlannedSource] | None = None
        self._train: Source | None = None
        self._vals: list[tuple[str, Source]] = []
        self._sampler: PlanSampler | None = None
        self._anchor_positions = 0
        self._anchor_batches: int | None = None
        self._saved_segments: list[Segment] = []
        self._pending_state: dict[str, Any] | None = None

    def build_sources(self) -> list[tuple[str, Source, Source | None]]:
        """``(name, train, val)`` of every source; ``val`` is ``None`` without validation."""
        raise NotImplementedError

    def plan_identity(self) -> dict[str, Any]:
        """What fixes the data order of the positions already trained; a resume must match it."""
        return {"seed": self.seed, "sources": [asdict(s) for s in self.sources]}

    def build_plan(self, position: int, step: int) -> SamplePlan:
        """The plan for a run whose next position is ``position`` at optimizer step ``step``."""
        return SamplePlan(tuple(self.sources), seed=self.seed)

    def setup(self, stage: str) -> None:
        if self._train is None:
            parts = self.build_sources()
            trains = [train for _, train, _ in parts]
            self._train = trains[0] if len(trains) == 1 else type(trains[0]).join(trains)
            self._vals = [(name, val) for name, _, val in parts if val is not None]
            self.sources = [PlannedSource(name, len(train), train.fingerprint) for name, train, _ in parts]
            log.info("%s: %s training samples", type(self).__name__, {s.name: s.num_samples for s in self.sources})
        self.dp_rank, self.dp_size = data_parallel_rank_and_size(self.trainer)
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)

    def _require_setup(self) -> Source:
        if self._train is None:
            raise RuntimeError(f"call {type(self).__name__}.setup('fit') before asking for a dataloader")
        return self._train

    @property
    def accumulate_grad_batches(self) -> int:
        return int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)

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
        step = getattr(self.trainer, "global_step", 0)
        self.plan = self.build_plan(self._anchor_positions, step)
        dataset = PlanDataset(train, self.plan)
        # Whole optimizer steps per epoch, so every global batch is one optimizer step.
        per_step = self.batch_size * self.dp_size * self.accumulate_grad_batches
        self._sampler = PlanSampler(
            dataset,
            batch_size=self.batch_size,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            num_batches=max(1, len(train) // per_step) * self.accumulate_grad_batches,
            start_position=self._start_position,
        )
        return PlanDataLoader(dataset, self._sampler, self.num_workers)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        self._require_setup()
        loaders = [self._val_loader(name, val) for name, val in self._vals]
        return loaders[0] if len(loaders) == 1 else loaders

    def _val_loader(self, name: str, val: Source) -> DataLoader:
        plan = SamplePlan((PlannedSource(name, len(val), val.fingerprint),), shuffle=False)
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

    def _fingerprint(self) -> str:
        return hashlib.blake2b(json.dumps(self.plan_identity(), sort_keys=True).encode(), digest_size=16).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"positions_consumed": self.positions_consumed}
        if self.sources is not None:
            state.update(plan_fingerprint=self._fingerprint(), plan=self.plan_identity())
        segments = self.plan.segments if self.plan is not None else self._saved_segments
        state["segments"] = [[s.first_position, s.block_size, list(s.counts)] for s in segments]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.sources is None:
            self._pending_state = state_dict
            return
        self._pending_state = None
        saved = state_dict.get("plan_fingerprint")
        if saved is not None and saved != self._fingerprint():
            changes = describe_changes(state_dict.get("plan", {}), self.plan_identity()) or ["plan definition"]
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
        self._saved_segments = [Segment(p, b, tuple(c)) for p, b, c in state_dict.get("segments", [])]
