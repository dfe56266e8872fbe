"""Every YAML in configs/ runs with LightningCLI (a few steps, on data built in the test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from datamodules.cli import main
from tests.support import make_token_shards

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_fits_a_few_steps(tmp_path: Path, config: Path) -> None:
    shards = make_token_shards(tmp_path / "shards", 4000, doc_len=37)
    cli = main(
        [
            "fit",
            f"--config={config}",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
            "--trainer.callbacks.every_n_train_steps=3",
            f"--data.init_args.data_dir={shards}",
            "--data.init_args.seq_len=16",
            "--data.init_args.val_fraction=0.1",
        ]
    )
    assert cli.trainer.global_step == 3
    assert list((tmp_path / "ckpt").glob("*.ckpt"))
    assert cli.trainer.callback_metrics["val_loss"].isfinite()
