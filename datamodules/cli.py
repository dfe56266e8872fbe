"""LightningCLI entry point: ``python -m datamodules.cli fit --config configs/token_shards.yaml``."""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Any LightningModule and DataModule by ``class_path``, as the YAML names them."""
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
