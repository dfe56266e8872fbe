"""Time to open a directory of 1,000 token shards, with and without ``metadata.json``.

Opening reads each ``.npy`` header; without metadata it also hashes both ends of every shard for the
fingerprint. ``python -m benchmarks.shard_open [--quick]``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import (
    add_run_arguments,
    data_directory,
    report,
    results_directory,
    warm_page_cache,
    write_token_shards,
)
from datamodules import TokenShardDataModule, TokenShards
from datamodules.text.shard_metadata import METADATA_FILE, ShardInfo, ShardMetadata, edge_ranges, edges_digest


def write_metadata(directory: Path, paths: list[Path], tokens_per_shard: list[int]) -> None:
    """The ``metadata.json`` the prepare command would write (each shard's edges recorded, so opening
    checks them), without document boundaries."""
    content_hash = hashlib.blake2b(
        "".join(f"{p.name}:{n}" for p, n in zip(paths, tokens_per_shard, strict=True)).encode(), digest_size=16
    ).hexdigest()
    edges = []
    for path, count in zip(paths, tokens_per_shard, strict=True):  # as the prepare command records them
        with open(path, "rb") as f:
            np.lib.format.read_magic(f)
            np.lib.format.read_array_header_1_0(f)
            offset = f.tell()
            ends = []
            for start, stop in edge_ranges(offset, count, 2):
                f.seek(start)
                ends.append(f.read(stop - start))
        edges.append(edges_digest(*ends))
    ShardMetadata(
        dtype="uint16",
        shards=[ShardInfo(p.name, n, edges=e) for p, n, e in zip(paths, tokens_per_shard, edges, strict=True)],
        num_tokens=sum(tokens_per_shard),
        num_documents=0,
        content_hash=content_hash,
        document_starts=None,
    ).write(directory)


def median_seconds(open_once: Callable[[], object], repeats: int) -> tuple[float, float]:
    """``(first, median of the rest)`` wall seconds of ``open_once()``."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        open_once()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-shards", type=int, default=1000)
    parser.add_argument("--tokens-per-shard", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7, help="timed opens per variant, after the first")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_shards, args.tokens_per_shard, args.repeats = 50, 10_000, 2

    rows = []
    with data_directory(args.data_dir) as root:
        plain = root / "without_metadata"
        shutil.rmtree(plain, ignore_errors=True)
        paths = write_token_shards(plain, args.num_shards * args.tokens_per_shard, args.num_shards)
        described = root / "with_metadata"
        shutil.rmtree(described, ignore_errors=True)
        shutil.copytree(plain, described)
        write_metadata(described, sorted(described.glob("shard_*.npy")), [args.tokens_per_shard] * args.num_shards)
        warm_page_cache(paths + sorted(described.iterdir()))

        def setup_fit(directory: Path) -> None:
            TokenShardDataModule(directory, seq_len=2048, batch_size=8).setup("fit")

        for label, directory in (("without metadata.json", plain), (f"with {METADATA_FILE}", described)):
            for what, open_once in (
                ("TokenShards(dir)", lambda d=directory: TokenShards(d)),
                ("TokenShardDataModule(...).setup('fit')", lambda d=directory: setup_fit(d)),
            ):
                first, median = median_seconds(open_once, args.repeats)
                rows.append({"shards": label, "open": what, "first s": first, "median s": median})
                print(f"{label}, {what}: first {first:.3f}s, median {median:.3f}s")

    report(
        "shard_open",
        {
            f"Opening {args.num_shards:,} uint16 .npy shards (page cache warm)": (
                ["shards", "open", "first s", "median s"],
                rows,
            )
        },
        config={
            "num_shards": args.num_shards,
            "tokens_per_shard": args.tokens_per_shard,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        checks={
            f"{r['open']} {r['shards']} in < 2 s (first {r['first s']:.3f} s, median {r['median s']:.3f} s)": max(
                r["first s"], r["median s"]
            )
            < 2
            for r in rows
        },
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
