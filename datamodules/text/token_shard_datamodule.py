"""``TokenShardDataModule``: pre-tokenized, memory-mapped token shards in fixed-length windows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datamodules.plan.arguments import require_int
from datamodules.plan.datamodule import PlanDataModule
from datamodules.text.token_shard_source import TokenShardSource
from datamodules.text.token_shards import IO_THREADS, PREFETCH_STEPS
from datamodules.text.token_windows import TokenWindows


class TokenShardDataModule(PlanDataModule):
    """Trains on ``seq_len``-token windows of a directory of token shards.

    Args:
        data_dir: directory of ``.npy`` shards, or ``.bin`` shards with ``metadata.json``
            (written by ``python -m datamodules.text.prepare``).
        seq_len: tokens per sequence; each window reads ``seq_len + 1`` tokens.
        batch_size: sequences per data-parallel rank per micro-batch.
        val_dir: shards for validation; or use ``val_fraction``.
        val_fraction: hold out this fraction of the tokens (the tail of the stream) for
            validation, with no token shared with training. Default 0: no validation.
        test_dir, test_fraction: the same for ``Trainer.test`` (a fraction is the very tail).
        pack_sequences: document-aware batches (``position_ids`` restart per document,
            ``document_ids``, no loss across a document boundary). Needs ``metadata.json``.
        file_pattern: glob choosing the shard files of a directory without ``metadata.json``.
        storage_options: for URL directories (``s3://bucket/corpus``, ``gs://``, ``hf://``, ...), the
            fsspec filesystem's options (endpoint, credentials, ``anon``); kept out of checkpoints.
        prefetch_steps: for a URL, micro-batches whose windows are requested in one round of
            concurrent range requests, the next round while the current one trains.
        io_threads: for a URL, range requests in flight at once per process (main or worker).
        file_cache_dir, file_cache_bytes, file_cache_policy: see ``TokenShardSource``.
        seed, num_workers, allow_plan_change, pin_memory, prefetch_factor, broadcast_within,
            split_sequence_for, sequence_split: see
            ``PlanDataModule``.

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
        file_pattern: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        broadcast_within: str | list[str] | None = None,
        split_sequence_for: str | list[str] | None = None,
        sequence_split: str = "head_tail",
        storage_options: dict[str, Any] | None = None,
        prefetch_steps: int = PREFETCH_STEPS,
        io_threads: int = IO_THREADS,
        test_dir: str | Path | None = None,
        test_fraction: float = 0.0,
        file_cache_dir: str | None = None,
        file_cache_bytes: int | None = None,
        file_cache_policy: str = "planned",
    ) -> None:
        super().__init__(
            batch_size,
            seed=seed,
            num_workers=num_workers,
            allow_plan_change=allow_plan_change,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            broadcast_within=broadcast_within,
            split_sequence_for=split_sequence_for,
            sequence_split=sequence_split,
        )
        require_int("seq_len", seq_len, 1)
        self.source = TokenShardSource(
            data_dir, val_dir, val_fraction, file_pattern, storage_options, prefetch_steps, io_threads, test_dir,
            test_fraction, file_cache_dir, file_cache_bytes, file_cache_policy,
        )  # fmt: skip
        # Paths as strings, so checkpoints stay loadable with torch.load(weights_only=True).
        data_dir, val_dir, test_dir = self.source.data_dir, self.source.val_dir, self.source.test_dir
        self.save_hyperparameters(ignore=["storage_options"])  # credentials stay out of checkpoints
        self.seq_len = seq_len
        self.pack_sequences = pack_sequences

    def sequence_length(self) -> int:
        return self.seq_len

    def source_specs(self) -> list[TokenShardSource]:
        return [self.source]

    test_options = "give it test_dir or test_fraction"

    def build_sources(self) -> list[tuple[str, TokenWindows, dict[str, TokenWindows]]]:
        return [("train", *self.source.build(self.seq_len, self.pack_sequences, self.job))]
