"""``ProgressLines``: training progress as plain lines, for output that is not a terminal.

A live bar needs a terminal: Lightning's rich bar prints nothing into a log file or a pipe, and a
tqdm bar writes one endless line of carriage returns there.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from typing_extensions import override


def epoch_name(trainer: pl.Trainer) -> str:
    """``"epoch 3"``, or ``"epoch 3/9"`` where ``max_epochs`` bounds the fit (not ``-1``: max_steps does)."""
    epochs = trainer.max_epochs
    return f"epoch {trainer.current_epoch}" + (f"/{epochs - 1}" if epochs is not None and epochs > 0 else "")


def _count(done: int, total: int | float) -> str:
    return f"{done}/{total}" if math.isfinite(total) else str(done)


class ProgressLines(ProgressBar):
    """Prints a line every ``every_n_steps`` optimizer steps and one after each validation::

        epoch 1 | batch 13/28 | step 40/300 | 2.31 steps/s | train_loss=5.123 | v_num=0
        validation at step 100 | val_loss=4.210

    The batch count is the epoch's, of all its batches (a resumed epoch goes on from the batch it
    reached; one that ``max_steps`` ends early stops short); metrics are those logged with
    ``prog_bar=True``. Lines go to stdout, flushed, from global rank 0. The CLI
    (``python -m datamodules.cli``) uses it in place of the bar when stdout is not a terminal.

    Args:
        every_n_steps: a line every this many optimizer steps; default ``None``: the Trainer's
            ``log_every_n_steps``.

    Example::

        trainer = Trainer(max_steps=1000, callbacks=[ProgressLines(every_n_steps=100)])
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._last_line: tuple[int, float] | None = None  # (step, time) of the last line

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    def _metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str = "") -> list[str]:
        items = self.get_metrics(trainer, pl_module).items()
        return [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items if k.startswith(prefix)]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_line = (trainer.global_step, time.monotonic())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, every = trainer.global_step, self.every_n_steps or max(1, trainer.log_every_n_steps)
        last_step, last_time = self._last_line or (step, time.monotonic())
        if not self._enabled or step == last_step or step % every:
            return
        now = time.monotonic()
        steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else math.inf
        parts = [
            epoch_name(trainer),
            f"batch {_count(batch_idx + 1, trainer.num_training_batches)}",
            f"step {_count(step, steps)}",
            f"{(step - last_step) / max(now - last_time, 1e-9):.3g} steps/s",
            *self._metrics(trainer, pl_module),
        ]
        self._last_line = (step, now)
        print(" | ".join(parts), flush=True)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._enabled and not trainer.sanity_checking:
            metrics = self._metrics(trainer, pl_module, prefix="val")
            print(" | ".join([f"validation at step {trainer.global_step}", *metrics]), flush=True)
