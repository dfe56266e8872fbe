"""The node-local file cache that evicts by the plan's next use (Belady's rule), against a
request-counting S3 server on 127.0.0.1: what it fetches equals the offline optimum the test computes
for the order the server saw, and is less than LRU's; batches equal the uncached ones."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.loggers import CSVLogger

from benchmarks.object_store.server import S3Proxy, create_bucket, storage_options
from datamodules import HiddenStatesDataModule, ImageTextDataModule, TokenShardDataModule, VideoDataModule
from tests.distributed_support import train_record
from tests.support import RecordingModel, logged_rows, make_token_shards, quiet_trainer
from tests.vision.image_data import image_folder, tokenizer_for
from tests.vision.video_data import video_caption, video_folder

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "planned-cache"
IMAGES = 24
SEED = 0  # an order in which Belady's rule keeps an item out in the first epoch
OPTIONS = {"seed": SEED, "max_text_len": 40, "batch_size": 4, "num_image_tokens": 4, "image_size": 16}


@pytest.fixture(scope="module")
def by_url(endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, int]]:
    """A saved dataset whose rows name their images by URL, a tokenizer, and each image's size."""
    root = tmp_path_factory.mktemp("planned")
    folder = image_folder(root / "images", IMAGES, prompts=False)
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".png", ".jpg"))
    create_bucket(endpoint, BUCKET)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(folder), f"{BUCKET}/images", recursive=True)
    urls = [f"s3://{BUCKET}/images/{name}" for name in names]
    datasets.Dataset.from_dict({"image": urls, "text": [f"caption of {n}" for n in names]}).save_to_disk(root / "ds")
    sizes = {f"/{BUCKET}/images/{name}": (folder / name).stat().st_size for name in names}
    return root / "ds", tokenizer_for(root / "tok"), sizes


def two_epochs(proxy: S3Proxy, data: Path, tokenizer: str, **cache: object) -> tuple[list, list[str], list[str]]:
    """Batches of two epochs, and the images fetched (server paths, in order) in each."""
    dm = ImageTextDataModule(
        str(data), tokenizer=tokenizer, storage_options=storage_options(proxy.url), **OPTIONS, **cache
    )
    return epochs_fetched(dm, proxy)


def epochs_fetched(dm: LightningDataModule, proxy: S3Proxy, ranges: bool = False) -> tuple[list, list[str], list[str]]:
    """Batches of two epochs, and the objects (``ranges``: ``path#bytes=a-b``) fetched in each, in order."""
    dm.prepare_data()
    dm.setup("fit")
    batches, fetched = [], []
    for _ in range(2):
        proxy.reset_counts()
        batches += list(dm.train_dataloader())
        fetched.append([f"{path}#{bounds}" if ranges else path for path, bounds in proxy.requests])
    return batches, *fetched


def simulate(order: list[str], sizes: dict[str, int], budget: int, rule: str) -> tuple[list[bool], list[int]]:
    """Whether each read of ``order`` fetches, for a cache of ``budget`` bytes, and when a fetched
    item was kept out. ``"belady"``: on a miss, evict the items used furthest ahead while they are
    used after the missing one, else keep it out; ``"lru"``: keep every item, evicting the least
    recently used."""
    cache: dict[str, int] = {}  # item -> time of last use
    fetches, kept_out = [], []

    def next_use(item: str, now: int) -> float:
        return next((t for t in range(now + 1, len(order)) if order[t] == item), math.inf)

    for now, item in enumerate(order):
        fetches.append(item not in cache)
        if item in cache:
            cache[item] = now
            continue
        room = budget - sum(sizes[i] for i in cache)
        victims = []
        if rule == "belady":
            for victim in sorted(cache, key=lambda i: next_use(i, now), reverse=True):
                if room >= sizes[item] or next_use(victim, now) <= next_use(item, now):
                    break
                victims.append(victim)
                room += sizes[victim]
        else:
            for victim in sorted(cache, key=cache.get):
                if room >= sizes[item]:
                    break
                victims.append(victim)
                room += sizes[victim]
        if room >= sizes[item]:
            for victim in victims:
                del cache[victim]
            cache[item] = now
        else:
            kept_out.append(now)
    return fetches, kept_out


