"""LightningCLI entry point: ``python -m datamodules.cli fit --config configs/token_shards.yaml``."""

from __future__ import annotations

import logging
import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


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


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Any LightningModule and DataModule by ``class_path``, as the YAML names them. A bad path, option
    or dataset that this package's checks refuse ends the run with their one-line message (exit code
    2), not a traceback through Lightning."""
    show_datamodule_logs()
    try:
        return LightningCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
        )
    except (ValueError, OSError) as err:
        ours = raised_by_datamodules(err)
        if ours is None:
            raise
        print(f"error: {ours}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
