"""Tokens per second out of ``TokenShardDataModule``'s train loader against a raw floor and a plain DataLoader.

All four contenders read the same page-cached uint16 shards in one run, so their ratios hold even
when the machine's absolute speed drifts: ``python -m benchmarks.loader_throughput [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import add_run_arguments, cached_token_shards, data_directory, report, results_directory
from datamodules import TokenShardDataModule


def floor_batches(paths: list[Path], batch_size: int, seq_len: int, seed: int = 0) -> Iterator[np.ndarray]:
    """nanoGPT's ``get_batch``: random windows copied from ``np.memmap`` into one preallocated int64 array."""
    maps = [np.load(p, mmap_mode="r") for p in paths]
    width = seq_len + 1
    out = np.empty((batch_size, width), dtype=np.int64)
    rng = np.random.default_rng(seed)
    limits = np.array([len(m) - width for m in maps])
    while True:
        # Random draws a thousand batches at a time, so the floor times copies, not the generator.
        shards = rng.integers(0, len(maps), size=(1024, batch_size))
        starts = (rng.random(shards.shape) * limits[shards]).astype(np.int64)
        for batch_shards, batch_starts in zip(shards.tolist(), starts.tolist(), strict=True):
            for row, (shard, start) in enumerate(zip(batch_shards, batch_starts, strict=True)):
                out[row] = maps[shard][start : start + width]
            yield out


class PlainWindows(Dataset):
    """The map-style dataset one writes first: one window per item, a dict of int64 tensors."""

    def __init__(self, paths: list[Path], seq_len: int) -> None:
        self.paths = paths
        self.seq_len = seq_len
        counts = [(len(np.load(p, mmap_mode="r")) - 1) // seq_len for p in paths]
        self.first_window = np.concatenate([[0], np.cumsum(counts)])
        self.maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.first_window[-1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.maps is None:  # opened on first use, in the process that reads
            self.maps = [np.load(p, mmap_mode="r") for p in self.paths]
        shard = int(np.searchsorted(self.first_window, index, side="right")) - 1
        start = (index - int(self.first_window[shard])) * self.seq_len
        window = self.maps[shard][start : start + self.seq_len + 1]
        return {
            "input_ids": torch.from_numpy(window[:-1].astype(np.int64)),
            "labels": torch.from_numpy(window[1:].astype(np.int64)),
        }


def endless(make: Callable[[], Any]) -> Iterator[Any]:
    """Batches from ``iter(make())``, starting a new iterator whenever an epoch ends."""
    loader = make()
    while True:
        yield from loader


def throughput(batches: Iterator[Any], tokens_per_batch: int, warmup: int, seconds: float) -> dict[str, float]:
    """Tokens/s over ``seconds`` of batches after ``warmup`` untimed ones (worker start-up, first reads)."""
    for _ in range(warmup):
        next(batches)
    count = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        next(batches)
        count += 1
    elapsed = time.perf_counter() - t0
    return {"batches": count, "seconds": elapsed, "tokens/s": count * tokens_per_batch / elapsed}


def ours(data_dir: Path, seq_len: int, batch_size: int, num_workers: int) -> Iterator[dict[str, torch.Tensor]]:
    dm = TokenShardDataModule(data_dir, seq_len=seq_len, batch_size=batch_size, num_workers=num_workers)
    dm.setup("fit")
    return endless(dm.train_dataloader)


def plain(paths: list[Path], seq_len: int, batch_size: int, num_workers: int) -> Iterator[dict[str, torch.Tensor]]:
    dataset = PlainWindows(paths, seq_len)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    return endless(lambda: loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-tokens", type=int, default=200_000_000, help="tokens in all shards")
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per contender")
    parser.add_argument("--warmup", type=int, default=50, help="untimed batches per contender")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_tokens, args.seconds, args.warmup = 4_000_000, 0.5, 5

    B, S, W = args.batch_size, args.seq_len, args.num_workers
    with data_directory(args.data_dir) as directory:
        t0 = time.perf_counter()
        paths = cached_token_shards(directory, args.num_tokens, args.num_shards)
        print(f"{args.num_tokens:,} uint16 tokens in {len(paths)} shards ready in {time.perf_counter() - t0:.1f}s")

        contenders = {
            "raw floor: np.memmap windows into a preallocated int64 array": floor_batches(paths, B, S),
            "TokenShardDataModule, num_workers=0": ours(directory, S, B, 0),
            f"plain DataLoader (map-style, dict per sample), num_workers={W}": plain(paths, S, B, W),
            f"TokenShardDataModule, num_workers={W}": ours(directory, S, B, W),
        }
        rows = []
        for name, batches in contenders.items():
            rows.append({"loader": name, **throughput(batches, B * S, args.warmup, args.seconds)})
            batches.close()  # ends the generator, so the loader's worker processes exit now
            print(f"{name}: {rows[-1]['tokens/s'] / 1e6:.1f}M tokens/s")

    floor, ours0, plain_w, ours_w = (row["tokens/s"] for row in rows)
    for row in rows:
        row["M tokens/s"] = row["tokens/s"] / 1e6
        row["of floor"] = row["tokens/s"] / floor
        row[f"vs plain DataLoader, {W} workers"] = row["tokens/s"] / plain_w
    columns = ["loader", "M tokens/s", "of floor", f"vs plain DataLoader, {W} workers", "batches", "seconds"]
    report(
        "loader_throughput",
        {f"Tokens/s, batch {B} x {S} (B*S tokens counted per batch)": (columns, rows)},
        config={
            "num_tokens": args.num_tokens,
            "num_shards": args.num_shards,
            "batch": f"{B}x{S}",
            "tokens counted per batch": B * S,
            "seconds per loader": args.seconds,
            "warmup batches": args.warmup,
            "quick": args.quick,
        },
        checks={
            f"TokenShardDataModule num_workers=0 >= 0.5 of the floor ({ours0 / floor:.2f})": ours0 >= 0.5 * floor,
            f"TokenShardDataModule num_workers={W} >= 5x the plain DataLoader ({ours_w / plain_w:.1f}x)": ours_w
            >= 5 * plain_w,
        },
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
