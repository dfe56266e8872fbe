"""WebDataset tar shards read by member (``ImageTextDataModule("webdataset", ...)``), on two sets of
JPEGs (1080p and 256 px) in 20 shards each: ``python -m benchmarks.webdataset``.

- Index: time and bytes read to index every shard, local, and in an S3 bucket (moto on 127.0.0.1) behind
  a proxy adding 50 ms to every request (the 1080p set's first ``--remote-shards`` shards: moto keeps
  objects in memory).
- Images/s at ``--workers`` workers, alternating rounds, medians: ours over the shards; ours over the
  same images as an imagefolder (one file each); the ``webdataset`` package's own loader
  (``WebDataset(...).shuffle(1000).decode("pil")``, the same resize and crop, ``WebLoader``).
- Shuffle quality: distinct shards feeding each batch, over the first 200 batches.
- Resume: ``setup`` with the index cached and the first batch after resuming at sample 10^6 (50 passes
  in), locally and from the bucket, where every ranged GET is checked to be a sample at or after the
  position.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchvision.transforms import v2

from benchmarks.common import add_run_arguments, data_directory, report, results_directory, warm_page_cache
from benchmarks.image_text import write_photos
from benchmarks.loader_throughput import endless, throughput
from benchmarks.object_store.serve import StoreProcess
from benchmarks.object_store.server import create_bucket, storage_options
from datamodules import ImageTextDataModule
from datamodules.storage.tar_index import index_shards
from examples.default_images import train_caption_tokenizer, write_tar_shards

BUCKET, DELAY_MS, RESUME_AT = "shards", 50, 10**6
GOAL_OF_IMAGEFOLDER, GOAL_RESUME_S = 0.9, 2.0


def ours(data: dict[str, Any], workers: int, batch: int, size: int, **more: Any) -> ImageTextDataModule:
    return ImageTextDataModule(
        "webdataset", data_files=[str(p) for p in data["shards"]], image_field="jpg", text_field="txt",
        tokenizer=data["tokenizer"], max_text_len=32, batch_size=batch, image_size=size, num_image_tokens=0,
        num_workers=workers, load_kwargs={"cache_dir": str(data["index"])}, **more,
    )  # fmt: skip


def imagefolder(data: dict[str, Any], workers: int, batch: int, size: int) -> ImageTextDataModule:
    return ImageTextDataModule(
        "imagefolder", load_kwargs={"data_dir": str(data["folder"])}, tokenizer=data["tokenizer"], max_text_len=32,
        batch_size=batch, image_size=size, num_image_tokens=0, num_workers=workers,
    )  # fmt: skip


def webdataset_loader(shards: list[Path], workers: int, batch: int, size: int) -> Any:
    """The webdataset package's own pipeline, as its documentation writes it."""
    import webdataset as wds

    resize = v2.Compose([v2.PILToTensor(), v2.Resize(size, antialias=True), v2.CenterCrop(size)])
    dataset = (
        wds.WebDataset([str(p) for p in shards], shardshuffle=len(shards), nodesplitter=None, empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "txt", "__url__")
        .map_tuple(resize, None, None)
        .batched(batch)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def started(dm: ImageTextDataModule) -> Any:
    dm.prepare_data()
    dm.setup("fit")
    return endless(dm.train_dataloader)


def shuffle_quality(data: dict[str, Any], batch: int, size: int, batches: int) -> dict[str, float]:
    """Mean distinct shards per batch: ours from the plan (no decoding needed), theirs from ``__url__``."""
    dm = ours(data, 0, batch, size)
    dm.setup("fit")
    dm.train_dataloader()
    rows = dm._train.dataset
    _, samples = dm.plan.locate(np.arange(batches * batch))
    shard_of = rows.shards.shard_of(dm._train.split.rows(samples)).reshape(batches, batch)
    theirs = iter(webdataset_loader(data["shards"], 2, batch, 16))
    counts = [len(set(urls)) for _, (_, _, urls) in zip(range(batches), theirs, strict=False)]
    # Its workers stopped now: collected later (the pipeline holds its loader in a cycle), their shutdown
    # waited out torch's 5 s timeout per worker.
    del theirs
    gc.collect()
    return {"ours": float(np.mean([len(set(r)) for r in shard_of.tolist()])), "webdataset": float(np.mean(counts))}


def resume_first_batch(data: dict[str, Any], batch: int, size: int, **remote: Any) -> dict[str, float]:
    """Seconds to ``setup`` (index cached) and to the first batch after resuming at ``RESUME_AT``."""
    first = ours(data, 0, batch, size, **remote)
    first.setup("fit")
    state = {**first.state_dict(), "positions_consumed": RESUME_AT}
    t0 = time.perf_counter()
    dm = ours(data, 0, batch, size, **remote)
    dm.setup("fit")
    t1 = time.perf_counter()
    dm.load_state_dict(state)
    next(iter(dm.train_dataloader()))
    t2 = time.perf_counter()
    return {"setup s": t1 - t0, "first batch s": t2 - t1, "dm": dm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-samples", type=int, default=20_000, help="per set")
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--distinct", type=int, default=300, help="pictures drawn per set (samples share them)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per contender per round")
    parser.add_argument("--remote-shards", type=int, default=4, help="1080p shards uploaded for the remote index")
    add_run_arguments(parser)
    args = parser.parse_args()
    sets = {"1080p": (1920, 1080), "256 px": (256, 256)}
    if args.quick:
        args.num_samples, args.shards, args.distinct, args.rounds, args.seconds = 120, 4, 12, 1, 0.5
        args.image_size, args.batch_size, args.remote_shards = 32, 4, 2
        sets = {"320x180": (320, 180)}  # a smoke run: one set (the other is the same code)
    torch.set_num_threads(1)
    index_rows, speed_rows, shuffle_rows, resume_rows, checks = [], [], [], [], {}
    with data_directory(args.data_dir) as directory, StoreProcess([DELAY_MS]) as store:
        create_bucket(store.endpoint, BUCKET)
        import s3fs

        bucket = s3fs.S3FileSystem(**storage_options(store.endpoint))
        for number, (name, size) in enumerate(sets.items()):
            tag = name.replace(" ", "")
            # Copies, not links: the imagefolder's reads touch as many bytes as the shards' do.
            folder = write_photos(directory / f"photos-{tag}-copies", args.num_samples, args.distinct, size, link=False)
            shards = write_tar_shards(folder, directory / f"shards-{tag}", args.shards)
            captions = [json.loads(line)["text"] for line in (folder / "metadata.jsonl").read_text().splitlines()]
            tokenizer = str(train_caption_tokenizer(captions[:2000], directory / f"tokenizer-{tag}"))
            shard_bytes = sum(p.stat().st_size for p in shards)
            warm_page_cache(shards)
            warm_page_cache(sorted(folder.glob("*.jpg")))
            index = directory / f"index-{tag}-{time.time_ns()}"
            data = {"shards": shards, "folder": folder, "tokenizer": tokenizer, "index": index}

            t0 = time.perf_counter()
            local = index_shards([str(p) for p in shards], str(index))
            seconds = time.perf_counter() - t0
            index_rows.append({"set": name, "where": "local", "shards": len(shards), "GB": shard_bytes / 1e9,
                               "index s": seconds, "MB read": local.bytes_read / 1e6,
                               "of the shards' bytes": local.bytes_read / shard_bytes})  # fmt: skip
            remote = shards[: args.remote_shards] if number == 0 else shards
            for path in remote:
                bucket.put(str(path), f"{BUCKET}/{tag}/{path.name}")
            urls = [f"s3://{BUCKET}/{tag}/{p.name}" for p in remote]
            store.reset_counts()
            t0 = time.perf_counter()
            far = index_shards(urls, str(directory / f"remote-index-{time.time_ns()}"),
                               storage_options(store.proxies[DELAY_MS]), io_threads=64)  # fmt: skip
            seconds = time.perf_counter() - t0
            counts = store.counts(DELAY_MS)
            remote_bytes = sum(p.stat().st_size for p in remote)
            index_rows.append({"set": name, "where": f"bucket, +{DELAY_MS} ms a request", "shards": len(remote),
                               "GB": remote_bytes / 1e9, "index s": seconds, "MB read": far.bytes_read / 1e6,
                               "of the shards' bytes": far.bytes_read / remote_bytes,
                               "ranged GETs": counts["ranged_gets"]})  # fmt: skip
            if number == 0:  # large members: a small request each; small ones are read densely, in few requests
                checks[f"{name}: the bucket's index read {far.bytes_read / remote_bytes:.1%} of the shards"] = (
                    far.bytes_read < remote_bytes / 10
                )

            loaders = {
                "ours: tar shards": started(ours(data, args.workers, args.batch_size, args.image_size)),
                "ours: the same images as an imagefolder": started(
                    imagefolder(data, args.workers, args.batch_size, args.image_size)
                ),
                "webdataset: WebDataset.shuffle(1000).decode('pil')": endless(
                    lambda d=data: webdataset_loader(d["shards"], args.workers, args.batch_size, args.image_size)
                ),
            }
            speeds: dict[str, list[float]] = {label: [] for label in loaders}
            for _ in range(args.rounds):
                for label, batches in loaders.items():
                    speeds[label].append(throughput(batches, args.batch_size, 4, args.seconds)["tokens/s"])
            median = {label: statistics.median(v) for label, v in speeds.items()}
            folder_speed = median["ours: the same images as an imagefolder"]
            for label, speed in median.items():
                speed_rows.append(
                    {"set": name, "loader": label, "images/s": speed, "of the imagefolder": speed / folder_speed}
                )
            ratio = median["ours: tar shards"] / folder_speed
            checks[f"{name}: tar shards at {ratio:.2f} of the imagefolder (goal {GOAL_OF_IMAGEFOLDER})"] = (
                ratio >= GOAL_OF_IMAGEFOLDER
            )

            quality = shuffle_quality(data, args.batch_size, args.image_size, 200 if not args.quick else 20)
            shuffle_rows.append({"set": name, "batch": args.batch_size, "shards": len(shards),
                                 "ours: distinct shards a batch": quality["ours"],
                                 "webdataset: distinct shards a batch": quality["webdataset"]})  # fmt: skip

            for where, options in (("local", {}), (f"bucket, +{DELAY_MS} ms a request", "remote")):
                if options == "remote":
                    data = {**data, "shards": urls, "index": directory / f"resume-index-{tag}"}
                    options = {"storage_options": storage_options(store.proxies[DELAY_MS])}
                    ours(data, 0, args.batch_size, args.image_size, **options).prepare_data()  # the index, cached
                    store.reset_counts()
                timing = resume_first_batch(data, args.batch_size, args.image_size, **options)
                dm = timing.pop("dm")
                row = {"set": name, "where": where, "resumed at sample": RESUME_AT, **timing}
                if options:
                    later = dm._train.split.rows(
                        dm.plan.locate(np.arange(RESUME_AT, RESUME_AT + 2 * args.batch_size))[1]
                    )
                    row["ranged GETs"] = store.counts(DELAY_MS)["ranged_gets"]
                    row["samples at or after the position"] = len(set(later.tolist()))
                total = timing["setup s"] + timing["first batch s"]
                checks[f"{name}, {where}: setup and first batch after resuming at 10^6 in {total:.2f} s"] = (
                    total < GOAL_RESUME_S
                )
                resume_rows.append(row)
    report(
        "webdataset",
        {
            "Index (512-byte headers, ranged reads)": (
                ["set", "where", "shards", "GB", "index s", "MB read", "of the shards' bytes", "ranged GETs"],
                index_rows,
            ),
            f"Images/s, {args.workers} workers, batch {args.batch_size}, to {args.image_size} px, medians of "
            f"{args.rounds} rounds": (["set", "loader", "images/s", "of the imagefolder"], speed_rows),
            "Shuffle quality": (
                ["set", "batch", "shards", "ours: distinct shards a batch", "webdataset: distinct shards a batch"],
                shuffle_rows,
            ),
            "Resume at sample 10^6, index cached": (
                [
                    "set",
                    "where",
                    "resumed at sample",
                    "setup s",
                    "first batch s",
                    "ranged GETs",
                    "samples at or after the position",
                ],
                resume_rows,
            ),  # fmt: skip
        },
        {"num_samples": args.num_samples, "shards": args.shards, "distinct": args.distinct, "sets": list(sets)},
        checks,
        results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
