"""PhaseScheduler's learning-rate side: effective LR = scheduler LR x active lr_scale, every step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

from datamodules import PhaseScheduler, TokenShardDataModule
from tests.support import RecordingModel, make_token_shards, quiet_trainer

PHASES = [{"start_step": 4, "lr_scale": 0.5}, {"start_step": 9, "lr_scale": 0.1}]
STEPS = 14


def make_scheduler(name: str, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    sched = torch.optim.lr_scheduler
    return {
        "none": lambda: None,
        "lambda": lambda: sched.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)),
        "cosine": lambda: sched.CosineAnnealingLR(optimizer, T_max=STEPS),
        "onecycle": lambda: sched.OneCycleLR(optimizer, max_lr=1.0, total_steps=STEPS + 1),
        "plateau": lambda: sched.ReduceLROnPlateau(optimizer),
        "sequential": lambda: sched.SequentialLR(
            optimizer,
            [sched.LinearLR(optimizer, start_factor=0.1, total_iters=3), sched.CosineAnnealingLR(optimizer, T_max=10)],
            milestones=[3],
        ),
    }[name]()


class ScheduledModel(RecordingModel):
    def __init__(self, scheduler: str) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.used_lrs: list[float] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.used_lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = make_scheduler(self.scheduler, optimizer)
        if scheduler is None:
            return optimizer
        config = {"scheduler": scheduler, "interval": "step"}
        if self.scheduler == "plateau":
            config["monitor"] = "train_loss"
        return {"optimizer": optimizer, "lr_scheduler": config}


def train(shards: Path, scheduler: str, callbacks: list, logger: CSVLogger | bool = False) -> ScheduledModel:
    model = ScheduledModel(scheduler)
    dm = TokenShardDataModule(shards, seq_len=8, batch_size=2)
    trainer = quiet_trainer(max_steps=STEPS, logger=logger, callbacks=callbacks, log_every_n_steps=1)
    trainer.fit(model, datamodule=dm)
    return model


@pytest.mark.parametrize("scheduler", ["none", "lambda", "cosine", "onecycle", "sequential"])
def test_effective_lr_is_scheduled_lr_times_the_active_scale(tmp_path: Path, scheduler: str) -> None:
    shards = make_token_shards(tmp_path / "shards", 1000)
    reference = train(shards, scheduler, []).used_lrs
    logger = CSVLogger(tmp_path, name="logs")
    scaled = train(shards, scheduler, [PhaseScheduler(PHASES), LearningRateMonitor("step")], logger)
    scales = [1.0] * 4 + [0.5] * 5 + [0.1] * 5
    assert len(scaled.used_lrs) == STEPS
    assert scaled.used_lrs == pytest.approx([lr * s for lr, s in zip(reference, scales, strict=True)], rel=1e-6)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        monitored = [float(row["lr-SGD"]) for row in csv.DictReader(f) if row.get("lr-SGD")]
    assert monitored == pytest.approx(scaled.used_lrs, rel=1e-6)


def test_lr_scale_with_reduce_on_plateau_is_refused_not_silently_wrong(tmp_path: Path) -> None:
    shards = make_token_shards(tmp_path / "shards", 1000)
    with pytest.raises(ValueError, match="do not support ReduceLROnPlateau"):
        train(shards, "plateau", [PhaseScheduler(PHASES)])


def test_dataset_weights_on_a_single_source_datamodule_are_refused(tmp_path: Path) -> None:
    shards = make_token_shards(tmp_path / "shards", 1000)
    with pytest.raises(ValueError, match="sets dataset_weights .* TokenShardDataModule is not a mixture"):
        train(shards, "none", [PhaseScheduler(anneal_start_step=3, anneal_weights={"web": 0.5})])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"phases": [{"start_step": 5}, {"start_step": 5}]}, r"strictly increasing, got \[5, 5\]"),
        ({"phases": [{"start_step": 5, "lr_scale": 0.0}]}, "lr_scale must be a finite number > 0, got 0.0"),
        ({"phases": [{"start_step": 5, "lr_scale": float("nan")}]}, "lr_scale must be a finite number > 0"),
        ({"phases": [{"start_step": 5, "dataset_weights": {"a": -1.0}}]}, "weight for 'a' must be finite and >= 0"),
        ({"phases": [{"start_step": 5}], "anneal_start_step": 3}, "either phases or anneal_start_step"),
        ({"anneal_weights": {"a": 1.0}}, "anneal_weights needs anneal_start_step"),
        ({"phases": [{"start_step": -1}]}, "start_step must be an integer >= 0, got -1"),
    ],
)
def test_bad_phases_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PhaseScheduler(**kwargs)
