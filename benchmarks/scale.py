"""How a job's start grows with its ranks, shards and samples: requests, bytes, memory and time.

``python -m benchmarks.scale [--quick]``. Every job is real: ``R`` processes on gloo, launched by
Lightning's ``ddp`` strategy (``Trainer(devices=R)``), each running ``Trainer.fit`` for one step of a
trivial model over our DataModule. What each rank measures: ``setup`` (the DataModule's, timed
around it), its first batch (from the end of setup), and its memory at the first batch from
``/proc/self/smaps_rollup`` (``Rss``; ``Pss``, which splits a page mapped by several processes
among them, so the node's total is their sum; ``Anonymous``: the heap and other pages no file backs,
what the process holds alone).

- **Token shards in a bucket**: prepared ``.npy`` shards (``metadata.json`` with each shard's edges
  recorded, as the prepare command writes) uploaded to a local S3 server (moto) behind a proxy that
  counts every request (``benchmarks/object_store/serve.py``). A barrier after ``setup`` on every
  rank, then rank 0 reads the counts: the requests of the job's setup, apart from those of the first
  batches. Each job starts with an empty node cache (``XDG_CACHE_HOME``), then once more with the
  cache the first start left ("restart"). With ``--delay-ms`` (default 50) one more job at the largest
  shard count runs behind a proxy that delays every request: the whole start's wall time. Beside them,
  the floor: the same requests as a first start's setup sent by a bare pool of boto3 threads, which
  is what the local server (Python, on the same 2 cores) allows.
- **Token shards on disk**: the same shards as local files.
- **WebDataset shards**: tars of tiny samples (a ``.txt`` member each, written by numpy), read as
  ``WebDatasetRows`` by a minimal DataModule whose ``setup`` indexes them once for the job
  (``indexed_shards(..., job)``) and whose loader reads the rows of the first batch. Each size starts
  with an empty index cache (the job splits the indexing), then again with the cache ("restart": a
  mapped open). At sizes the disk cannot hold as tars (``--synthetic-samples``), the node table is
  assembled from synthetic per-shard indexes over sparse shard files of the right sizes: setup only,
  no sample read. Memory: the process's anonymous memory grown over ``setup`` (what it holds per
  sample), its ``Pss`` at the first batch, and the node table's bytes on disk per sample.
- **Packed conversation rows** (``ConversationRows``, which ``HiddenStateRows`` extends): a saved
  dataset of 10^6 and 10^7 tiny conversations, set up in fresh processes: one computing and holding
  its own rows, lengths and packings (what every rank and worker did before), the node's first
  (which makes the node's arrays), and any other (which maps them); one packed row of passes 0 and 1
  read in each. Memory: the anonymous memory grown over setup and reads, per conversation.

Beyond the ranks two cores can run, the job total is computed from the counts: the requests a job
of ``R`` ranks sends are fitted as ``a + b R`` over the measured ``R`` and projected to 1,024 ranks
(said so in the table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    ROOT,
    add_run_arguments,
    data_directory,
    memory_kb,
    report,
    result_of,
    results_directory,
    tiny_conversations,
    tiny_shards,
)
from benchmarks.object_store.serve import StoreProcess, read_counts, reset_counts
from benchmarks.object_store.server import KEY, REGION, SECRET, create_bucket, storage_options
from benchmarks.shard_open import write_metadata

BUCKET = "scale"
PROJECTED_RANKS = 1024
TOKENS_PER_SHARD = 4096
SEQ_LEN, BATCH_SIZE = 255, 4
JOB_TIMEOUT_S = 900
TOKEN_COLUMNS = ["shards", "where", "ranks", "start", "setup requests (job)", "per rank", "first-batch requests"]
TOKEN_COLUMNS += ["setup s (slowest rank)", "first batch s", "Pss MB / process", "Anonymous MB / process"]
TOKEN_COLUMNS += ["note"]
WDS_PER_SHARD, WDS_BATCH = 10_000, 32
WDS_COLUMNS = ["samples", "ranks", "start", "setup s (slowest rank)", "first batch s", "setup anonymous B / sample"]
WDS_COLUMNS += ["Pss MB / process", "table B / sample (node)", "keys B / sample (node)", "note"]


# --- one rank of a job (run by Lightning in each process) -----------------------------------------


def rank_main(job: dict[str, Any]) -> None:
    """One rank: ``Trainer.fit`` for one step over the job's DataModule, timed and measured."""
    import lightning.pytorch as pl
    import torch

    from datamodules import TokenShardDataModule

    class Step(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.weight * batch["input_ids"].float().mean()  # WebDataset rows: their texts' lengths

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    measured: dict[str, Any] = {}

    class Measure(pl.Callback):
        def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
            trainer.strategy.barrier("setup done")  # every rank's setup requests are in the counts now
            if trainer.global_rank == 0 and job.get("control"):
                measured["setup_counts"] = read_counts(job["control"], job["delay_ms"])
            trainer.strategy.barrier("setup counted")
            measured["first_batch_from"] = time.perf_counter()

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            measured["first_batch_s"] = time.perf_counter() - measured.pop("first_batch_from")
            memory = memory_kb(os.getpid())
            measured["rss_kb"], measured["pss_kb"] = memory["Rss"], memory["Pss"]
            measured["anonymous_kb"] = memory["Anonymous"]

    if job.get("webdataset"):
        datamodule: pl.LightningDataModule = tar_rows_datamodule(job)
    else:
        datamodule = TokenShardDataModule(
            job["data_dir"], seq_len=SEQ_LEN, batch_size=BATCH_SIZE, storage_options=job.get("storage_options")
        )
    setup = datamodule.setup

    def timed_setup(stage: str) -> None:
        before = memory_kb(os.getpid())["Anonymous"]
        started = time.perf_counter()
        setup(stage)
        measured["setup_s"] = time.perf_counter() - started
        measured["setup_anonymous_kb"] = memory_kb(os.getpid())["Anonymous"] - before

    datamodule.setup = timed_setup  # type: ignore[method-assign]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=job["ranks"],
        strategy="ddp" if job["ranks"] > 1 else "auto",
        use_distributed_sampler=not job.get("webdataset"),  # the tar rows' loader deals its rows itself
        max_steps=1,
        callbacks=[Measure()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Step(), datamodule=datamodule)
    Path(job["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(measured))
    if torch.distributed.is_initialized():
        # Left to the interpreter's exit, gloo's threads sometimes abort the process ("terminate called").
        torch.distributed.destroy_process_group()


def run_job(job: dict[str, Any], cache: Path) -> list[dict[str, Any]]:
    """``job`` in ``job["ranks"]`` fresh processes with ``cache`` as their node cache; every rank's measures."""
    out = Path(tempfile.mkdtemp(prefix="scale-job-"))
    spec = out / "job.json"
    spec.write_text(json.dumps({**job, "out": str(out)}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    env.update(XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "benchmarks.scale", "--rank-job", str(spec)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"job {job} failed:\n{done.stderr[-4000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(job["ranks"])]
    shutil.rmtree(out)
    return ranks


# --- token shards ----------------------------------------------------------------------------------


def write_prepared_shards(directory: Path, num_shards: int) -> Path:
    """``num_shards`` uint16 ``.npy`` shards of ``TOKENS_PER_SHARD`` random ids with ``metadata.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(num_shards)
    paths = []
    for i in range(num_shards):
        path = directory / f"shard_{i:05d}.npy"
        np.save(path, rng.integers(0, 50_000, TOKENS_PER_SHARD, dtype=np.uint16))
        paths.append(path)
    write_metadata(directory, paths, [TOKENS_PER_SHARD] * num_shards)
    return directory


def total(counts: dict[str, Any]) -> int:
    return sum(counts["methods"].values())


def token_row(shards: int, where: str, ranks: int, start: str, measures: list[dict], counts: dict | None) -> dict:
    row: dict[str, Any] = {"shards": shards, "where": where, "ranks": ranks, "start": start}
    if counts is not None:
        setup = total(measures[0]["setup_counts"])
        row.update({"setup requests (job)": setup, "per rank": round(setup / ranks, 1)})
        row["first-batch requests"] = total(counts) - setup
    row["setup s (slowest rank)"] = round(max(m["setup_s"] for m in measures), 3)
    row["first batch s"] = round(max(m["first_batch_s"] for m in measures), 3)
    row["Pss MB / process"] = round(max(m["pss_kb"] for m in measures) / 1024, 1)
    row["Anonymous MB / process"] = round(max(m["anonymous_kb"] for m in measures) / 1024, 1)
    return row


def projection(rows: list[dict], shards: int) -> dict[str, Any] | None:
    """The fresh starts at ``shards`` fitted as ``a + b R`` and projected to ``PROJECTED_RANKS``."""
    fresh = [r for r in rows if r["shards"] == shards and r["start"] == "first" and "setup requests (job)" in r]
    fresh = [r for r in fresh if not r.get("note")]  # not the job behind a delay
    if len(fresh) < 2:
        return None
    ranks = np.array([r["ranks"] for r in fresh])
    requests = np.array([r["setup requests (job)"] for r in fresh], dtype=float)
    slope, intercept = np.polyfit(ranks.astype(float), requests, 1)
    projected = intercept + slope * PROJECTED_RANKS
    return {
        "shards": shards,
        "where": "bucket",
        "ranks": PROJECTED_RANKS,
        "start": "first",
        "setup requests (job)": round(projected),
        "per rank": round(projected / PROJECTED_RANKS, 2),
        "note": f"projected: {intercept:.0f} {slope:+.2f} x R, fitted over R = {ranks.tolist()}",
    }


def measure_token_shards(args: argparse.Namespace, data: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    delays = [0] + ([args.delay_ms] if args.delay_ms else [])
    with StoreProcess(delays) as store:
        create_bucket(store.endpoint, BUCKET)
        import s3fs

        fs = s3fs.S3FileSystem(**storage_options(store.endpoint))
        for shards in args.shards:
            local = write_prepared_shards(data / f"shards-{shards}", shards)
            print(f"uploading {shards} shards...", flush=True)
            fs.put(str(local), f"{BUCKET}/shards-{shards}", recursive=True)
            for ranks in args.ranks:
                for start in ("first", "restart")[: 1 if args.quick else 2]:
                    cache = data / f"cache-{shards}-{ranks}"
                    if start == "first":
                        shutil.rmtree(cache, ignore_errors=True)
                    rows.append(bucket_row(store, shards, ranks, start, 0, cache))
            if args.delay_ms and shards == max(args.shards):
                cache = data / f"cache-{shards}-delay"
                shutil.rmtree(cache, ignore_errors=True)  # a first start: the layout read through the delay
                rows.append(bucket_row(store, shards, max(args.ranks), "first", args.delay_ms, cache))
                rows[-1]["note"] = f"every request delayed {args.delay_ms} ms"
            if shards == max(args.shards):
                for delay in delays:
                    rows.append(setup_floor(store, delay, shards))
            if args.quick:
                continue
            on_disk = run_job({"data_dir": str(local), "ranks": 1}, data / "cache-local")
            rows.append(token_row(shards, "local disk", 1, "first", on_disk, None))
            print(rows[-1], flush=True)
        for shards in args.shards:
            projected = projection(rows, shards)
            if projected is not None:
                rows.append(projected)
    return rows


def setup_floor(store: StoreProcess, delay_ms: int, shards: int) -> dict[str, Any]:
    """What the server allows: the requests of a first start's setup (the listing, ``metadata.json`` and
    each shard's first 16 KB) by a bare pool of ``SETUP_IO_THREADS`` boto3 threads, timed."""
    import boto3
    from botocore.config import Config

    from datamodules.storage.range_reader import SETUP_IO_THREADS

    config = Config(max_pool_connections=SETUP_IO_THREADS, retries={"total_max_attempts": 1})
    client = boto3.client("s3", endpoint_url=store.proxies[delay_ms], aws_access_key_id=KEY,
                          aws_secret_access_key=SECRET, region_name=REGION, config=config)  # fmt: skip
    started = time.perf_counter()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"shards-{shards}/")
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    reads = [key for key in keys if key.endswith((".npy", "metadata.json"))]

    def get(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-16383")["Body"].read())

    with ThreadPoolExecutor(SETUP_IO_THREADS) as pool:
        list(pool.map(get, reads))
    seconds = time.perf_counter() - started
    row = {
        "shards": shards,
        "where": "bucket",
        "ranks": "-",
        "start": "floor",
        "setup s (slowest rank)": round(seconds, 3),
    }
    row["setup requests (job)"] = len(reads) + math.ceil(len(keys) / 1000)
    row["note"] = f"a bare pool of {SETUP_IO_THREADS} boto3 threads, the same GETs" + (
        f", delayed {delay_ms} ms" if delay_ms else ""
    )
    print(row, flush=True)
    return row


def bucket_row(store: StoreProcess, shards: int, ranks: int, start: str, delay_ms: int, cache: Path) -> dict:
    job = {
        "data_dir": f"s3://{BUCKET}/shards-{shards}",
        "storage_options": storage_options(store.proxies[delay_ms]),
        "ranks": ranks,
        "control": store.control,
        "delay_ms": delay_ms,
    }
    reset_counts(store.control)
    measures = run_job(job, cache)
    row = token_row(shards, "bucket", ranks, start, measures, read_counts(store.control, delay_ms))
    print(row, flush=True)
    return row


# --- WebDataset shards ------------------------------------------------------------------------------


def tar_rows_datamodule(job: dict[str, Any]) -> Any:
    """A minimal DataModule over tar shards: ``setup`` indexes them once for the job and maps the rows;
    its loader gives each row's text length (``read``), or zeros without reading (a synthetic table)."""
    import lightning.pytorch as pl
    import torch

    from datamodules.plan.parallelism import Job
    from datamodules.vision.webdataset_rows import WebDatasetRows, indexed_shards

    class Lengths(torch.utils.data.Dataset):
        def __init__(self, rows: WebDatasetRows, read: bool) -> None:
            self.rows, self.read = rows, read

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.tensor(len(self.rows[row]["txt"]) if self.read else 0)}

    class TarRows(pl.LightningDataModule):
        def setup(self, stage: str) -> None:
            shards = indexed_shards(job["shards"], job["cache_dir"], None, False, Job(self.trainer))
            self.rows = WebDatasetRows(shards, {"txt": "txt"}, ())

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            # Every rank-th row, as a range: a sampler that lists its indices would hold 10^8 of them.
            mine = range(self.trainer.global_rank, len(self.rows), self.trainer.world_size)
            return torch.utils.data.DataLoader(Lengths(self.rows, job["read"]), batch_size=WDS_BATCH, sampler=mine)

    return TarRows()


def synthetic_table(folder: Path, shards: int, per_shard: int) -> list[str]:
    """Sparse shard files of ``per_shard`` one-block samples each (holes: nothing to read) and, in
    ``folder / "idx"``, the node table ``index_shards`` would assemble for them, from per-shard indexes
    of synthetic rows (starts a sample apart, keys as ``tiny_shards`` names them). The shards' paths."""
    from datamodules.storage.sample_table import TarIndex, assemble_table, table_name
    from datamodules.storage.tar_index import INDEX_FORMAT, index_file, reader_and_versions

    (folder / "shards").mkdir(parents=True, exist_ok=True)
    (folder / "idx").mkdir(exist_ok=True)
    locations = []
    for shard in range(shards):
        path = folder / "shards" / f"shard-{shard:05d}.tar"
        with path.open("wb") as f:
            f.truncate((per_shard + 2) * 1024)
        locations.append(str(path))
    _, versions = reader_and_versions(locations, None, 1)
    table = folder / "idx" / table_name(locations, versions, INDEX_FORMAT)
    if table.exists():
        return locations
    paths = []
    for shard, (location, version) in enumerate(zip(locations, versions, strict=True)):
        first = shard * per_shard
        keys = np.char.zfill(np.arange(first, first + per_shard).astype(str), 9).astype("S9")
        index = TarIndex(np.arange(per_shard, dtype=np.int64) * 1024, np.zeros(per_shard, np.int64),
                         np.frombuffer(keys.tobytes(), np.uint8), np.arange(1, per_shard + 1, dtype=np.int64) * 9,
                         per_shard * 1024, per_shard, f"synthetic-{shard}")  # fmt: skip
        paths.append(index_file(folder / "idx", location, version))
        index.save(paths[-1])
    assemble_table(table, locations, versions, paths)
    for path in paths:  # the table is what setup maps; the per-shard files would only double the disk
        path.unlink()
    return locations


def table_bytes(cache: Path) -> tuple[int, int]:
    """``(bytes of the node table's rows, bytes of its keys)`` in the index cache ``cache``."""
    (table,) = cache.glob("samples-*")
    sizes = {path.name: path.stat().st_size for path in table.iterdir()}
    keys = sizes.pop("keys.npy") + sizes.pop("key_offsets.npy")
    return sum(sizes.values()), keys


def webdataset_row(samples: int, ranks: int, start: str, measures: list[dict], cache: Path, note: str = "") -> dict:
    rows, keys = table_bytes(cache)
    row = {"samples": f"{samples:.0e}".replace("e+0", "e"), "ranks": ranks, "start": start, "note": note}
    row["setup s (slowest rank)"] = round(max(m["setup_s"] for m in measures), 3)
    if "first_batch_s" in measures[0] and not note:
        row["first batch s"] = round(max(m["first_batch_s"] for m in measures), 3)
    row["setup anonymous B / sample"] = round(max(m["setup_anonymous_kb"] for m in measures) * 1024 / samples, 2)
    row["Pss MB / process"] = round(max(m["pss_kb"] for m in measures) / 1024, 1)
    row["table B / sample (node)"] = round(rows / samples, 2)
    row["keys B / sample (node)"] = round(keys / samples, 2)
    print(row, flush=True)
    return row


def measure_webdataset(args: argparse.Namespace, data: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for samples in args.samples:
        shards = max(1, samples // WDS_PER_SHARD)
        folder = data / f"tars-{samples}"
        locations = [str(p) for p in tiny_shards(folder / "shards", shards, samples // shards)]
        for ranks in args.wds_ranks:
            cache = folder / f"idx-{ranks}"
            shutil.rmtree(cache, ignore_errors=True)
            job = {"webdataset": True, "shards": locations, "cache_dir": str(cache), "ranks": ranks, "read": True}
            for start in ("first", "restart"):
                rows.append(webdataset_row(samples, ranks, start, run_job(job, data / "cache-wds"), cache))
        shutil.rmtree(folder)
    for samples in args.synthetic_samples:
        shards = max(1, samples // WDS_PER_SHARD)
        folder = data / f"synthetic-{samples}"
        print(f"writing a synthetic table of {samples:,} samples...", flush=True)
        locations = synthetic_table(folder, shards, samples // shards)
        for ranks in args.wds_ranks:
            job = {"webdataset": True, "shards": locations, "cache_dir": str(folder / "idx"), "ranks": ranks}
            measures = run_job({**job, "read": False}, data / "cache-wds")
            note = "synthetic table, sparse shards: setup only"
            rows.append(webdataset_row(samples, ranks, "restart", measures, folder / "idx", note))
        shutil.rmtree(folder)
    return rows


# --- packed conversation rows ----------------------------------------------------------------------

PACKED_ROW = 64  # tokens a packed row (conversations of 1 to 12 tokens)
PACKED_COLUMNS = ["conversations", "process", "setup s", "passes 0-1 s", "anonymous B / conversation"]


def packed_probe(spec: dict[str, Any]) -> None:
    """In a fresh process: the packed rows of the saved conversations ``spec["data"]``, set up as
    ``spec["how"]`` says (``"alone"``: this process computes and holds its own rows, lengths and
    packings, as every process did before; ``"node"``: through the node's arrays), then one row of
    passes 0 and 1 read; prints the times and the anonymous memory grown on a ``RESULT`` line."""
    import datasets

    from datamodules.chat.conversation_rows import ConversationRows, column_values
    from datamodules.plan.multipack import PackedRows

    dataset = datasets.load_from_disk(spec["data"])
    before, started = memory_kb(os.getpid())["Anonymous"], time.perf_counter()
    if spec["how"] == "alone":
        rows = np.arange(len(dataset))
        packed = PackedRows(column_values(dataset, "seq_len")[rows], PACKED_ROW)
        setup_s = time.perf_counter() - started
        spans = [rows[packed.row(pass_, 0)] for pass_ in (0, 1)]
    else:
        conversations = ConversationRows(dataset, np.arange(len(dataset)), total_seq_len=PACKED_ROW)
        setup_s = time.perf_counter() - started
        spans = [conversations.packed_rows(np.array([0]), np.array([pass_]))[0] for pass_ in (0, 1)]
    passes_s = time.perf_counter() - started - setup_s
    grown = (memory_kb(os.getpid())["Anonymous"] - before) * 1024
    assert all(len(span) for span in spans)
    print("RESULT " + json.dumps({"setup_s": setup_s, "passes_s": passes_s, "anonymous_b": grown}), flush=True)


def measure_packed_rows(args: argparse.Namespace, data: Path) -> list[dict[str, Any]]:
    rows = []
    for count in args.conversations:
        folder = tiny_conversations(data / f"conversations-{count}", count)
        cache = data / f"cache-packed-{count}"
        # glibc keeps a setup's freed passing buffers in its heap, where they read as anonymous memory;
        # a fixed mmap threshold hands them back, leaving what the process holds.
        env = {**os.environ, "XDG_CACHE_HOME": str(cache), "MALLOC_MMAP_THRESHOLD_": "131072"}
        for process, how in (("its own (as before)", "alone"), ("first on the node", "node"), ("any other", "node")):
            spec = json.dumps({"data": str(folder), "how": how})
            found = result_of([sys.executable, "-m", "benchmarks.scale", "--packed-probe", spec], JOB_TIMEOUT_S, env)
            if "error" in found:
                raise RuntimeError(f"packed rows probe {process} at {count}: {found['error']}")
            row = {"conversations": count, "process": process, "setup s": round(found["setup_s"], 3)}
            row["passes 0-1 s"] = round(found["passes_s"], 3)
            row["anonymous B / conversation"] = round(found["anonymous_b"] / count, 2)
            print(row, flush=True)
            rows.append(row)
        node = sum(path.stat().st_size for path in cache.rglob("*.npy"))
        rows[-1]["node arrays B / conversation (on disk)"] = round(node / count, 1)
        shutil.rmtree(folder)
        shutil.rmtree(cache)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)  # a rank of a job (launched by this script)
    parser.add_argument("--packed-probe", help=argparse.SUPPRESS)  # a process over packed rows
    parser.add_argument("--shards", type=int, nargs="+", default=[10, 100, 1_000, 10_000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--delay-ms", type=int, default=50, help="one job at the most shards behind this delay")
    parser.add_argument("--samples", type=int, nargs="+", default=[100_000, 1_000_000], help="WebDataset tars")
    parser.add_argument("--synthetic-samples", type=int, nargs="+", default=[100_000_000], help="tables only")
    parser.add_argument("--wds-ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--conversations", type=int, nargs="+", default=[1_000_000, 10_000_000])
    args = parser.parse_args()
    if args.rank_job:
        rank_main(json.loads(Path(args.rank_job).read_text()))
        return
    if args.packed_probe:
        packed_probe(json.loads(args.packed_probe))
        return
    if args.quick:  # 2 ranks once (the token shards' fit needs R = 1, 2); the WebDataset jobs at 1 rank
        args.shards, args.ranks, args.delay_ms = [20], [1, 2], 0
        args.samples, args.synthetic_samples, args.wds_ranks = [20_000], [200_000], [1]
        args.conversations = [100_000]
    with data_directory(args.data_dir) as data:
        started = time.perf_counter()
        token_rows = measure_token_shards(args, data)
        wds_rows = measure_webdataset(args, data)
        packed_rows = measure_packed_rows(args, data)
    largest = max(args.shards)
    fresh = [r for r in token_rows if r["where"] == "bucket" and r["start"] == "first" and r["ranks"] in args.ranks]
    at_largest = [r["setup requests (job)"] for r in fresh if r["shards"] == largest and not r.get("note")]
    projected = next((r for r in token_rows if r["ranks"] == PROJECTED_RANKS and r["shards"] == largest), None)
    checks = {
        f"setup requests at {largest} shards within 5% across R = {args.ranks}": max(at_largest)
        <= 1.05 * min(at_largest),
        f"projected {PROJECTED_RANKS}-rank job under 3 x shards requests at {largest} shards": projected is not None
        and projected["setup requests (job)"] < 3 * largest,
    }
    delayed = [r for r in token_rows if r.get("note", "").startswith("every request delayed")]
    if delayed:
        (row,) = delayed
        what = f"{row['note']}: setup plus first batch of the {row['ranks']}-rank job at {largest} shards under 30 s"
        checks[what] = row["setup s (slowest rank)"] + row["first batch s"] < 30
    largest_table = [r for r in wds_rows if r["samples"] == wds_rows[-1]["samples"]]
    checks[f"WebDataset: at most 24 bytes a sample in the node table, keys aside, at {wds_rows[-1]['samples']}"] = all(
        r["table B / sample (node)"] <= 24 for r in largest_table
    )
    checks[f"WebDataset: setup with the index cached under 5 s per rank at {wds_rows[-1]['samples']} samples"] = all(
        r["setup s (slowest rank)"] < 5 for r in largest_table if r["start"] == "restart"
    )
    checks[f"WebDataset: under 4 bytes a sample of anonymous memory grown over setup from the cached index, at "
           f"{wds_rows[-1]['samples']} samples"] = all(
        r["setup anonymous B / sample"] < 4 for r in largest_table if r["start"] == "restart"
    )  # fmt: skip
    largest_packed = max(args.conversations)
    checks[f"Packed conversation rows: under 1 byte a conversation of anonymous memory in a process over the node's "
           f"arrays, at {largest_packed}"] = all(
        r["anonymous B / conversation"] < 1
        for r in packed_rows if r["conversations"] == largest_packed and r["process"] == "any other"
    )  # fmt: skip
    checks[f"Packed conversation rows: at most 24 bytes a conversation in the node's arrays at {largest_packed}"] = all(
        r.get("node arrays B / conversation (on disk)", 0) <= 24
        for r in packed_rows if r["conversations"] == largest_packed
    )  # fmt: skip
    report(
        "scale",
        {
            "Token shards: a job's start by shards and ranks": (TOKEN_COLUMNS, token_rows),
            "WebDataset shards: a job's start by samples and ranks": (WDS_COLUMNS, wds_rows),
            "Packed conversation rows: a process's setup alone or through the node's arrays": (
                PACKED_COLUMNS + ["node arrays B / conversation (on disk)"],
                packed_rows,
            ),
        },
        {
            "tokens_per_shard": TOKENS_PER_SHARD,
            "seq_len": SEQ_LEN,
            "batch_size": BATCH_SIZE,
            "seconds": round(time.perf_counter() - started),
        },  # fmt: skip
        checks,
        results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
