"""Progress shown as it is: plain lines in a log file, and an epoch resumed halfway at its real length."""

from __future__ import annotations

from pathlib import Path

import pytest
from datamodules.callbacks.epoch_progress_bar import EpochProgressBar
from datamodules.callbacks.progress_lines import ProgressLines
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import TokenShardDataModule
from tests.support import RecordingModel, make_token_shards, quiet_trainer

SEQ_LEN, BATCH = 16, 4  # 40 windows: 10 batches an epoch


@pytest.fixture()
def halfway(tmp_path: Path) -> tuple[Path, Path]:
    """Shards of 10 batches an epoch, and a checkpoint at step 13: batch 3 of the second epoch."""
    shards = make_token_shards(tmp_path / "shards", 40 * SEQ_LEN + 1)
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=13)
    quiet_trainer(max_steps=13, callbacks=[saving]).fit(RecordingModel(), datamodule=datamodule(shards))
    return shards, tmp_path / "ckpt" / "epoch=1-step=13.ckpt"


def datamodule(shards: Path) -> TokenShardDataModule:
    return TokenShardDataModule(str(shards), seq_len=SEQ_LEN, batch_size=BATCH)


def test_a_bar_resumed_halfway_through_an_epoch_counts_to_the_epochs_length(halfway: tuple[Path, Path]) -> None:
    shards, checkpoint = halfway
    bar = EpochProgressBar()
    # Seven steps to go: Lightning's own bar took the steps left as the epoch's length, reading 10/6.
    trainer = quiet_trainer(max_steps=20, callbacks=[bar], enable_progress_bar=True)
    trainer.fit(RecordingModel(), datamodule=datamodule(shards), ckpt_path=checkpoint)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total) == (10, 10)
    assert task.description == "Epoch 1"  # max_epochs=-1 (max_steps bounds the fit): no "/-2"


def test_progress_lines_of_an_epoch_resumed_halfway_count_its_batches(
    halfway: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    shards, checkpoint = halfway
    trainer = quiet_trainer(max_steps=20, callbacks=[ProgressLines(every_n_steps=2)], enable_progress_bar=True)
    trainer.fit(RecordingModel(), datamodule=datamodule(shards), ckpt_path=checkpoint)
    lines = [line.split(" | ")[:3] for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert lines == [
        ["epoch 1", "batch 4/10", "step 14/20"],
        ["epoch 1", "batch 6/10", "step 16/20"],
        ["epoch 1", "batch 8/10", "step 18/20"],
        ["epoch 1", "batch 10/10", "step 20/20"],
    ]
