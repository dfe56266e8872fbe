"""Token shards read from object storage: ours against a bare pool of the same range GETs, and litdata.

``python -m benchmarks.object_storage``. A corpus of 512M uint16 tokens (1 GiB, 8 ``.npy`` shards) is
uploaded to a local S3 server (moto) with two proxies in front of it, one adding 0 ms and one 50 ms to
every request; server and proxies run in a process of their own (``benchmarks/object_store/serve.py``).
For each delay and ``num_workers`` 0 and 2:

- ours: ``TokenShardDataModule("s3://corpora/corpus", seq_len=2048, batch_size=8, storage_options=...)``
  after ``setup("fit")``; 64 batches, then 256 timed. Bytes: the body of every GET the proxy answered,
  over the timed batches, against the bytes trained (batches x 8 x 2049 x 2);
- the floor: the windows the plan yields for the same steps, as byte ranges (header offset included,
  merged per round of 16 steps as our reader merges them), fetched by a bare ``ThreadPoolExecutor``
  of ``io_threads`` boto3 ``get_object(Range=...)`` calls, all queued at once. For 2 workers, 2 forked
  processes at once, each with its own pool, dealt the rounds alternately as a DataLoader deals worker
  messages (``benchmarks/object_store/floor.py``);
- litdata (if installed): ``StreamingDataset`` over its own ``optimize``d copy on the same server,
  through the same proxy, a fresh process per measurement (``benchmarks/object_store/litdata_remote.py``).

First batch: a fresh DataModule and one resumed at step 10^5 (``load_state_dict`` after setup), both
timed from construction, setup included, with the bytes fetched by then; litdata's resume from its
own ``state_dict``. Contenders alternate, in a rotated order, over ``--rounds`` rounds; medians.

The file cache (``--parts file-cache``, ``benchmarks/object_store/file_cache.py``): 256 JPEGs named by
URL in an image-text dataset, read for 4 epochs through the 50 ms proxy with no cache, LRU and ours
(eviction by the plan's next use) at budgets of half and a quarter of the data; bytes fetched against
Belady's rule run offline on the plan's order, and images/s. ``--parts shards`` runs only the above.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    add_run_arguments,
    cached_token_shards,
    data_directory,
    report,
    result_of,
    results_directory,
)
from benchmarks.object_store import file_cache
from benchmarks.object_store.floor import ByteRange, ShardLayout, floor_seconds, window_ranges
from benchmarks.object_store.serve import StoreProcess
from benchmarks.object_store.server import create_bucket, storage_options
from datamodules import TokenShardDataModule

BUCKET = "corpora"
GROUP = 16  # micro-batches whose windows are requested in one round (ours: prefetch_steps, default 16)
LABELS = {  # the contenders, in table order
    "ours": "ours: TokenShardDataModule",
    "floor": "floor: bare thread pool, same range GETs",
    "litdata": "litdata: StreamingDataset, own copy",
}
NOTES = {
    "ours": "",
    "floor": "boto3 get_object(Range=...), all queued at once",
    "litdata": "downloads whole chunks (~33 MB each) into a local cache: not the same requests",
}
THROUGHPUT_COLUMNS = ["loader", "delay ms", "num_workers", "M tokens/s", "x floor", "MB fetched", "MB trained"]
THROUGHPUT_COLUMNS += ["fetched / trained, timed", "ranged GETs in flight", "note"]
FIRST_COLUMNS = ["loader", "delay ms", "num_workers", "start", "setup s", "first batch s", "MB fetched"]
FIRST_COLUMNS += ["% of corpus", "note"]
GOAL_FLOOR, GOAL_BYTES, GOAL_FIRST_S, GOAL_FIRST_SHARE = 0.8, 1.05, 2.0, 0.01


@dataclass(frozen=True)
class Bench:
    """What every measurement shares: the store, the corpus and the sizes."""

    store: StoreProcess
    seq_len: int
    batch_size: int
    warmup: int
    batches: int
    io_threads: int
    corpus_bytes: int
    layout: ShardLayout
    groups: list[list[ByteRange]]  # the timed steps' range GETs, per round of GROUP steps

    @property
    def trained_per_batch(self) -> int:
        return self.batch_size * (self.seq_len + 1) * 2  # uint16 windows of seq_len + 1 tokens

    def fetched(self, delay: int) -> int:
        """Body bytes of every GET the proxy adding ``delay`` ms answered since the measurement began."""
        return self.store.counts(delay)["get_bytes"]

    def most_in_flight(self, delay: int) -> int:
        """The most ranged GETs that proxy held at once since the measurement began."""
        return self.store.counts(delay)["most_in_flight"]


def datamodule(bench: Bench, delay: int, workers: int) -> TokenShardDataModule:
    return TokenShardDataModule(
        f"s3://{BUCKET}/corpus",
        seq_len=bench.seq_len,
        batch_size=bench.batch_size,
        num_workers=workers,
        storage_options=storage_options(bench.store.proxies[delay]),
        prefetch_steps=GROUP,
        io_threads=bench.io_threads,
    )


def run_ours(bench: Bench, delay: int, workers: int) -> dict[str, float]:
    """Tokens/s over ``bench.batches`` batches after ``bench.warmup``, and the bytes fetched. The span is
    taken between the arrivals of batches ``warmup`` and ``warmup + batches`` (multiples of GROUP),
    where the reads ahead of training stand at the same point of a round."""
    before = bench.fetched(delay)
    dm = datamodule(bench, delay, workers)
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    for _ in range(bench.warmup + 1):
        next(batches)
    span_before, start = bench.fetched(delay), time.perf_counter()
    for _ in range(bench.batches):
        next(batches)
    seconds = time.perf_counter() - start
    after = bench.fetched(delay)
    batches.close()  # its workers stop now: left to the collector, each waited out torch's 5 s join timeout
    return {
        "seconds": seconds,
        "fetched": after - before,
        "span fetched": after - span_before,
        "in flight": bench.most_in_flight(delay),
    }


def run_floor(bench: Bench, delay: int, workers: int) -> dict[str, float]:
    seconds = floor_seconds(bench.store.proxies[delay], BUCKET, bench.groups, bench.io_threads, max(1, workers))
    fetched = sum(end - first for group in bench.groups for _, first, end in group)
    return {"seconds": seconds, "fetched": fetched, "span fetched": fetched, "in flight": bench.most_in_flight(delay)}


def litdata_process(task: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """One litdata task in a fresh process; ``{"error": ...}`` with its last line if it failed."""
    command = [sys.executable, "-W", "ignore", "-m", "benchmarks.object_store.litdata_remote", json.dumps(task)]
    return result_of(command, timeout)


def litdata_spec(bench: Bench, delay: int, workers: int, task: str) -> dict[str, Any]:
    return {
        "task": task,
        "url": f"s3://{BUCKET}/litdata",
        "proxy": bench.store.proxies[delay],
        "control": bench.store.control,
        "delay_ms": delay,
        "workers": workers,
        "seq_len": bench.seq_len,
        "batch_size": bench.batch_size,
        "warmup": bench.warmup,
        "batches": bench.batches,
    }


def run_litdata(bench: Bench, delay: int, workers: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="litdata-cache-", ignore_cleanup_errors=True) as cache:
        return litdata_process({**litdata_spec(bench, delay, workers, "run"), "cache": cache})


def first_batch_ours(bench: Bench, delay: int, workers: int, resume_step: int | None) -> dict[str, float]:
    """Construction, setup and first batch of a fresh DataModule, or one given the state of step ``resume_step``."""
    before, start = bench.fetched(delay), time.perf_counter()
    dm = datamodule(bench, delay, workers)
    dm.setup("fit")
    setup_s = time.perf_counter() - start
    if resume_step is not None:
        dm.load_state_dict({**dm.state_dict(), "positions_consumed": resume_step * bench.batch_size})
    batches = iter(dm.train_dataloader())
    next(batches)
    seconds = time.perf_counter() - start
    fetched = bench.fetched(delay) - before
    batches.close()  # as in run_ours
    return {"setup s": setup_s, "first batch s": seconds, "first batch bytes": fetched}


def first_batch_litdata(bench: Bench, delay: int, resume_step: int) -> dict[str, Any]:
    """litdata's state at ``resume_step`` built in one process, then a fresh loader given it in another."""
    with tempfile.TemporaryDirectory(prefix="litdata-cache-", ignore_cleanup_errors=True) as cache:
        task = {**litdata_spec(bench, delay, 0, "state"), "cache": cache, "step": resume_step}
        found = litdata_process(task)
        if "error" in found:
            return found
        shutil.rmtree(cache)  # the state names this folder: the resumed loader gets it, empty
        Path(cache).mkdir()
        return {**litdata_process({**task, "task": "resume", "state": found["state"]}), "replays": found["replays"]}


