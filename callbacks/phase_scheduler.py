"""``PhaseScheduler``: data annealing. At step boundaries it reweights the mixture and scales the LR.

Its state (active phase, fingerprint of the phases already trained) rides in Lightning checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

log = logging.getLogger(__name__)

# Param-group key holding the LR as the LR scheduler sees it; it is saved with the optimizer state.
UNSCALED_LR = "phase_unscaled_lr"


@dataclass(frozen=True)
class Phase:
    """From optimizer step ``start_step`` on: these source weights (others keep their base weight)
    and the LR multiplied by ``lr_scale``."""

    start_step: int
    dataset_weights: dict[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.start_step, int) or self.start_step < 0:
            raise ValueError(f"phase start_step must be an integer >= 0, got {self.start_step!r}")
        if not (math.isfinite(self.lr_scale) and self.lr_scale > 0):
            raise ValueError(f"phase lr_scale must be a finite number > 0, got {self.lr_scale!r}")
        for name, weight in self.dataset_weights.items():
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"phase weight for {name!r} must be finite and >= 0, got {weight!r}")


def build_phases(
    phases: list[dict[str, Any]] | None,
    anneal_start_step: int | None,
    anneal_weights: dict[str, float] | None,
    anneal_lr_scale: float,
) -> list[Phase]:
    """Phases from the explicit list or the ``anneal_*`` shorthand, validated; phase 0 is implicit."""
    if phases and (anneal_start_step is not None or anneal_weights):
        raise ValueError("give either phases or anneal_start_step/anneal_weights, not both")
    if anneal_start_step is not None:
        phases = [
            {"start_step": anneal_start_step, "dataset_weights": anneal_weights or {}, "lr_scale": anneal_lr_scale}
        ]
    elif anneal_weights:
        raise ValueError("anneal_weights needs anneal_start_step")
    built = [p if isinstance(p, Phase) else Phase(**p) for p in phases or []]
    steps = [p.start_step for p in built]
    if any(b <= a for a, b in pairwise(steps)):
        raise ValueError(f"phase start_steps must be strictly increasing, got {steps}")
    if not built or built[0].start_step != 0:
        built.insert(0, Phase(0))
    return built


class PhaseScheduler(Callback):
    """Switches phases at exact optimizer steps: mixture weights and a learning-rate scale.

    The effective LR is always the LR scheduler's LR times the active ``lr_scale``: the scheduler
    sees the unscaled LR (restored right after each optimizer step), so scales never compound,
    whatever the scheduler. ``LearningRateMonitor`` reports the scaled LR. ``phase/index`` and
    ``phase/lr_scale`` are logged on the step they describe; a mixture logs its own per-source
    weights and counts.

    Phases already trained may not change on resume (refused with a message); phases that start
    after the resumed step may be edited, added or removed.

    Args:
        phases: list of ``{start_step, dataset_weights, lr_scale}``; ``dataset_weights`` may name a
            subset of the mixture's sources (the rest keep their base weight). Steps are optimizer
            steps (``trainer.global_step``), so gradient accumulation is respected.
        anneal_start_step: shorthand for one phase starting at this step ...
        anneal_weights: ... with these weights ...
        anneal_lr_scale: ... and this LR scale (default 1.0).

    Example::

        PhaseScheduler(anneal_start_step=9000, anneal_weights={"code": 0.0, "math": 3.0}, anneal_lr_scale=0.1)
    """

    def __init__(
        self,
        phases: list[dict[str, Any]] | None = None,
        anneal_start_step: int | None = None,
        anneal_weights: dict[str, float] | None = None,
        anneal_lr_scale: float = 1.0,
    ) -> None:
        self.phases = build_phases(phases, anneal_start_step, anneal_weights, anneal_lr_scale)
        self.active_phase = 0
        self._step = 0
        self._saved: dict[str, Any] | None = None
        self._hooked: set[int] = set()
        self._unscaled: set[int] = set()
        self._batch_step = 0

    def phase_at(self, step: int) -> int:
        """Index of the phase that step ``step`` trains in."""
        return max(i for i, p in enumerate(self.phases) if p.start_step <= step)

    def fingerprint(self, step: int) -> str:
        """Fingerprint of the phases that trained at least one step before ``step``."""
        trained = [asdict(p) for p in self.phases if p.start_step < step]
        return hashlib.blake2b(json.dumps(trained, sort_keys=True).encode(), digest_size=16).hexdigest()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        weighted = [p for p in self.phases if p.dataset_weights]
        datamodule = trainer.datamodule
        if weighted and not hasattr(datamodule, "set_phase_weights"):
            raise ValueError(
                f"phase at step {weighted[0].start_step} sets dataset_weights {weighted[0].dataset_weights}, but "
                f"{type(datamodule).__name__} is not a mixture; use MixtureDataModule or give only lr_scale"
            )
        if hasattr(datamodule, "set_phases"):
            datamodule.set_phases([asdict(p) for p in self.phases])

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if self._saved is not None and self._saved["fingerprint"] != self.fingerprint(self._saved["step"]):
            raise ValueError(
                f"PhaseScheduler: phases already trained (before step {self._saved['step']}) differ from the "
                f"checkpoint's {self._saved['phases']}; only phases starting at or after the resumed step may change"
            )
        if any(p.lr_scale != 1 for p in self.phases) and any(c.reduce_on_plateau for c in trainer.lr_scheduler_configs):
            # A plateau scheduler steps after validation, outside the optimizer step this relies on.
            raise ValueError("PhaseScheduler lr_scale phases do not support ReduceLROnPlateau; use lr_scale=1.0 there")
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group.setdefault(UNSCALED_LR, group["lr"])
            if id(optimizer) not in self._hooked:
                optimizer.register_step_post_hook(self._show_scheduler_unscaled_lr)
                self._hooked.add(id(optimizer))
        self._apply(trainer, step)

    def _show_scheduler_unscaled_lr(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Runs right after the optimizer step, before Lightning steps the LR scheduler: the scheduler
        # reads and writes its own, unscaled LR, so chainable schedulers never compound the scale.
        for group in optimizer.param_groups:
            group["lr"] = group[UNSCALED_LR]
        self._unscaled.add(id(optimizer))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Logged for the step this batch trained in (Lightning's row for it), not the step about to start.
        phase = self.phase_at(self._batch_step)
        pl_module.log_dict({"phase/index": float(phase), "phase/lr_scale": self.phases[phase].lr_scale})
        self._apply(trainer, trainer.global_step)

    def _apply(self, trainer: pl.Trainer, step: int) -> None:
        """Set every param group's LR to the scheduler's LR times the scale of the phase of ``step``."""
        phase = self.phase_at(step)
        if phase != self.active_phase:
            log.info("phase %d starts at step %d: %s", phase, step, self.phases[phase])
        self.active_phase, self._step = phase, step
        scale = self.phases[phase].lr_scale
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                if id(optimizer) in self._unscaled:
                    group[UNSCALED_LR] = group["lr"]
                group["lr"] = group[UNSCALED_LR] * scale
            self._unscaled.discard(id(optimizer))

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The checkpoint holds the scheduler's own (unscaled) LR; on resume the callback scales it again.
        for optimizer, saved in zip(trainer.optimizers, checkpoint.get("optimizer_states", []), strict=False):
            for group, saved_group in zip(optimizer.param_groups, saved.get("param_groups", []), strict=False):
                unscaled = group["lr"] if id(optimizer) in self._unscaled else group.get(UNSCALED_LR, group["lr"])
                saved_group["lr"] = saved_group[UNSCALED_LR] = unscaled

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "active_phase": self.active_phase,
            "step": self._step,
            "fingerprint": self.fingerprint(self._step),
            "phases": [asdict(p) for p in self.phases],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = state_dict