def fetched_bytes(paths: list[str], sizes: dict[str, int]) -> int:
    return sum(sizes[p] for p in paths)


def same_batches(want: list[dict], got: list[dict]) -> None:
    assert len(want) == len(got) > 0
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_two_epochs_over_twice_the_budget_fetch_what_beladys_rule_computes_and_less_than_lru(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]]
) -> None:
    data, tokenizer, sizes = by_url
    budget = sum(sizes.values()) // 2
    proxy = S3Proxy(endpoint)
    try:
        want, first, second = two_epochs(proxy, data, tokenizer)
        order = first + second  # uncached, every read is a GET: the order the server saw
        assert sorted(first) == sorted(second) == sorted(sizes)
        runs = {}
        for policy in ("planned", "lru"):
            cache = {"file_cache_dir": str(tmp_path / policy), "file_cache_bytes": budget, "file_cache_policy": policy}
            batches, *runs[policy] = two_epochs(proxy, data, tokenizer, **cache)
            same_batches(want, batches)
    finally:
        proxy.close()
    for policy, rule in (("planned", "belady"), ("lru", "lru")):
        fetches, kept_out = simulate(order, sizes, budget, rule)
        expected = [item for item, fetch in zip(order, fetches, strict=True) if fetch]
        assert runs[policy][0] + runs[policy][1] == expected, policy  # the same fetches, in order
        if policy == "planned":  # the order exercises both halves of the rule: an item kept out that is read again
            assert [t for t in kept_out if t < len(first)]
    planned, lru = (fetched_bytes(runs[p][1], sizes) for p in ("planned", "lru"))
    assert 0 < planned < lru < fetched_bytes(second, sizes)


def test_two_ranks_with_two_workers_on_one_node_fetch_each_image_once(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]]
) -> None:
    """Four processes share the node's cache over two epochs of rows naming 2 images 48 times each,
    from a store that answers in 50 ms: the processes ask for one image at once, and fetch it once."""
    data, tokenizer, _ = by_url
    images = datasets.load_from_disk(str(data)).select(range(2))
    datasets.concatenate_datasets([images] * 48).save_to_disk(tmp_path / "captions")  # 96 rows
    proxy = S3Proxy(endpoint, delay=0.05)
    try:
        args = ["--image-urls", str(tmp_path / "captions"), "--tokenizer", tokenizer, "--seq-len", "40"]
        args += ["--batch-size", "4", "--devices", "2", "--workers", "2", "--max-epochs", "2"]
        args += ["--storage-options", json.dumps(storage_options(proxy.url)), "--cache-dir", str(tmp_path / "node")]
        args += ["--file-cache-bytes", str(10**8)]
        run = train_record(args, tmp_path / "run")
        fetched = Counter(path for path, _ in proxy.requests)
    finally:
        proxy.close()
    assert len(run.rows(0)) == len(run.rows(1)) == 96  # two epochs of 12 steps x 4 rows, each rank
    paths = ["/" + url.removeprefix("s3://") for url in images["image"]]  # as the server names them
    assert fetched == Counter(paths)  # every image once, for the node