def upload(endpoint: str, local: Path, key: str) -> None:
    import s3fs

    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(local), f"{BUCKET}/{key}", recursive=True)


def litdata_copy(directory: Path, shards: list[Path], seq_len: int, num_tokens: int) -> dict[str, Any]:
    """litdata's optimized copy of the shards, in ``directory/litdata`` (reused from a kept ``--data-dir``):
    the chunk size and how long ``optimize`` took, or ``{"error": ...}``."""
    out, marker = directory / "litdata", directory / "litdata.json"
    wanted = {"tokens": num_tokens, "shards": len(shards), "seq_len": seq_len}
    if marker.exists() and (out / "index.json").exists() and json.loads(marker.read_text())["wanted"] == wanted:
        return json.loads(marker.read_text())["converted"]
    converted = litdata_process(
        {"task": "convert", "shards": [str(p) for p in shards], "out": str(out), "seq_len": seq_len}
    )
    if "error" not in converted:
        marker.write_text(json.dumps({"wanted": wanted, "converted": converted}))
    return converted


def timed_ranges(args: argparse.Namespace, store: StoreProcess, layout: ShardLayout) -> list[list[ByteRange]]:
    """The range GETs of as many steps as ours times, from the plan our DataModule builds (the steps
    right after the warm-up), per round of GROUP steps."""
    dm = TokenShardDataModule(
        f"s3://{BUCKET}/corpus",
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        storage_options=storage_options(store.endpoint),
    )
    dm.setup("fit")
    dm.train_dataloader()  # builds the plan
    first = (args.warmup + 1) * args.batch_size
    _, windows = dm.plan.locate(np.arange(first, first + args.batches * args.batch_size))
    return window_ranges(layout, windows, args.seq_len, GROUP * args.batch_size)


