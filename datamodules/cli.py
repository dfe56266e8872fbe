"""LightningCLI entry point: ``python -m datamodules.cli fit --config configs/token_shards.yaml``."""

from __future__ import annotations

import logging

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


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Any LightningModule and DataModule by ``class_path``, as the YAML names them."""
    show_datamodule_logs()
    return LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
