"""Every YAML in configs/ runs with LightningCLI (a few steps, on data built in the test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from datamodules.cli import main
from tests.support import make_token_shards

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_fits_a_few_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: Path) -> None:
    # The configs name the quickstart's shard folders relative to the working directory.
    monkeypatch.chdir(tmp_path)
    for name in ("stdlib", "pydoc"):
        make_token_shards(Path(f".cache/quickstart/shards_{name}"), 4000, doc_len=37)
    cli = main(
        [
            "fit",
            f"--config={config}",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=4",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.seq_len=16",
        ]
    )
    assert cli.trainer.global_step == 4
    assert list(Path(".cache/quickstart").glob("checkpoints*/*.ckpt"))
    assert all(v.isfinite() for k, v in cli.trainer.callback_metrics.items() if k.startswith("val_loss"))
    assert any(k.startswith("val_loss") for k in cli.trainer.callback_metrics)