def test_the_cache_is_in_the_data_summary_and_its_counts_reach_the_logger_every_step(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]], caplog: pytest.LogCaptureFixture
) -> None:
    data, tokenizer, sizes = by_url
    budget = sum(sizes.values()) // 2
    proxy = S3Proxy(endpoint)
    try:
        dm = ImageTextDataModule(
            str(data), tokenizer=tokenizer, storage_options=storage_options(proxy.url), **OPTIONS,
            file_cache_dir=str(tmp_path / "cache"), file_cache_bytes=budget, num_workers=2,
        )  # fmt: skip
        logger = CSVLogger(tmp_path, name="logs")
        with caplog.at_level(logging.INFO):
            quiet_trainer(max_epochs=2, logger=logger, log_every_n_steps=1).fit(RecordingModel(), datamodule=dm)
    finally:
        proxy.close()
    assert f"file cache {tmp_path / 'cache'}: {budget:,} bytes shared by the node" in caplog.text
    rows = logged_rows(logger.log_dir)
    steps = 2 * IMAGES // OPTIONS["batch_size"]
    assert sorted(step for step, row in rows.items() if "file_cache/hits" in row) == list(range(steps))
    last = {key.removeprefix("file_cache/"): float(value) for key, value in rows[steps - 1].items()}
    assert last["hits"] + last["misses"] == 2 * IMAGES and last["bytes_read"] == 2 * sum(sizes.values())
    assert last["misses"] == proxy.ranged_gets and last["bytes_fetched"] == proxy.bytes_sent  # what the server sent
    assert last["hit_rate"] == last["hits"] / (2 * IMAGES) > 0
    assert last["not_kept"] > 0 and last["evictions"] > 0


def test_video_clips_are_cached_by_their_next_use_as_images_are(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]]
) -> None:  # by_url: the bucket
    from examples.default_images import train_caption_tokenizer

    tokenizer = str(train_caption_tokenizer([video_caption(i) for i in range(50)], tmp_path / "tok", vocab_size=300))
    root = video_folder(tmp_path / "videos", 10)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(root), f"{BUCKET}/videos", recursive=True)
    sizes = {f"/{BUCKET}/videos/clips/{p.name}": p.stat().st_size for p in (root / "clips").iterdir()}
    common = {"max_text_len": 24, "batch_size": 2, "image_size": 16, "frame_options": {"fps": 2.0}, "max_frames": 4}
    proxy = S3Proxy(endpoint)
    try:
        url, options = f"s3://{BUCKET}/videos", {"storage_options": storage_options(proxy.url), "seed": 3}
        want, first, second = epochs_fetched(VideoDataModule(url, tokenizer, **common, **options), proxy)
        budget = sum(sizes.values()) // 2
        cache = {"file_cache_dir": str(tmp_path / "cache"), "file_cache_bytes": budget}
        got, *fetched = epochs_fetched(VideoDataModule(url, tokenizer, **common, **options, **cache), proxy)
    finally:
        proxy.close()
    same_batches(want, got)
    order = [path for path in first + second if path in sizes]  # the clips (the manifest is read too)
    fetches, _ = simulate(order, sizes, budget, "belady")
    assert [p for p in fetched[0] + fetched[1] if p in sizes] == [p for p, f in zip(order, fetches, strict=True) if f]
    assert sum(fetches) < len(order)  # the second epoch found clips in the cache


def test_webdataset_samples_in_a_bucket_are_cached_as_ranges_by_their_next_use(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]]
) -> None:  # by_url: the bucket
    """Tar shards in a bucket: each sample's range of its shard is an item; two epochs at half the
    budget fetch the ranges Belady's rule computes for the order the server saw, batches as uncached."""
    from tests.vision.webdataset_data import shards_of_folder

    pytest.importorskip("webdataset")
    _, tokenizer, _ = by_url
    pattern = shards_of_folder(image_folder(tmp_path / "images", 16, prompts=False), tmp_path / "shards", 4)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(tmp_path / "shards"), f"{BUCKET}/wds", recursive=True)
    url = f"s3://{BUCKET}/wds/{Path(pattern).name}"
    proxy = S3Proxy(endpoint)
    try:
        common = {**OPTIONS, "tokenizer": tokenizer, "data_files": url, "image_field": "png;jpg", "text_field": "txt"}
        common |= {"batch_size": 1, "storage_options": storage_options(proxy.url)}  # a request a sample
        common["load_kwargs"] = {"cache_dir": str(tmp_path / "index")}  # indexed once, before the counts
        want, first, second = epochs_fetched(ImageTextDataModule("webdataset", **common), proxy, ranges=True)
        order = first + second  # an item a request: a sample's range of its shard
        sizes = {item: 1 + int(item.split("-")[-1]) - int(item.split("=")[-1].split("-")[0]) for item in order}
        budget = sum(sizes.values()) // 2
        cache = {"file_cache_dir": str(tmp_path / "cache"), "file_cache_bytes": budget}
        got, *fetched = epochs_fetched(ImageTextDataModule("webdataset", **common, **cache), proxy, ranges=True)
    finally:
        proxy.close()
    same_batches(want, got)
    fetches, kept_out = simulate(order, sizes, budget, "belady")
    assert fetched[0] + fetched[1] == [item for item, fetch in zip(order, fetches, strict=True) if fetch]
    assert sum(fetches) < len(order) and kept_out


