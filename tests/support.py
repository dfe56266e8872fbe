"""Shared test fixtures: token shards built in the test and a model that records every batch."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules.text.shard_writer import ShardWriter
from datamodules.text.token_shards import TokenShards


def make_token_shards(
    directory: Path,
    num_tokens: int,
    shard_tokens: int | None = None,
    doc_len: int = 50,
    dtype: str = "uint32",
    first_value: int = 0,
) -> Path:
    """Shards whose token at stream offset ``t`` is ``first_value + t`` (a window names its position).

    Documents are ``doc_len`` tokens long (the last may be shorter); metadata is written as the
    prepare command writes it.
    """
    tokens = np.arange(first_value, first_value + num_tokens, dtype=np.int64)
    lengths = np.diff([*range(0, num_tokens, doc_len), num_tokens])
    writer = ShardWriter(directory, dtype, shard_tokens or num_tokens)
    writer.add(tokens, lengths)
    metadata = writer.close()
    metadata.max_token_id = first_value + num_tokens - 1
    metadata.write(directory)
    return directory


def all_tokens(shards: TokenShards) -> np.ndarray:
    """Every token of a shard stream, in order, as int64."""
    tokens = np.empty(shards.num_tokens, dtype=np.int64)
    shards.read_into(0, tokens)
    return tokens


def quiet_trainer(**kwargs: object) -> Trainer:
    """A CPU ``Trainer`` without logger, progress bar, summary or checkpoints unless asked for."""
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in kwargs.get("callbacks") or [])
    quiet = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    return Trainer(**{**quiet, "enable_checkpointing": checkpointing, **kwargs})


def fit_records(
    dm: LightningDataModule,
    max_steps: int,
    ckpt_dir: Path | None = None,
    resume: Path | None = None,
    every: int = 3,
    **trainer: object,
) -> list[dict]:
    """``Trainer.fit`` of a ``RecordingModel`` on ``dm`` for ``max_steps`` (a checkpoint every ``every``
    steps into ``ckpt_dir``, or resumed from ``resume``): the model's records, one per step."""
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1)] if ckpt_dir else []
    model = RecordingModel()
    quiet_trainer(max_steps=max_steps, callbacks=callbacks, **trainer).fit(model, datamodule=dm, ckpt_path=resume)
    return model.records


def fit_in_a_plain_script(datamodule: str, max_steps: int) -> tuple[str, list[list[str]]]:
    """Output of ``Trainer.fit`` on ``datamodule`` (an expression over ``datamodules``' names) in a fresh
    Python with no logging set up, and the data summary's table rows (header first) split in cells."""
    import sys
    import tempfile

    from tests import preloaded

    script = f"""
from lightning.pytorch import Trainer
from datamodules import *
from tests.support import RecordingModel
Trainer(max_steps={max_steps}, logger=False, enable_progress_bar=False, enable_checkpointing=False).fit(
    RecordingModel(), {datamodule})
"""
    done = preloaded.run([sys.executable, "-c", script], Path(tempfile.mkdtemp()))
    assert done.returncode == 0, done.stderr[-2000:]
    shown = done.stdout + done.stderr
    table = shown[shown.index("Source |") :].splitlines()
    return shown, [[cell.strip() for cell in line.split("|")] for line in (table[0], *table[2:])]


def make_mixture_shards(root: Path, sizes: dict[str, int], seq_len: int, value_stride: int) -> dict[str, Path]:
    """One shard directory per source; source ``i``'s token values start at ``i * value_stride``."""
    return {
        name: make_token_shards(root / name, windows * seq_len + 1, shard_tokens=333, first_value=i * value_stride)
        for i, (name, windows) in enumerate(sizes.items())
    }


def row_digest(row: torch.Tensor) -> str:
    """A short digest of one sequence's token ids (int64), to compare rows across processes."""
    return hashlib.sha1(row.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def batch_digest(batch: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for key in sorted(batch):
        h.update(key.encode())
        if not isinstance(batch[key], torch.Tensor):  # a count such as num_sequences
            h.update(repr(batch[key]).encode())
            continue
        value = batch[key].detach().cpu().contiguous()
        h.update((value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy().tobytes())
    return h.hexdigest()


def real_rows(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rows that take a loss (padding rows take none): by ``labels``, or by a speculator's ``loss_mask``."""
    if "labels" in batch:
        return (batch["labels"] != -100).any(dim=1)
    return (batch["loss_mask"] != 0).any(dim=1)


def sample_digests(batch: dict[str, torch.Tensor], real: torch.Tensor) -> list[str]:
    """A digest per sample in the real rows: per row, or per document of a packed row (``document_ids``)."""
    if "document_ids" not in batch:
        return [row_digest(row) for row in batch["input_ids"][real]]
    return [
        row_digest(tokens[documents == d])
        for tokens, documents in zip(batch["input_ids"][real], batch["document_ids"][real], strict=True)
        for d in range(int(documents.max()) + 1)
    ]


class RecordingModel(LightningModule):
    """A one-layer model that records, for every training batch, its digest, window starts and LR.

    Args:
        record_path: if given, each rank appends its records there as JSON lines
            (``{path}.rank{r}``), so records survive across processes and restarts.
    """

    def __init__(self, record_path: str | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.record_path = record_path
        self.records: list[dict] = []
        self.validation_rows: list[str] = []
        self.test_rows: list[str] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        real = real_rows(batch)
        record = {
            "step": self.global_step,
            "digest": batch_digest(batch),
            # Padding rows (no label at all) hold no sample: only real rows count as consumed.
            "starts": batch["input_ids"][real, 0].tolist(),
            "rows": sample_digests(batch, real),
            "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
        }
        self.records.append(record)
        if self.record_path:
            with open(f"{self.record_path}.rank{self.global_rank}", "a") as f:
                f.write(json.dumps(record) + "\n")
        x = (batch["input_ids"][:, :1].float() % 97) / 97
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.trainer.sanity_checking:  # a peek before training, not the evaluation
            return
        rows = sample_digests(batch, real_rows(batch))
        self.validation_rows += rows
        if self.record_path:
            with open(f"{self.record_path}.val.rank{self.global_rank}", "a") as f:
                f.write(json.dumps(rows) + "\n")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.test_rows += sample_digests(batch, real_rows(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def read_records(record_path: str | Path, rank: int) -> list[dict]:
    path = Path(f"{record_path}.rank{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged_rows(log_dir: str) -> dict[int, dict[str, str]]:
    """The CSV logger's rows merged by step (callbacks and the DataModule log separately)."""
    rows: dict[int, dict[str, str]] = {}
    with open(Path(log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v})
    return rows
