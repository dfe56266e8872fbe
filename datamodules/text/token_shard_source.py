"""``TokenShardSource``: a directory of token shards as a configured source, split into train/val."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from datamodules.plan.arguments import check_held_out, require_existing, require_int
from datamodules.plan.loader import SourceSpec
from datamodules.plan.parallelism import Job
from datamodules.storage.remote_files import RemoteFiles
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
        test_dir, test_fraction: the same for the test split (``Trainer.test``); a ``test_fraction``
            is the very tail, after the validation tail.
        file_pattern: glob choosing the shard files of a directory without ``metadata.json``
            (bare ``.npy``, or Megatron ``.idx``), e.g. ``"train_*.npy"``. Default: all of them.
        storage_options: for URL directories (``s3://bucket/corpus``), the fsspec filesystem's
            options: ``{"endpoint_url": ..., "key": ..., "secret": ...}``, ``{"anon": True}``.
        prefetch_steps: for a URL, micro-batches whose windows are requested in one round, the next
            round while the current one trains (per worker with workers): at least this many steps ahead.
        io_threads: for a URL, range requests in flight at once per process (main or worker).
        file_cache_dir, file_cache_bytes: for a URL, a node-local folder keeping the windows read
            (each its range of a shard, named by the shard's ETag), shared by the node's ranks and
            workers, and the most bytes it holds: a small source a mixture repeats, or a corpus
            trained for several epochs, is fetched once; default: no cache.
        file_cache_policy: which windows leave the cache when it is full: ``"planned"`` (default),
            the one the node's ranks read furthest ahead in the plan (one read later than all of those
            is not kept: Belady's rule); ``"lru"``, the least recently used.
    """

    data_dir: str
    val_dir: str | None = None
    val_fraction: float = 0.0
    file_pattern: str | None = None
    storage_options: dict[str, Any] | None = None
    prefetch_steps: int = PREFETCH_STEPS
    io_threads: int = IO_THREADS
    test_dir: str | None = None
    test_fraction: float = 0.0
    file_cache_dir: str | None = None
    file_cache_bytes: int | None = None
    file_cache_policy: str = "planned"

    def __post_init__(self) -> None:
        require_int("prefetch_steps", self.prefetch_steps, 1)
        require_int("io_threads", self.io_threads, 1)
        # Paths as strings, so checkpoints stay loadable with torch.load(weights_only=True).
        self.data_dir = str(self.data_dir)
        self.val_dir = None if self.val_dir is None else str(self.val_dir)
        self.test_dir = None if self.test_dir is None else str(self.test_dir)
        check_held_out(("val_dir", self.val_dir, "val_fraction", self.val_fraction))
        check_held_out(("test_dir", self.test_dir, "test_fraction", self.test_fraction), self.val_fraction)
        for option in ("data_dir", "val_dir", "test_dir"):
            require_existing(option, getattr(self, option))
        RemoteFiles(self.storage_options, self.file_cache_dir, self.file_cache_bytes, self.file_cache_policy)  # checked

    def build(
        self, seq_len: int, pack_sequences: bool, job: Job | None = None
    ) -> tuple[TokenWindows, dict[str, TokenWindows]]:
        files = RemoteFiles(self.storage_options, self.file_cache_dir, self.file_cache_bytes, self.file_cache_policy)
        reading = (self.file_pattern, self.storage_options, self.prefetch_steps, self.io_threads, job, files)
        shards = TokenShards(self.data_dir, *reading)
        val = None if self.val_dir is None else TokenShards(self.val_dir, *reading)
        test = None if self.test_dir is None else TokenShards(self.test_dir, *reading)
        return split_windows(shards, seq_len, pack_sequences, val, self.val_fraction, test, self.test_fraction)


def split_windows(
    shards: TokenShards,
    seq_len: int,
    pack_sequences: bool,
    val: TokenShards | None = None,
    val_fraction: float = 0.0,
    test: TokenShards | None = None,
    test_fraction: float = 0.0,
) -> tuple[TokenWindows, dict[str, TokenWindows]]:
    """Training windows of ``shards`` and the held-out splits: validation and test windows of their
    own shards (``val``, ``test``), or of held-out tails of the training tokens (``val_fraction``,
    then ``test_fraction`` at the very end), each starting at a token no earlier split reads."""
    windows = {"seq_len": seq_len, "pack_sequences": pack_sequences}
    total = shards.num_tokens
    tails = {
        "validation": math.ceil(total * val_fraction) if val is None else 0,
        "test": math.ceil(total * test_fraction) if test is None else 0,
    }
    end = total - sum(tails.values())
    given = (("val_fraction", val_fraction), ("test_fraction", test_fraction))
    fractions = ", ".join(f"{k}={v}" for k, v in given if v)
    counts = f"{total} tokens: {end} train" + "".join(f", {n} {role}" for role, n in tails.items() if n)
    detail = f" ({fractions} of {counts})" if fractions else ""
    train = TokenWindows(shards, last_token=end, split_name=f"the training split{detail}", **windows)
    held: dict[str, TokenWindows] = {}
    for role, own in (("validation", val), ("test", test)):
        if own is not None:
            held[role] = TokenWindows(own, split_name=f"the {role} split", **windows)
        elif tails[role]:
            name = f"the {role} split{detail}"
            held[role] = TokenWindows(shards, first_token=end, last_token=end + tails[role], split_name=name, **windows)
            end += tails[role]
    return train, held