def median(values: list[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


Key = tuple[str, int, int]  # (contender, delay ms, num_workers)
StartKey = tuple[str, int, int, str]  # and how it starts: fresh, or resumed


def measure(bench: Bench, args: argparse.Namespace, litdata: bool) -> tuple[dict, dict]:
    """Every measurement, ``args.rounds`` times, contenders in a rotated order each round."""
    runs: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    starts: dict[StartKey, list[dict[str, Any]]] = defaultdict(list)
    runners: dict[str, Callable[[Bench, int, int], dict[str, Any]]] = {
        "ours": run_ours,
        "floor": run_floor,
        "litdata": run_litdata,
    }
    names = [n for n in LABELS if litdata or n != "litdata"]
    resume = f"resume at step {args.resume_step:,}"
    for r in range(args.rounds):
        rotation = names[r % len(names) :] + names[: r % len(names)]
        for delay in args.delays_ms:
            for workers in args.workers:
                for name in rotation:
                    what = f"round {r + 1} {name} delay={delay} ms workers={workers}"
                    runs[(name, delay, workers)].append(
                        logged(bench.store, what, partial(runners[name], bench, delay, workers))
                    )
                for start in ("fresh", resume):
                    step = args.resume_step if start == resume else None
                    what = f"round {r + 1} ours {start} delay={delay} ms workers={workers}"
                    starts[("ours", delay, workers, start)].append(
                        logged(bench.store, what, partial(first_batch_ours, bench, delay, workers, step))
                    )
            if litdata:
                what = f"round {r + 1} litdata {resume} delay={delay} ms workers=0"
                starts[("litdata", delay, 0, resume)].append(
                    logged(bench.store, what, partial(first_batch_litdata, bench, delay, args.resume_step))
                )
    return runs, starts


def logged(store: StoreProcess, what: str, measurement: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measurement()`` on freshly reset proxy counts, with a progress line naming it, its result and
    how long it took."""
    store.reset_counts()
    start = time.perf_counter()
    result = measurement()
    # A persistent-worker DataLoader and its iterator hold each other: collected now, its workers stop.
    gc.collect()
    print(f"{what}: {brief(result)} ({time.perf_counter() - start:.1f} s)", flush=True)
    return result


def brief(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())


def throughput_rows(bench: Bench, runs: dict[Key, list[dict]], missing: str | None) -> list[dict[str, Any]]:
    """Medians per (contender, delay, workers); ``x floor`` is the median of each round's ratio to the
    floor timed in the same round."""
    tokens = bench.batches * bench.batch_size * bench.seq_len
    rows = []
    for (name, delay, workers), results in sorted(runs.items(), key=lambda item: order(item[0])):
        floor = runs[("floor", delay, workers)]
        rates = [tokens / r["seconds"] if "seconds" in r else None for r in results]
        ratios = [rate * f["seconds"] / tokens if rate else None for rate, f in zip(rates, floor, strict=True)]
        errors = [r["error"] for r in results if "error" in r]
        consumed = bench.batches if name == "floor" else bench.warmup + 1 + bench.batches
        span = median([r.get("span fetched") for r in results])
        rows.append(
            present(
                {
                    "loader": LABELS[name],
                    "delay ms": delay,
                    "num_workers": workers,
                    "M tokens/s": scaled(median(rates), 1e-6),
                    "x floor": median(ratios),
                    "MB fetched": scaled(median([r.get("fetched") for r in results]), 1e-6),
                    "MB trained": consumed * bench.trained_per_batch / 1e6,
                    "fetched / trained, timed": scaled(span, 1 / (bench.batches * bench.trained_per_batch)),
                    "ranged GETs in flight": median([r.get("in flight") for r in results]),
                    "note": errors[0] if errors else NOTES[name],
                }
            )
        )
    if missing:
        rows.append({"loader": LABELS["litdata"], "note": f"not measured: {missing}"})
    return rows


def first_batch_rows(bench: Bench, starts: dict[StartKey, list[dict]], runs: dict[Key, list[dict]]) -> list[dict]:
    """Medians per (contender, delay, workers, start); litdata's fresh first batch comes from its runs."""
    found = {**starts, **{(*key, "fresh"): results for key, results in runs.items() if key[0] == "litdata"}}
    rows = []
    for (name, delay, workers, start), results in sorted(found.items(), key=lambda item: order(item[0])):
        errors = [r["error"] for r in results if "error" in r]
        fetched = median([r.get("first batch bytes") for r in results])
        rows.append(
            present(
                {
                    "loader": LABELS[name],
                    "delay ms": delay,
                    "num_workers": workers,
                    "start": start,
                    "setup s": median([r.get("setup s") for r in results]),
                    "first batch s": median([r.get("first batch s") for r in results]),
                    "MB fetched": scaled(fetched, 1e-6),
                    "% of corpus": scaled(fetched, 100 / bench.corpus_bytes),
                    "note": errors[0] if errors else results[0].get("replays", ""),
                }
            )
        )
    return rows


def order(key: Key | StartKey) -> tuple:
    """Table order: by delay, then workers, then contender (and start)."""
    name, delay, workers, *start = key
    return delay, workers, list(LABELS).index(name), *start


def present(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without the values not measured (a blank cell, no key in the JSON record)."""
    return {key: value for key, value in row.items() if value is not None}


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def goals(throughput: list[dict], first: list[dict]) -> dict[str, bool]:
    checks = {}
    for row in (r for r in throughput if r["loader"] == LABELS["ours"]):
        where = f"delay {row['delay ms']} ms, num_workers={row['num_workers']}"
        ratio, fetched = row.get("x floor"), row.get("fetched / trained, timed")
        checks[f"{where}: ours at {fmt(ratio)}x the floor's tokens/s (goal >= {GOAL_FLOOR})"] = (
            ratio is not None and ratio >= GOAL_FLOOR
        )
        checks[f"{where}: ours fetched {fmt(fetched)}x the bytes trained (goal <= {GOAL_BYTES})"] = (
            fetched is not None and fetched <= GOAL_BYTES
        )
    for row in (r for r in first if r["loader"] == LABELS["ours"]):
        seconds, share = row.get("first batch s"), row.get("% of corpus")
        checks[
            f"delay {row['delay ms']} ms, num_workers={row['num_workers']}, {row['start']}: first batch in "
            f"{fmt(seconds)} s (goal < {GOAL_FIRST_S}) with {fmt(share)}% of the corpus fetched (goal < "
            f"{GOAL_FIRST_SHARE:.0%})"
        ] = seconds is not None and seconds < GOAL_FIRST_S and share is not None and share < 100 * GOAL_FIRST_SHARE
    return checks


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, default=512 * 2**20, help="uint16 tokens (default: 1 GiB)")
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=64, help="untimed batches first (a multiple of 16)")
    parser.add_argument("--batches", type=int, default=256, help="timed batches (a multiple of 16)")
    parser.add_argument("--io-threads", type=int, default=16, help="concurrent range GETs per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resume-step", type=int, default=10**5)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--delays-ms", type=int, nargs="+", default=[0, 50], help="added per request by a proxy")
    parser.add_argument("--parts", nargs="+", choices=["shards", "file-cache"], default=["shards", "file-cache"])
    parser.add_argument("--cache-images", type=int, default=256, help="file cache: JPEGs in the bucket")
    parser.add_argument("--cache-image-side", type=int, default=160, help="file cache: JPEG side (~23 KB)")
    parser.add_argument("--cache-epochs", type=int, default=4)
    parser.add_argument("--cache-factors", type=int, nargs="+", default=[2, 4], help="data / cache budget")
    parser.add_argument("--cache-delay-ms", type=int, default=50)
    parser.add_argument("--cache-workers", type=int, default=2)
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:  # one delay: the other proxy is the same code, slower
        args.num_tokens, args.num_shards, args.warmup, args.batches, args.rounds = 8 * 2**20, 2, 16, 32, 1
        args.delays_ms = [0]
        args.cache_images, args.cache_epochs, args.cache_factors, args.cache_delay_ms = 32, 2, [2], 0
    if args.warmup % GROUP or args.batches % GROUP:
        parser.error(f"--warmup and --batches must be multiples of {GROUP} (one round of range requests)")
    started = time.perf_counter()
    tables: dict[str, tuple[list[str], list[dict[str, Any]]]] = {}
    checks: dict[str, bool] = {}
    config: dict[str, Any] = {}
    delays = sorted(set(args.delays_ms if "shards" in args.parts else []) | {args.cache_delay_ms})
    with data_directory(args.data_dir) as directory, StoreProcess(delays) as store:
        if "shards" in args.parts:
            shard_tables, shard_checks, shard_config = measure_shards(args, directory, store, started)
            tables.update(shard_tables)
            checks.update(shard_checks)
            config.update(shard_config)
        if "file-cache" in args.parts:
            rows, cache_checks = file_cache.measure(
                store, directory / "file_cache", args.cache_images, args.cache_image_side, args.cache_epochs,
                args.cache_factors, args.cache_delay_ms, args.cache_workers,
            )  # fmt: skip
            title = (
                f"File cache: {args.cache_images} JPEGs by URL (~{args.cache_image_side}^2 px), "
                f"{args.cache_delay_ms} ms a request, num_workers={args.cache_workers}, ImageTextDataModule "
                "batch 8; bytes fetched over the first epochs, against Belady's offline optimum for the plan's order"
            )
            tables[title] = (file_cache.COLUMNS, rows)
            checks.update(cache_checks)
            config.update({"cache images": args.cache_images, "cache delay ms": args.cache_delay_ms})
    config.update({"quick": args.quick, "wall s": round(time.perf_counter() - started)})
    name = "object_storage" if len(args.parts) == 2 else f"object_storage_{args.parts[0].replace('-', '_')}"
    report(name, tables, config=config, checks=checks, results_dir=results_directory(args.results_dir, args.quick))


def measure_shards(
    args: argparse.Namespace, directory: Path, store: StoreProcess, started: float
) -> tuple[dict[str, tuple[list[str], list[dict[str, Any]]]], dict[str, bool], dict[str, Any]]:
    """The token-shard tables (ours, the floor, litdata), their checks and their settings."""
    litdata = importlib.util.find_spec("litdata") is not None
    if not litdata:
        print("litdata is not installed: left out (pip install -e '.[bench]')", flush=True)
    shards = cached_token_shards(directory / "npy", args.num_tokens, args.num_shards)
    create_bucket(store.endpoint, BUCKET)
    upload(store.endpoint, directory / "npy", "corpus")
    converted = litdata_copy(directory, shards, args.seq_len, args.num_tokens) if litdata else {}
    if litdata and "error" not in converted:
        upload(store.endpoint, directory / "litdata", "litdata")
    litdata = litdata and "error" not in converted
    layout = ShardLayout.of(shards, "corpus/")
    bench = Bench(
        store,
        args.seq_len,
        args.batch_size,
        args.warmup,
        args.batches,
        args.io_threads,
        args.num_tokens * 2,
        layout,
        timed_ranges(args, store, layout),
    )
    print(f"corpus ready in {time.perf_counter() - started:.0f} s; measuring", flush=True)
    runs, starts = measure(bench, args, litdata)
    missing = None if litdata else converted.get("error", "litdata is not installed")
    throughput, first = throughput_rows(bench, runs, missing), first_batch_rows(bench, starts, runs)
    tables = {
        f"Tokens/s and bytes fetched (batch {args.batch_size} x {args.seq_len}; {args.warmup} batches, then "
        f"{args.batches} timed; medians of {args.rounds} rounds)": (THROUGHPUT_COLUMNS, throughput),
        f"First batch, timed from construction, setup included (medians of {args.rounds} rounds)": (
            FIRST_COLUMNS,
            first,
        ),
    }
    config = {
        "num_tokens": args.num_tokens,
        "shards": args.num_shards,
        "corpus GiB": round(args.num_tokens * 2 / 2**30, 3),
        "batch": f"{args.batch_size}x{args.seq_len}",
        "delays ms": args.delays_ms,
        "floor io_threads": args.io_threads,
        "ours": f"prefetch_steps={GROUP}, io_threads={args.io_threads}",
        "litdata chunk tokens": converted.get("chunk tokens"),
        "litdata optimize s": round(converted["convert s"]) if "convert s" in converted else None,
        "rounds": args.rounds,
    }
    return tables, goals(throughput, first), config


if __name__ == "__main__":
    main()
