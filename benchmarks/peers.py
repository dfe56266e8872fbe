"""Ours against the loaders users would pick instead, on one token corpus, in one run.

``python -m benchmarks.peers`` (peers from ``pip install -e '.[bench]'``; Mosaic ``streaming``, whose
pins conflict with ours, is installed by this script into ``benchmarks/.venvs/mosaic`` and run
there). One corpus of uint16 tokens (200M by default, 4 ``.npy`` shards, two halves that are the two
sources of a 70/30 mixture), converted with each peer's own tooling, feeds:

- ours: ``TokenShardDataModule``, and ``MixtureDataModule`` over the two halves;
- litdata: ``optimize`` with ``TokensLoader``, ``StreamingDataset``/``StreamingDataLoader``, and
  ``CombinedStreamingDataset`` with weights;
- Mosaic streaming: MDS shards, ``StreamingDataset``, and two ``Stream`` proportions;
- torchdata's ``StatefulDataLoader`` and a plain ``DataLoader`` over a map-style ``np.memmap`` dataset;
- the raw floor: random windows copied from ``np.memmap`` into a preallocated array.

Every measurement is a fresh process (``benchmarks/peer_loaders/protocol.py``), and the contenders
alternate, in a rotated order, over ``--rounds`` rounds; medians are reported. Throughput, first
batch and peak memory come from one process per (contender, workers, round); resume at step 10^5
from another, at ``num_workers=0``; exact resume (digests of the batches after a stop and resume
against an uninterrupted run, at workers 0 and 2) and the mixture's per-batch deviation once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import add_run_arguments, data_directory, peer_venv, report, result_of, results_directory
from benchmarks.peer_loaders.corpus import write_corpus
from benchmarks.peer_loaders.protocol import Setup

MOSAIC_INSTALL = [["torch==2.14.1", "mosaicml-streaming==0.13.0"]]


@dataclass(frozen=True)
class Contender:
    label: str
    module: str  # benchmarks/peer_loaders/<module>.py
    mixture: bool = False
    ours: bool = False
    converts: bool = False  # writes the corpus in its own format first; the others read the .npy shards

    @property
    def peer(self) -> bool:
        return not self.ours and self.module != "floor"


CONTENDERS = [
    Contender("ours: TokenShardDataModule", "ours", ours=True),
    Contender("ours: MixtureDataModule 70/30", "ours", mixture=True, ours=True),
    Contender("litdata: StreamingDataset", "peer_litdata", converts=True),
    Contender("litdata: CombinedStreamingDataset 70/30", "peer_litdata", mixture=True, converts=True),
    Contender("Mosaic streaming: StreamingDataset", "peer_mosaic", converts=True),
    Contender("Mosaic streaming: 2 Streams 70/30", "peer_mosaic", mixture=True, converts=True),
    Contender("torchdata: StatefulDataLoader", "peer_torchdata"),
    Contender("plain DataLoader (hand-rolled skip to resume)", "peer_plain"),
    Contender("raw floor: np.memmap windows", "floor"),
]
# Allocator churn and the 50 ms sampling move "added MB" by a few MB between identical runs.
MEMORY_RESOLUTION_MB = 5
IMPORTS = {"peer_litdata": "litdata", "peer_mosaic": "streaming", "peer_torchdata": "torchdata"}


def interpreters(create_venvs: bool) -> dict[str, str | None]:
    """The Python that runs each contender module, or None where its library is not installed."""
    found: dict[str, str | None] = {}
    for module in dict.fromkeys(c.module for c in CONTENDERS):
        python = peer_venv("mosaic", MOSAIC_INSTALL, create_venvs) if module == "peer_mosaic" else sys.executable
        library = IMPORTS.get(module)
        if python is not None and library is not None:
            probe = subprocess.run([python, "-c", f"import {library}"], capture_output=True)
            python = python if probe.returncode == 0 else None
        found[module] = python
    return found


def task(python: str, module: str, setup: Setup, timeout: float, **fields: Any) -> dict[str, Any]:
    """One measurement in a fresh process; ``{"error": ...}`` with the peer's own message if it failed."""
    spec = json.dumps({"contender": module, "setup": asdict(setup), **fields})
    return result_of([python, "-W", "ignore", "-m", "benchmarks.peer_loaders.protocol", spec], timeout)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def chart(rows: list[dict[str, Any]], resume_rows: list[dict[str, Any]], workers: list[int], path: Path) -> None:
    """Tokens/s per contender and workers, and seconds to the first batch after resuming."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["loader"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 0.45 * len(labels) + 2), width_ratios=[3, 2])
    height = 0.8 / len(workers)
    for i, w in enumerate(workers):
        values = {r["loader"]: r["M tokens/s"] or 0 for r in rows if r["num_workers"] == w}
        ys = [y + i * height for y in range(len(labels))]
        left.barh(ys, [values.get(label, 0) for label in labels], height, label=f"num_workers={w}")
    left.set_yticks([y + height * (len(workers) - 1) / 2 for y in range(len(labels))], labels)
    left.invert_yaxis()
    left.set_xlabel("M tokens/s (median)")
    left.legend()
    resumed = [r for r in resume_rows if r["resume s"] is not None]
    right.barh([r["loader"] for r in resumed], [r["resume s"] for r in resumed], color="tab:green")
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("s to the first batch after resuming (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-tokens", type=int, default=200_000_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per throughput measurement")
    parser.add_argument("--warmup", type=int, default=20, help="untimed batches before timing")
    parser.add_argument("--resume-step", type=int, default=10**5)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--no-venvs", action="store_true", help="do not create the Mosaic venv if it is missing")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_tokens, args.rounds, args.seconds, args.warmup, args.seq_len = 2_000_000, 1, 0.3, 2, 256
    started = time.perf_counter()
    pythons = interpreters(create_venvs=not (args.quick or args.no_venvs))
    missing = {c.module for c in CONTENDERS if pythons[c.module] is None}
    if missing:
        print(f"not installed, left out: {sorted(missing)} (pip install -e '.[bench]')", flush=True)

    with data_directory(args.data_dir) as directory:
        corpus = write_corpus(directory / "corpus", args.num_tokens)
        base = Setup(data="", corpus=str(corpus), seq_len=args.seq_len, batch_size=args.batch_size)

        def setup(c: Contender, workers: int) -> Setup:
            data = str(directory / f"{c.module}-{args.num_tokens}-{args.seq_len}")
            return Setup(**{**asdict(base), "data": data, "workers": workers, "mixture": c.mixture})

        present = [c for c in CONTENDERS if pythons[c.module] is not None]
        converted: dict[str, Any] = {}
        for c in present:
            if not c.converts or c.module in converted:
                continue
            marker = Path(setup(c, 0).data) / "converted.json"
            if marker.exists():
                converted[c.module] = json.loads(marker.read_text())
                continue
            print(f"converting for {c.module}...", flush=True)
            result = task(pythons[c.module], c.module, setup(c, 0), 3600, task="convert")
            if "error" not in result:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(json.dumps(result))
            converted[c.module] = result
        present = [c for c in present if "error" not in converted.get(c.module, {})]

        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        resumes: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            order = present[r % len(present) :] + present[: r % len(present)]  # rotated, so drift hits all alike
            for workers in args.workers:
                for c in order:
                    if c.module == "floor" and workers:
                        continue
                    fields = {"task": "run", "warmup": args.warmup, "seconds": args.seconds}
                    result = task(pythons[c.module], c.module, setup(c, workers), 600, **fields)
                    runs.setdefault((c.label, workers), []).append(result)
                    print(f"round {r + 1} workers={workers} {c.label}: {_brief(result)}", flush=True)
            for c in order:
                if c.module == "floor":
                    continue
                result = task(pythons[c.module], c.module, setup(c, 0), 600, task="resume", step=args.resume_step)
                resumes.setdefault(c.label, []).append(result)
                print(f"round {r + 1} resume {c.label}: {_brief(result)}", flush=True)

        exact: dict[tuple[str, int], dict[str, Any]] = {}
        for c in present:
            for workers in args.workers:
                if c.module == "floor":
                    continue
                exact[(c.label, workers)] = task(
                    pythons[c.module], c.module, setup(c, workers), 600, task="exact", steps=12, stop=5
                )
                print(f"exact workers={workers} {c.label}: {_brief(exact[(c.label, workers)])}", flush=True)

    rows, resume_rows = [], []
    for c in CONTENDERS:
        for workers in args.workers:
            results = runs.get((c.label, workers))
            if results is None and (c.module != "floor" or workers == 0):
                why = converted.get(c.module, {}).get("error") or "not installed (pip install -e '.[bench]')"
                rows.append({"loader": c.label, "num_workers": workers, "M tokens/s": None, "note": why})
            if results is None:
                continue
            errors = [r["error"] for r in results if "error" in r]
            row: dict[str, Any] = {"loader": c.label, "num_workers": workers}
            tokens = median([r.get("tokens/s") for r in results])
            row["M tokens/s"] = tokens / 1e6 if tokens else None
            row["first batch s"] = median([r.get("first batch s") for r in results])
            for name in ("main rss", "workers rss", "added"):
                row[f"{name} MB"] = median([r.get(f"{name} MB") for r in results])
            check = exact.get((c.label, workers), {})
            row["exact resume"] = check.get("exact resume", check.get("error", ""))
            row["max mixture deviation"] = check.get("max deviation", "") if c.mixture else ""
            row["source0 share"] = check.get("source0 share", "") if c.mixture else ""
            row["note"] = errors[0] if errors else ""
            rows.append(row)
        if c.module != "floor" and c.label in resumes:
            results = resumes[c.label]
            errors = [r["error"] for r in results if "error" in r]
            resume_rows.append(
                {
                    "loader": c.label,
                    "resume s": median([r.get("resume s") for r in results]),
                    "replays": results[0].get("replays", errors[0] if errors else ""),
                }
            )

    speed = {(r["loader"], r["num_workers"]): r["M tokens/s"] for r in rows}
    ours_labels = {c.label for c in CONTENDERS if c.ours}
    peer_labels = {c.label for c in CONTENDERS if c.peer}
    checks: dict[str, bool] = {}
    for workers, goal in ((0, 1.5), (2, 2.0)):
        if workers not in args.workers:
            continue
        for c in CONTENDERS:
            peer = speed.get((c.label, workers))
            if c.peer and peer:
                ours = next(o for o in CONTENDERS if o.ours and o.mixture == c.mixture)
                x = ratio(speed.get((ours.label, workers)), peer)
                checks[
                    f"{c.label.split(':')[0]} {'mixture ' if c.mixture else ''}num_workers={workers}: "
                    f"ours {x:.2f}x (goal >= {goal}x)"
                ] = x is not None and x >= goal
    for r in resume_rows:
        if r["loader"] in ours_labels:
            seconds = r["resume s"]
            checks[
                f"{r['loader']}: first batch after resuming at step {args.resume_step:,} in {seconds:.3f} s (< 1 s)"
            ] = seconds is not None and seconds < 1.0
    ours_exact = [r for r in rows if r["loader"] in ours_labels and r.get("exact resume")]
    checks["ours: exact resume at every num_workers, single source and mixture"] = bool(ours_exact) and all(
        r["exact resume"] == "yes" for r in ours_exact
    )
    for workers in args.workers:
        measured = [r for r in rows if r["num_workers"] == workers and r.get("added MB") is not None]
        ours_mem = [r["added MB"] for r in measured if r["loader"] in ours_labels]
        peer_mem = [r["added MB"] for r in measured if r["loader"] in peer_labels]
        if ours_mem and peer_mem:
            checks[
                f"num_workers={workers}: memory the loader adds, ours {max(ours_mem):.1f} MB <= every peer's "
                f"(lowest {min(peer_mem):.1f} MB; {MEMORY_RESOLUTION_MB} MB resolution)"
            ] = max(ours_mem) <= min(peer_mem) + MEMORY_RESOLUTION_MB

    columns = [
        "loader",
        "num_workers",
        "M tokens/s",
        "first batch s",
        "main rss MB",
        "workers rss MB",
        "added MB",
        "exact resume",
        "max mixture deviation",
        "source0 share",
        "note",
    ]
    convert_rows = [
        {"loader": module, "convert s": result.get("convert s"), "note": result.get("error", "")}
        for module, result in converted.items()
    ]
    results_dir = results_directory(args.results_dir, args.quick)
    report(
        "peers",
        {
            f"Throughput, first batch, peak memory, exact resume (batch {args.batch_size} x {args.seq_len}; medians "
            f"of {args.rounds} rounds)": (columns, rows),
            f"First batch after resuming at step {args.resume_step:,} (num_workers=0, medians)": (
                ["loader", "resume s", "replays"],
                resume_rows,
            ),
            "Conversion with each peer's own tooling (once, before timing)": (
                ["loader", "convert s", "note"],
                convert_rows,
            ),
        },
        config={
            "num_tokens": args.num_tokens,
            "batch": f"{args.batch_size}x{args.seq_len}",
            "rounds": args.rounds,
            "seconds": args.seconds,
            "warmup batches": args.warmup,
            "resume step": args.resume_step,
            "mixture": "source0 0.7, source1 0.3 (each half the corpus)",
            "python": sys.version.split()[0],
            "quick": args.quick,
            "wall s": round(time.perf_counter() - started),
        },
        checks=checks,
        results_dir=results_dir,
    )
    try:
        chart(rows, resume_rows, args.workers, results_dir / "peers.png")
        print(f"chart written to {results_dir / 'peers.png'}")
    except ImportError:
        print("no chart: matplotlib is not installed (pip install -e '.[bench]')")


def _brief(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items() if k != "setup")


if __name__ == "__main__":
    main()
