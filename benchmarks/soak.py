"""Memory over a long run: each source's train loader, with 2 workers, for thousands of batches.

Each source is the one its ``configs/`` YAML builds (on the quickstart's default data, built first):
token shards, a mixture and a HuggingFace stream (20,000 batches each), image-text pairs, video clips
and cached hidden states (8,000 each). Each runs in a fresh process that iterates
``train_dataloader()`` epoch after epoch and, every 1% of its batches, sums the RSS and PSS
(``/proc/<pid>/smaps_rollup``) of its whole process tree: the main process and its DataLoader
workers. PSS splits each shared page among the processes that map it, so the tree's PSS is what it
really holds; RSS counts shared pages (the memory-mapped data, the forked interpreter) once per
process. A leak grows the anonymous and shared-memory part of the PSS (heap, and the shared memory
batches cross in); the file-backed part (libraries, memory-mapped data) is page cache the kernel
drops at will, and on a shared machine it moves when unrelated processes map or unmap the same
libraries (a torch process starting elsewhere lowers this tree's share of libtorch's pages).

The goal is no growth after warm-up (the first half of the batches, thousands of them; what it grew
in warm-up is shown): a least-squares slope of the tree's anonymous + shared-memory PSS below 1 MB per
1,000 batches; total PSS and RSS are reported beside it. ``python -m benchmarks.soak [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    ROOT,
    add_run_arguments,
    data_directory,
    descendants,
    memory_kb,
    report,
    result_of,
    results_directory,
)

# name: (config, batches in a full run, overrides)
SOURCES = {
    "token shards": ("token_shards", 20_000, ["--data.init_args.num_workers=2"]),
    "mixture": ("mixture_annealing", 20_000, ["--data.init_args.num_workers=2"]),
    "HF stream": ("hf_stream", 20_000, []),
    "image-text": ("image_text", 8_000, []),
    "video": ("video", 8_000, []),
    "hidden states": ("speculative", 8_000, []),
}
SLOPE_GOAL_MB = 1.0  # per 1,000 batches, after warm-up


def quick_inputs(workdir: Path) -> None:
    """What the smoke run's source (token shards) reads, at a small size (seconds to build): shards
    prepared from the pydoc topics."""
    from datamodules.text.prepare import prepare
    from examples.default_corpus import train_tokenizer, write_pydoc_topics

    topics = write_pydoc_topics(workdir / "pydoc_topics")
    tokenizer = train_tokenizer(topics, workdir / "tokenizer", vocab_size=1000)
    for name in ("stdlib", "pydoc"):
        if not (workdir / f"shards_{name}").exists():
            prepare([str(t) for t in topics], workdir / f"shards_{name}", str(tokenizer))


def tree_memory(root: int) -> tuple[float, float, float, int]:
    """RSS, PSS and anonymous + shared-memory PSS (what the kernel cannot drop: page cache is not in
    it) in MB summed over ``root`` and its descendants, and how many processes that is."""
    tree = [root, *descendants(root)]
    rss = pss = held = 0
    for pid in tree:
        try:
            fields = memory_kb(pid)
        except OSError:  # ended meanwhile
            continue
        rss, pss = rss + fields["Rss"], pss + fields["Pss"]
        held += fields.get("Pss_Anon", 0) + fields.get("Pss_Shmem", 0)
    return rss / 1024, pss / 1024, held / 1024, len(tree)


def slope_per_1000(batches: list[int], values: list[float]) -> float:
    return float(np.polyfit(np.array(batches, dtype=float) / 1000, np.array(values), 1)[0])


def soak_one(config: str, overrides: list[str], workdir: Path, batches: int, every: int) -> dict:
    """Iterate the config's train loader for ``batches`` batches (in this process), sampling memory."""
    from datamodules.cli import main

    os.chdir(workdir.parent.parent)  # the configs name .cache/quickstart/... relative to here
    cli = main(["--config", str(ROOT / "configs" / f"{config}.yaml"), *overrides], run=False)
    datamodule = cli.datamodule
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    samples: list[tuple[int, float, float, float, int]] = []
    done, epochs, start = 0, 0, time.perf_counter()
    while done < batches:
        for _ in loader:
            done += 1
            if done % every == 0:
                samples.append((done, *tree_memory(os.getpid())))
            if done >= batches:
                break
        epochs += 1
    seconds = time.perf_counter() - start
    warm = [s for s in samples if s[0] > batches // 2]
    counts = [s[0] for s in warm]
    return {
        "batches": done,
        "epochs": epochs,
        "seconds": seconds,
        "processes": max(s[4] for s in samples),
        "RSS after warm-up (MB)": warm[0][1],
        "RSS at end (MB)": warm[-1][1],
        "PSS after warm-up (MB)": warm[0][2],
        "PSS at end (MB)": warm[-1][2],
        "RSS slope (MB/1000 batches)": slope_per_1000(counts, [s[1] for s in warm]),
        "PSS slope (MB/1000 batches)": slope_per_1000(counts, [s[2] for s in warm]),
        "anon+shmem PSS at end (MB)": warm[-1][3],
        "anon+shmem growth in warm-up (MB)": warm[0][3] - samples[0][3],
        "anon+shmem slope (MB/1000 batches)": slope_per_1000(counts, [s[3] for s in warm]),
        "samples": [list(s) for s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_run_arguments(parser)
    parser.add_argument("--scale", type=float, default=1.0, help="batches per source, times this")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: soak one source, print RESULT
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    scale = 0.01 if args.quick else args.scale  # a smoke run: 200 and 100 batches, the fewest a source runs
    if args.one is not None:
        config, batches, overrides = SOURCES[args.one]
        batches = max(100, int(batches * scale))
        print("RESULT " + json.dumps(soak_one(config, overrides, args.workdir, batches, max(1, batches // 100))))
        return
    with data_directory(args.data_dir) as directory:
        workdir = directory / ".cache" / "quickstart"
        if args.quick:
            quick_inputs(workdir)
        else:
            from examples.quickstart import build_inputs

            build_inputs(workdir)
        rows, records = [], {}
        # A smoke run soaks one source: every source is the same measurement, in a fresh process.
        for name in ["token shards"] if args.quick else SOURCES:
            command = [sys.executable, "-m", "benchmarks.soak", "--one", name, "--workdir", str(workdir)]
            command += ["--scale", str(scale)]
            result = result_of(command, timeout=1800)
            records[name] = result
            row = {"source": name, **{k: v for k, v in result.items() if k != "samples"}}
            rows.append(row)
            print(f"{name}: {json.dumps(row)}", flush=True)
    columns = [
        "source",
        "batches",
        "epochs",
        "seconds",
        "processes",
        "anon+shmem growth in warm-up (MB)",
        "anon+shmem PSS at end (MB)",
        "anon+shmem slope (MB/1000 batches)",
        "PSS after warm-up (MB)",
        "PSS at end (MB)",
        "PSS slope (MB/1000 batches)",
        "RSS after warm-up (MB)",
        "RSS at end (MB)",
        "RSS slope (MB/1000 batches)",
        "error",
    ]
    checks = {
        f"{name}: anonymous + shared-memory PSS grows < {SLOPE_GOAL_MB} MB per 1,000 batches after warm-up": (
            "error" not in record and record["anon+shmem slope (MB/1000 batches)"] < SLOPE_GOAL_MB
        )
        for name, record in records.items()
    }
    config = {"num_workers": 2, "scale": scale, "warm-up": "first half of the batches", "quick": args.quick}
    tables = {"memory of the loader's process tree (main + 2 workers)": (columns, rows)}
    results = results_directory(args.results_dir, args.quick)
    report("soak", tables, config, checks, results)
    samples = {name: record.get("samples", []) for name, record in records.items()}
    columns = ["batches", "RSS MB", "PSS MB", "anon+shmem PSS MB", "processes"]
    (results / "soak_samples.json").write_text(json.dumps({"columns": columns, **samples}) + "\n")


if __name__ == "__main__":
    main()
