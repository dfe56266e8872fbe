"""``TokenShardDataModule``: pre-tokenized, memory-mapped token shards in fixed-length windows."""

from __future__ import annotations

import math
from pathlib import Path

from datamodules.plan_datamodule import PlanDataModule
from datamodules.token_shards import TokenShards
from datamodules.token_windows import TokenWindows


class TokenShardDataModule(PlanDataModule):
    """Trains on ``seq_len``-token windows of a directory of token shards.

    Args:
        data_dir: directory of ``.npy`` shards, or ``.bin`` shards with ``metadata.json``
            (written by ``python -m datamodules.prepare``).
        seq_len: tokens per sequence; each window reads ``seq_len + 1`` tokens.
        batch_size: sequences per data-parallel rank per micro-batch.
        val_dir: shards for validation; or use ``val_fraction``.
        val_fraction: hold out this fraction of the tokens (the tail of the stream) for
            validation, with no token shared with training. Default 0: no validation.
        pack_sequences: document-aware batches (``position_ids`` restart per document,
            ``document_ids``, no loss across a document boundary). Needs ``metadata.json``.
        seed: data-order seed. num_workers: DataLoader workers.
        allow_plan_change: see ``PlanDataModule``.

    Example::

        dm = TokenShardDataModule("shards/", seq_len=2048, batch_size=8, val_fraction=0.01)
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        batch_size: int,
        val_dir: str | Path | None = None,
        val_fraction: float = 0.0,
        pack_sequences: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
    ) -> None:
        super().__init__(batch_size, seed=seed, num_workers=num_workers, allow_plan_change=allow_plan_change)
        if seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if val_dir is not None and val_fraction > 0:
            raise ValueError(f"give val_dir ({val_dir}) or val_fraction ({val_fraction}), not both")
        # Paths as strings, so checkpoints stay loadable with torch.load(weights_only=True).
        data_dir, val_dir = str(data_dir), None if val_dir is None else str(val_dir)
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.val_dir = Path(val_dir) if val_dir is not None else None
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.pack_sequences = pack_sequences

    def build_sources(self) -> tuple[TokenWindows, TokenWindows | None]:
        shards = TokenShards(self.data_dir)
        windows = dict(seq_len=self.seq_len, pack_sequences=self.pack_sequences)
        if self.val_dir is not None:
            return TokenWindows(shards, **windows), TokenWindows(TokenShards(self.val_dir), **windows)
        if self.val_fraction == 0:
            return TokenWindows(shards, **windows), None
        split = shards.num_tokens - math.ceil(shards.num_tokens * self.val_fraction)
        return (
            TokenWindows(shards, last_token=split, **windows),
            TokenWindows(shards, first_token=split, **windows),
        )
