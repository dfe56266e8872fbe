"""Tokens per second out of ``MixtureDataModule``'s train loader against ``TokenShardDataModule`` on the same shards.

The shards are written once into ``all/``; ``source0/``, ``source1/``, ... hold symlinks to disjoint
runs of them, so the single-source loader (reading ``all/``) and the mixture (reading the source
folders) copy the same page-cached bytes. The two loaders are timed in alternating rounds and
compared by median: ``python -m benchmarks.mixture_throughput [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_run_arguments, cached_token_shards, data_directory, report, results_directory
from benchmarks.loader_throughput import endless, throughput
from datamodules import MixtureComponent, MixtureDataModule, TokenShardDataModule, TokenShardSource


def source_directories(directory: Path, paths: list[Path], num_sources: int) -> list[Path]:
    """``num_sources`` folders of symlinks splitting ``paths`` into consecutive, near-equal runs."""
    folders = []
    for i, run in enumerate(np.array_split(np.arange(len(paths)), num_sources)):
        folder = directory / f"source{i}"
        folder.mkdir(exist_ok=True)
        for stale in folder.iterdir():  # a kept --data-dir may hold links from another split
            stale.unlink()
        for k in run.tolist():
            (folder / paths[k].name).symlink_to(paths[k].resolve())
        folders.append(folder)
    # Both loaders must read the very same files, or the page cache would not be shared.
    linked = sorted(os.path.realpath(p) for f in folders for p in f.iterdir())
    assert linked == sorted(os.path.realpath(p) for p in paths), "source folders do not cover the shards once"
    return folders


def single(data_dir: Path, seq_len: int, batch_size: int, num_workers: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of ``TokenShardDataModule`` over every shard in ``data_dir``."""
    dm = TokenShardDataModule(data_dir, seq_len=seq_len, batch_size=batch_size, num_workers=num_workers)
    dm.setup("fit")
    return endless(dm.train_dataloader)


def mixture(
    folders: list[Path], weights: list[float], seq_len: int, batch_size: int, num_workers: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of ``MixtureDataModule``, one ``TokenShardSource`` per folder."""
    components = [
        MixtureComponent(f"source{i}", w, TokenShardSource(str(f)))
        for i, (f, w) in enumerate(zip(folders, weights, strict=True))
    ]
    dm = MixtureDataModule(components, seq_len=seq_len, batch_size=batch_size, num_workers=num_workers)
    dm.setup("fit")
    return endless(dm.train_dataloader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-tokens", type=int, default=200_000_000, help="tokens in all shards")
    parser.add_argument("--num-shards", type=int, default=6)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.5, 0.3, 0.2], help="one per source folder")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values to time")
    parser.add_argument("--rounds", type=int, default=9, help="alternating timed rounds per loader")
    parser.add_argument("--seconds", type=float, default=1.5, help="timed seconds per loader per round")
    parser.add_argument("--warmup", type=int, default=100, help="untimed batches per loader per round")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_tokens, args.rounds, args.seconds, args.warmup = 4_000_000, 2, 0.3, 5

    B, S = args.batch_size, args.seq_len
    rows = []
    with data_directory(args.data_dir) as directory:
        t0 = time.perf_counter()
        paths = cached_token_shards(directory / "all", args.num_tokens, args.num_shards)
        folders = source_directories(directory, paths, len(args.weights))
        print(f"{args.num_tokens:,} uint16 tokens in {len(paths)} shards ready in {time.perf_counter() - t0:.1f}s")

        for workers in args.workers:
            loaders = {
                "TokenShardDataModule (all shards)": single(directory / "all", S, B, workers),
                f"MixtureDataModule ({len(folders)} sources)": mixture(folders, args.weights, S, B, workers),
            }
            rates: dict[str, list[float]] = {name: [] for name in loaders}
            for r in range(args.rounds):
                # Alternate which loader goes first, so drift on the machine hits both alike.
                for name in list(loaders)[:: 1 if r % 2 == 0 else -1]:
                    # The warm-up also drains the batches the idle loader's workers prefetched.
                    rates[name].append(throughput(loaders[name], B * S, args.warmup, args.seconds)["tokens/s"])
            for batches in loaders.values():
                batches.close()  # ends the generator, so the loader's worker processes exit now
            base = statistics.median(next(iter(rates.values())))
            for name, tokens_per_s in rates.items():
                median = statistics.median(tokens_per_s)
                rows.append(
                    {
                        "loader": name,
                        "num_workers": workers,
                        "median M tokens/s": median / 1e6,
                        "of single-source": median / base,
                        "per round M tokens/s": " ".join(f"{t / 1e6:.0f}" for t in tokens_per_s),
                    }
                )
                print(f"num_workers={workers}, {name}: {median / 1e6:.1f}M tokens/s (median)")

    ratios = {r["num_workers"]: r["of single-source"] for r in rows if r["loader"].startswith("Mixture")}
    columns = ["loader", "num_workers", "median M tokens/s", "of single-source", "per round M tokens/s"]
    report(
        "mixture_throughput",
        {f"Tokens/s, batch {B} x {S} (B*S tokens counted per batch), median of {args.rounds} rounds": (columns, rows)},
        config={
            "num_tokens": args.num_tokens,
            "num_shards": args.num_shards,
            "weights": args.weights,
            "batch": f"{B}x{S}",
            "rounds": args.rounds,
            "seconds per loader per round": args.seconds,
            "warmup batches per round": args.warmup,
            "quick": args.quick,
        },
        checks={
            f"MixtureDataModule num_workers={w} >= 0.9 of TokenShardDataModule on the same shards ({ratio:.2f})": ratio
            >= 0.9
            for w, ratio in ratios.items()
        },
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
