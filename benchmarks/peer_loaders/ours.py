"""Ours: ``TokenShardDataModule`` over the ``.npy`` corpus, and ``MixtureDataModule`` over its two sources.

Both read the ``.npy`` shards as they are (no conversion). A checkpoint holds the plan position; a
state at step N is that position, so resuming seeks the plan instead of replaying anything. Exact
resume is checked through ``Trainer.fit`` and a checkpoint file, the path users run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from benchmarks.peer_loaders.protocol import Setup, Unsupported, digest
from datamodules import MixtureComponent, MixtureDataModule, TokenShardDataModule, TokenShardSource
from datamodules.plan.datamodule import PlanDataModule


def convert(corpus: Path, out: Path, seq_len: int) -> None:
    """Nothing to convert: the DataModules read the ``.npy`` shards."""


def datamodule(setup: Setup) -> PlanDataModule:
    corpus = Path(setup.corpus)
    options = dict(seq_len=setup.seq_len, batch_size=setup.batch_size, num_workers=setup.workers, seed=setup.seed)
    if not setup.mixture:
        return TokenShardDataModule(corpus / "all", **options)
    components = [
        MixtureComponent(f"source{i}", weight, TokenShardSource(str(corpus / f"source{i}")))
        for i, weight in enumerate(setup.weights)
    ]
    return MixtureDataModule(components, **options)


class Contender:
    def __init__(self, setup: Setup, state: dict[str, Any] | None) -> None:
        self.datamodule = datamodule(setup)
        self.datamodule.setup("fit")
        if state is not None:
            self.datamodule.load_state_dict(state)
        self._iterator: Any = None

    def batches(self) -> Iterator[torch.Tensor]:
        while True:
            self._iterator = iter(self.datamodule.train_dataloader())
            for batch in self._iterator:
                yield batch["input_ids"]

    def state_dict(self) -> dict[str, Any]:
        raise Unsupported("outside a Trainer the loader's prefetched batches are not known; see exact_resume")

    def close(self) -> None:
        self._iterator = None


def state_at(setup: Setup, step: int) -> tuple[dict[str, Any], str]:
    """The state a checkpoint at ``step`` holds: this plan's identity, the position moved on."""
    dm = datamodule(setup)
    dm.setup("fit")
    return {**dm.state_dict(), "positions_consumed": step * setup.batch_size}, "nothing (seeks the plan)"


class Recorder(LightningModule):
    """Trains nothing of note; keeps the digest of every batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.digests: list[str] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.digests.append(digest(batch["input_ids"]))
        return self.weight.sum() * 0.0 + self.weight.square().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(setup: Setup, max_steps: int, checkpoint: Path | None = None, resume: Path | None = None) -> list[str]:
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Recorder()
    trainer.fit(model, datamodule=datamodule(setup), ckpt_path=resume)
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    return model.digests


def exact_resume(setup: Setup, steps: int, stop: int) -> tuple[list[str], list[str]]:
    """Digests of ``steps`` batches through ``Trainer.fit``, and of ``stop`` batches, a checkpoint
    file, and a new ``Trainer.fit`` from it up to ``steps``."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "stop.ckpt"
        whole = fit(setup, steps)
        first = fit(setup, stop, checkpoint=checkpoint)
        return whole, first + fit(setup, steps, resume=checkpoint)