def test_token_windows_of_shards_in_a_bucket_are_cached_by_their_next_use(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]]
) -> None:  # by_url: the bucket
    """Each window's piece of a shard is an item (a window across two shards is two): two epochs at
    half the budget fetch the pieces Belady's rule computes for the order trained, batches as uncached."""
    seq_len, shard_tokens, width = 16, 200, 17
    make_token_shards(tmp_path / "shards", 640, shard_tokens=shard_tokens)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(tmp_path / "shards"), f"{BUCKET}/tokens", recursive=True)
    shards = sorted(p.name for p in (tmp_path / "shards").iterdir() if p.name.startswith("shard_"))
    header = (tmp_path / "shards" / shards[0]).stat().st_size - 4 * shard_tokens  # .npy: uint32 after a header
    proxy = S3Proxy(endpoint)
    try:
        common = {"seq_len": seq_len, "batch_size": 4, "storage_options": storage_options(proxy.url), "seed": 1}
        url = f"s3://{BUCKET}/tokens"
        want, *_ = epochs_fetched(TokenShardDataModule(url, **common), proxy, ranges=True)

        def pieces(start: int) -> list[tuple[str, int, int]]:  # (shard, first byte, end byte) of a window
            out, t = [], start
            while t < start + width:
                shard, local = divmod(t, shard_tokens)
                take = min(start + width - t, shard_tokens - local)
                out.append((f"/{BUCKET}/tokens/{shards[shard]}", header + 4 * local, header + 4 * (local + take)))
                t += take
            return out

        order = [piece for batch in want for start in batch["input_ids"][:, 0].tolist() for piece in pieces(start)]
        sizes = {piece: piece[2] - piece[1] for piece in order}
        budget = sum(sizes.values()) // 2
        cache = {"file_cache_dir": str(tmp_path / "cache"), "file_cache_bytes": budget}
        got, *fetched = epochs_fetched(TokenShardDataModule(url, **common, **cache), proxy, ranges=True)
    finally:
        proxy.close()
    same_batches(want, got)
    assert any(len(pieces(start)) == 2 for start in range(0, 640 - width, seq_len))  # windows across shards

    def covered(requests: list[str]) -> set[tuple[str, int, int]]:  # the pieces each (merged) request holds
        out = set()
        for request in requests:
            path, bounds = request.split("#bytes=")
            first, last = map(int, bounds.split("-"))
            out |= {p for p in sizes if p[0] == path and first <= p[1] and p[2] - 1 <= last}
        return out

    fetches, kept_out = simulate(order, sizes, budget, "belady")
    half = len(order) // 2
    assert covered(fetched[0]) == set(order[:half])
    assert covered(fetched[1]) == {p for p, f in zip(order[half:], fetches[half:], strict=True) if f}
    assert 0 < sum(fetches[half:]) < half and kept_out


