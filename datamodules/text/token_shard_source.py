"""``TokenShardSource``: a directory of token shards as a configured source, split into train/val."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from datamodules.plan.arguments import require_int
from datamodules.plan.loader import RankZero, SourceSpec
from datamodules.text.token_shards import IO_THREADS, PREFETCH_STEPS, TokenShards
from datamodules.text.token_windows import TokenWindows


@dataclass
class TokenShardSource(SourceSpec):
    """Token shards as training windows, with validation from a directory or a held-out tail.

    Args:
        data_dir: directory of ``.npy`` shards, or ``.bin`` shards with ``metadata.json``.
        val_dir: shards for validation; or use ``val_fraction``.
        val_fraction: hold out this fraction of the tokens (the tail of the stream) for
            validation, with no token shared with training. Default 0: no validation.
        file_pattern: glob choosing the shard files of a directory without ``metadata.json``
            (bare ``.npy``, or Megatron ``.idx``), e.g. ``"train_*.npy"``. Default: all of them.
        storage_options: for URL directories (``s3://bucket/corpus``), the fsspec filesystem's
            options: ``{"endpoint_url": ..., "key": ..., "secret": ...}``, ``{"anon": True}``.
        prefetch_steps: for a URL, micro-batches whose windows are requested in one round, the next
            round while the current one trains (per worker with workers): at least this many steps ahead.
        io_threads: for a URL, range requests in flight at once per process (main or worker).
    """

    data_dir: str
    val_dir: str | None = None
    val_fraction: float = 0.0
    file_pattern: str | None = None
    storage_options: dict[str, Any] | None = None
    prefetch_steps: int = PREFETCH_STEPS
    io_threads: int = IO_THREADS

    def __post_init__(self) -> None:
        require_int("prefetch_steps", self.prefetch_steps, 1)
        require_int("io_threads", self.io_threads, 1)
        # Paths as strings, so checkpoints stay loadable with torch.load(weights_only=True).
        self.data_dir = str(self.data_dir)
        self.val_dir = None if self.val_dir is None else str(self.val_dir)
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_dir is not None and self.val_fraction > 0:
            raise ValueError(f"give val_dir ({self.val_dir}) or val_fraction ({self.val_fraction}), not both")

    def build(
        self, seq_len: int, pack_sequences: bool, on_rank_zero: RankZero | None = None
    ) -> tuple[TokenWindows, TokenWindows | None]:
        reading = (self.file_pattern, self.storage_options, self.prefetch_steps, self.io_threads)
        shards = TokenShards(self.data_dir, *reading)
        val = None if self.val_dir is None else TokenShards(self.val_dir, *reading)
        return split_windows(shards, val, self.val_fraction, seq_len, pack_sequences)


def split_windows(
    shards: TokenShards, val: TokenShards | None, val_fraction: float, seq_len: int, pack_sequences: bool
) -> tuple[TokenWindows, TokenWindows | None]:
    """Training windows of ``shards`` and validation windows of ``val``, or of the held-out tail
    (``val_fraction`` of the tokens, starting at a token no training window reads)."""
    windows = {"seq_len": seq_len, "pack_sequences": pack_sequences}
    if val is not None:
        return TokenWindows(shards, **windows), TokenWindows(val, **windows)
    if val_fraction == 0:
        return TokenWindows(shards, **windows), None
    split = shards.num_tokens - math.ceil(shards.num_tokens * val_fraction)
    return TokenWindows(shards, last_token=split, **windows), TokenWindows(shards, first_token=split, **windows)
