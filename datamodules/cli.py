"""LightningCLI entry point: ``python -m datamodules.cli fit --config configs/token_shards.yaml``."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from datamodules.callbacks.epoch_progress_bar import EpochProgressBar
from datamodules.callbacks.progress_lines import ProgressLines
from datamodules.cli_errors import ShortErrorParser, check_checkpoint_path, fail


def show_datamodule_logs() -> None:
    """INFO records of ``datamodules`` (what the data is, at the start of fit) on stderr, as Lightning's own."""
    logger = logging.getLogger("datamodules")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def raised_by_datamodules(err: BaseException | None) -> BaseException | None:
    """The error this package raised (a check of the user's input, whose message is the whole story)
    that ``err`` is or was raised while handling (jsonargparse wraps the errors of a class it builds)."""
    while err is not None:
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("datamodules"):
            return err if isinstance(err, (ValueError, OSError)) else None
        err = err.__cause__ or err.__context__
    return None


class DataModulesCLI(LightningCLI):
    """LightningCLI with one-line errors (``ShortErrorParser``, a checked ``ckpt_path``) and progress
    that shows in a log file (``progress_display``), unless the config chooses a bar or none."""

    def before_instantiate_classes(self) -> None:
        if self.subcommand is not None:
            check_checkpoint_path(self.config[self.subcommand].get("ckpt_path"))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = config.get("trainer") or {}
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        chosen = any(isinstance(c, ProgressBar) for c in callbacks) or trainer.get("enable_progress_bar") is False
        bar = None if chosen else progress_display()
        if bar is not None:
            kwargs["callbacks"] = [*callbacks, bar]
        return super().instantiate_trainer(**kwargs)


def progress_display() -> ProgressBar | None:
    """Plain lines off a terminal (a log file, a pipe), where a live bar shows nothing; on one, the rich
    bar with resumed epochs shown right (``None``, Lightning's default bar, without ``rich``)."""
    if not sys.stdout.isatty():
        return ProgressLines()
    return EpochProgressBar() if importlib.util.find_spec("rich") else None


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Any LightningModule and DataModule by ``class_path``, as the YAML names them. A bad path, option
    or dataset that this package's checks refuse ends the run with their one-line message (exit code
    2), not a traceback through Lightning."""
    show_datamodule_logs()
    try:
        return DataModulesCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_class=ShortErrorParser,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
        )
    except (ValueError, OSError) as err:
        ours = raised_by_datamodules(err)
        if ours is None:
            raise
        fail(str(ours))


if __name__ == "__main__":
    main()