def test_hidden_state_files_are_cached_by_their_next_use(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]]
) -> None:  # by_url: the bucket
    """Packed rows of conversations read each conversation's states file: two epochs (the rows packed
    afresh) at half the budget fetch the files Belady's rule computes for the order the server saw."""
    from tests.speculative.speculative_data import speculative_dataset

    data_dir = speculative_dataset(tmp_path, 24)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(data_dir), f"{BUCKET}/speculative", recursive=True)
    folder = data_dir / "hidden_states"
    sizes = {f"/{BUCKET}/speculative/hidden_states/{p.name}": p.stat().st_size for p in folder.iterdir()}
    proxy = S3Proxy(endpoint)
    try:
        common = {"total_seq_len": 64, "storage_options": storage_options(proxy.url)}
        url = f"s3://{BUCKET}/speculative"
        want, first, second = epochs_fetched(HiddenStatesDataModule(url, **common), proxy)
        order = [path for path in first + second if path in sizes]
        budget = sum(sizes.values()) // 2
        cache = {"file_cache_dir": str(tmp_path / "cache"), "file_cache_bytes": budget}
        got, *fetched = epochs_fetched(HiddenStatesDataModule(url, **common, **cache), proxy)
    finally:
        proxy.close()
    same_batches(want, got)
    assert len(order) > len(set(order))  # files read in both epochs
    fetches, kept_out = simulate(order, sizes, budget, "belady")
    assert [p for p in fetched[0] + fetched[1] if p in sizes] == [p for p, f in zip(order, fetches, strict=True) if f]
    assert sum(fetches) < len(order) and kept_out


def test_packed_documents_naming_images_by_url_are_cached_by_their_next_use(
    tmp_path: Path, endpoint: str, by_url: tuple[Path, str, dict[str, int]]
) -> None:
    """Interleaved documents packed several a row, packed afresh every pass: the node's next uses of
    each image come from every pass's rows; two epochs at half the budget fetch what Belady's rule
    computes for the order the server saw, batches as uncached."""
    from examples.default_images import SPECIAL_TOKENS

    _, tokenizer, sizes = by_url
    urls = [f"s3:/{path}" for path in sorted(sizes)]
    documents = [[f"page {i} shows", urls[2 * i], "and then", urls[(2 * i + 5) % len(urls)]] for i in range(12)]
    rows = {
        "texts": [[p if not p.startswith("s3:") else None for p in d] for d in documents],
        "images": [[p if p.startswith("s3:") else None for p in d] for d in documents],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "docs")
    proxy = S3Proxy(endpoint)
    try:
        common = {**OPTIONS, "tokenizer": tokenizer, "layout": "obelics", "text_field": "texts",
                  "image_field": "images", "image_token": SPECIAL_TOKENS["image_token"], "pack_sequences": True,
                  "max_text_len": 48, "batch_size": 1, "storage_options": storage_options(proxy.url)}  # fmt: skip
        dm = ImageTextDataModule(str(tmp_path / "docs"), **common)
        want, first, second = epochs_fetched(dm, proxy)
        order = first + second
        assert sorted(first) == sorted(second) == sorted(sizes)  # each image read once a pass
        rows_of = [dm._train.documents(list(range(len(dm._train))), [p] * len(dm._train)) for p in (0, 1)]
        assert [r.tolist() for r in rows_of[0]] != [r.tolist() for r in rows_of[1]]  # packed afresh
        budget = sum(sizes.values()) // 2
        cache = {"file_cache_dir": str(tmp_path / "cache"), "file_cache_bytes": budget}
        got, *fetched = epochs_fetched(ImageTextDataModule(str(tmp_path / "docs"), **common, **cache), proxy)
    finally:
        proxy.close()
    same_batches(want, got)
    fetches, _ = simulate(order, sizes, budget, "belady")
    assert fetched[0] + fetched[1] == [item for item, fetch in zip(order, fetches, strict=True) if fetch]
    assert sum(fetches) < len(order)
