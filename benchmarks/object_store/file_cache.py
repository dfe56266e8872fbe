"""The node-local file cache on images read by URL: bytes fetched and images/s for no cache, LRU and
ours (eviction by the plan's next use), against the offline optimum for the order.

Rows of a saved dataset name JPEG images in the bucket by URL; ``ImageTextDataModule`` trains
``epochs`` epochs over them through the proxy adding ``delay`` ms to every request, with a cache of
half and a quarter of the images' bytes (the data 2x and 4x the budget). Bytes fetched are the bodies
of the GETs the proxy answered, per epoch; the optimum is Belady's rule with the same admission
(an item needed after everything it would displace is not kept), run offline on the plan's order of
the node's reads, and LRU's simulation beside it.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from PIL import Image

from benchmarks.object_store.serve import StoreProcess
from benchmarks.object_store.server import create_bucket, storage_options
from datamodules import ImageTextDataModule
from examples.default_images import train_caption_tokenizer

BUCKET = "images"
POLICIES = {"none": "no cache", "lru": "LRU", "planned": "ours: plan's next use"}
COLUMNS = ["cache", "data / budget", "epochs", "MB fetched", "fetched / data", "optimum / data", "x optimum"]
COLUMNS += ["LRU simulated / data", "images/s", "x no cache"]


def write_images(folder: Path, count: int, side: int) -> dict[str, int]:
    """``count`` JPEGs of noise (they do not compress: ~``side``^2 x 1.5 bytes each), by name: size."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sizes = {}
    for i in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
        (folder / f"{i:05d}.jpg").write_bytes(buffer.getvalue())
        sizes[f"{i:05d}.jpg"] = len(buffer.getvalue())
    return sizes


def simulate(order: list[int], sizes: list[int], budget: int, rule: str) -> list[int]:
    """Bytes fetched at each read of ``order`` (item ids) by a cache of ``budget`` bytes: ``"belady"``
    evicts the item used furthest ahead, and keeps a fetched item out when it is used after every item
    it would displace; ``"lru"`` keeps every item, evicting the least recently used."""
    following = [len(order)] * len(order)  # the next read of the same item
    last: dict[int, int] = {}
    for t in range(len(order) - 1, -1, -1):
        following[t] = last.get(order[t], len(order) + 1)
        last[order[t]] = t
    cache: dict[int, int] = {}  # item -> its next use (belady) or last use (lru)
    held, fetched = 0, []
    for t, item in enumerate(order):
        if item in cache:
            cache[item] = following[t] if rule == "belady" else t
            fetched.append(0)
            continue
        fetched.append(sizes[item])
        rank = following[t] if rule == "belady" else t
        victims, room = [], budget - held
        for victim in sorted(cache, key=cache.get, reverse=rule == "belady"):
            if room >= sizes[item] or (rule == "belady" and cache[victim] <= rank):
                break
            victims.append(victim)
            room += sizes[victim]
        if room >= sizes[item]:
            for victim in victims:
                held -= sizes[victim]
                del cache[victim]
            cache[item] = rank
            held += sizes[item]
    return fetched


def run(store: StoreProcess, delay: int, data: Path, tokenizer: str, epochs: int, workers: int, **cache: Any) -> dict:
    """Bytes fetched and seconds of each epoch, and the plan's order of the images read."""
    dm = ImageTextDataModule(
        str(data), tokenizer=tokenizer, max_text_len=32, num_image_tokens=4, image_size=64, batch_size=8,
        num_workers=workers, storage_options=storage_options(store.proxies[delay]), **cache,
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    fetched, seconds = [], []
    for _ in range(epochs):
        before, start = store.counts(delay)["get_bytes"], time.perf_counter()
        images = sum(len(batch["input_ids"]) for batch in dm.train_dataloader())
        seconds.append(time.perf_counter() - start)
        fetched.append(store.counts(delay)["get_bytes"] - before)
    order = dm.plan.locate_in_passes(np.arange(epochs * images))[1].tolist()  # rows = images, in order
    return {"fetched": fetched, "seconds": seconds, "order": order, "images": images}


def measure(
    store: StoreProcess,
    directory: Path,
    count: int,
    side: int,
    epochs: int,
    factors: list[int],
    delay: int,
    workers: int,
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], dict[str, bool]]:
    """The table's rows and the goals' checks."""
    sizes = write_images(directory / "images", count, side)
    create_bucket(store.endpoint, BUCKET)
    import s3fs

    s3fs.S3FileSystem(**storage_options(store.endpoint)).put(
        str(directory / "images"), f"{BUCKET}/jpegs", recursive=True
    )
    names = sorted(sizes)
    rows = datasets.Dataset.from_dict(
        {"image": [f"s3://{BUCKET}/jpegs/{n}" for n in names], "text": [f"picture {n}" for n in names]}
    )
    rows.save_to_disk(directory / "rows")
    tokenizer = str(train_caption_tokenizer(rows["text"], directory / "tokenizer"))
    data, total = directory / "rows", sum(sizes.values())
    item_sizes = [sizes[n] for n in names]
    runs = {("none", 0): run(store, delay, data, tokenizer, epochs, workers)}
    log(f"file cache: no cache, {epochs} epochs of {count} images in {sum(runs['none', 0]['seconds']):.1f} s")
    for factor in factors:
        for policy in ("lru", "planned"):
            cache = {"file_cache_bytes": total // factor, "file_cache_policy": policy}
            cache["file_cache_dir"] = str(directory / f"cache-{policy}-{factor}")
            runs[policy, factor] = run(store, delay, data, tokenizer, epochs, workers, **cache)
            log(f"file cache: {policy}, data {factor}x the budget, {sum(runs[policy, factor]['seconds']):.1f} s")
    table, checks = [], {}
    none = runs["none", 0]
    for factor in factors:
        order = runs["planned", factor]["order"]
        optimum = np.cumsum(simulate(order, item_sizes, total // factor, "belady")).tolist()
        lru_simulated = np.cumsum(simulate(order, item_sizes, total // factor, "lru")).tolist()
        for e in sorted({1, 2, epochs} | ({4} if epochs >= 4 else set())):
            reads = e * none["images"]
            for policy in ("none", "lru", "planned"):
                result = runs[policy, 0 if policy == "none" else factor]
                fetched, rate = sum(result["fetched"][:e]), reads / sum(result["seconds"][:e])
                table.append({
                    "cache": POLICIES[policy],
                    "data / budget": f"{factor}x",
                    "epochs": e,
                    "MB fetched": fetched / 1e6,
                    "fetched / data": fetched / total,
                    "optimum / data": optimum[reads - 1] / total,
                    "x optimum": fetched / optimum[reads - 1],
                    "LRU simulated / data": lru_simulated[reads - 1] / total,
                    "images/s": rate,
                    "x no cache": rate / (reads / sum(none["seconds"][:e])),
                })  # fmt: skip
            ours = table[-1]
            checks[f"ours within 2% of the offline optimum: data {factor}x the budget, {e} epochs"] = bool(
                ours["x optimum"] <= 1.02
            )
        first = runs["planned", factor]["seconds"][0]
        checks[f"ours, all misses (epoch 1, data {factor}x the budget): images/s at least 0.95x no cache's"] = bool(
            none["seconds"][0] / first >= 0.95
        )
    return table, checks
