"""Image-text, video and hidden-state sources read from an S3 server on 127.0.0.1 (moto): the same
batches as from the same files on disk, with and without a node-local file cache."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlparse

import datasets
import numpy as np
import pytest
import torch

from benchmarks.object_store.server import S3Proxy, create_bucket, storage_options
from datamodules import HiddenStatesDataModule, ImageTextDataModule, VideoDataModule
from tests.speculative.speculative_data import speculative_dataset
from tests.vision.image_data import image_folder, tokenizer_for
from tests.vision.video_data import video_caption, video_folder

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "media"


@pytest.fixture(scope="module")
def endpoint(endpoint: str) -> str:
    """The session's S3 server, with this module's bucket."""
    create_bucket(endpoint, BUCKET)
    return endpoint


def upload(endpoint: str, local: Path, key: str) -> str:
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(local), f"{BUCKET}/{key}", recursive=True)
    return f"s3://{BUCKET}/{key}"


def same_batches(want: list[dict], got: list[dict]) -> None:
    assert len(want) == len(got) > 0
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key], key


def epochs(dm: object, count: int = 2) -> list[dict]:
    dm.prepare_data()
    dm.setup("fit")
    return [batch for _ in range(count) for batch in dm.train_dataloader()]


IMAGE_OPTIONS = {"max_text_len": 40, "batch_size": 4, "num_image_tokens": 4, "image_size": 16}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_image_text_from_a_saved_dataset_and_from_image_urls_equals_the_local_batches(
    tmp_path: Path, endpoint: str, num_workers: int
) -> None:
    tokenizer = tokenizer_for(tmp_path / "tok")
    folder = image_folder(tmp_path / "images", 8, prompts=False)
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".png", ".jpg"))
    images_url = upload(endpoint, folder, f"images-{num_workers}")
    texts = [f"caption of {name}" for name in names]
    local_paths = datasets.Dataset.from_dict({"image": [str(folder / n) for n in names], "text": texts})
    url_paths = datasets.Dataset.from_dict({"image": [f"{images_url}/{n}" for n in names], "text": texts})
    local_paths.save_to_disk(tmp_path / "by-path")
    url_paths.save_to_disk(tmp_path / "by-url")
    saved_url = upload(endpoint, tmp_path / "by-url", f"by-url-{num_workers}")
    common = {**IMAGE_OPTIONS, "tokenizer": tokenizer, "num_workers": num_workers}
    want = epochs(ImageTextDataModule(str(tmp_path / "by-path"), **common))
    proxy = S3Proxy(endpoint)
    try:
        remote = {"storage_options": storage_options(proxy.url)}
        # The dataset on the server, its images too; then only the images, kept in a node-local cache.
        same_batches(want, epochs(ImageTextDataModule(saved_url, **common, **remote)))
        cached = {"file_cache_dir": str(tmp_path / "cache"), "file_cache_bytes": 10**8}
        proxy.reset_counts()
        same_batches(want, epochs(ImageTextDataModule(str(tmp_path / "by-url"), **common, **remote, **cached)))
        assert proxy.ranged_gets == len(names)  # the second epoch read the cache
    finally:
        proxy.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_video_clips_and_manifest_from_s3_equal_the_local_batches(
    tmp_path: Path, endpoint: str, num_workers: int
) -> None:
    from examples.default_images import train_caption_tokenizer

    texts = [f"{video_caption(i)} describe the clip" for i in range(50)]
    tokenizer = str(train_caption_tokenizer(texts, tmp_path / "tokenizer", vocab_size=300))
    root = video_folder(tmp_path / "videos", 6, broken={4: "corrupt"})
    url = upload(endpoint, root, f"videos-{num_workers}")
    common = {
        "max_text_len": 24, "batch_size": 2, "image_size": 16, "frame_options": {"fps": 2.0}, "max_frames": 4,
        "num_video_tokens": 2, "prompt": "describe the clip", "num_workers": num_workers,
    }  # fmt: skip
    want = epochs(VideoDataModule(str(root), tokenizer, **common))
    remote = {"storage_options": storage_options(endpoint)}
    same_batches(want, epochs(VideoDataModule(url, tokenizer, **common, **remote)))
    cached = {"file_cache_dir": str(tmp_path / "cache"), "file_cache_bytes": 10**8}
    dm = VideoDataModule(url, tokenizer, **common, **remote, **cached)
    same_batches(want, epochs(dm))
    assert len(os.listdir(tmp_path / "cache" / "items")) == 6  # every clip kept
    assert dm.source.files.cache_dir == str(tmp_path / "cache")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hidden_states_from_s3_equal_the_local_batches_and_a_missing_file_is_skipped_alike(
    tmp_path: Path, endpoint: str, num_workers: int
) -> None:
    data_dir = speculative_dataset(tmp_path, 24)
    (data_dir / "hidden_states" / "hs_5.safetensors").unlink()
    url = upload(endpoint, data_dir, f"speculative-{num_workers}")
    # Workers spawned (this DataModule's default): each makes its own S3 client, none inherited.
    common = {"total_seq_len": 64, "on_missing": "skip", "num_workers": num_workers}
    local = HiddenStatesDataModule(str(data_dir), **common)
    want = epochs(local)
    remote = HiddenStatesDataModule(url, **common, storage_options=storage_options(endpoint))
    same_batches(want, epochs(remote))
    assert len(remote.bad_samples.reasons) == len(local.bad_samples.reasons) == 1


def test_hidden_states_on_s3_set_up_from_the_dataset_files_and_a_wrong_folder_fails_in_a_few_requests(
    tmp_path: Path, endpoint: str
) -> None:
    from benchmarks.object_store.server import S3Proxy

    data_dir = speculative_dataset(tmp_path, 60)
    url = upload(endpoint, data_dir, "speculative-setup")
    proxy = S3Proxy(endpoint)
    try:
        dm = HiddenStatesDataModule(url, total_seq_len=64, storage_options=storage_options(proxy.url))
        dm.setup("fit")
        fetched = [path for method, path in proxy.paths if method == "GET" and "/hidden_states/" in path]
        # The dataset's own files only; the states' shape from one file's header: two small ranged reads.
        ranged = [path for path, _ in proxy.requests if "/hidden_states/" in path]
        assert len(fetched) == len(ranged) == 2 and len(set(fetched)) == 1, fetched
        proxy.reset_counts()
        wrong = HiddenStatesDataModule(
            url, total_seq_len=64, hidden_states_dir=f"{url}/nowhere", storage_options=storage_options(proxy.url)
        )
        with pytest.raises(ValueError, match="no hidden states found for any of the 60 rows in .*nowhere: none for"):
            wrong.setup("fit")
        assert sum(proxy.methods.values()) < 60, proxy.methods  # a bounded probe, not 2 requests a row
    finally:
        proxy.close()


def test_a_missing_bucket_or_folder_is_one_line_at_setup(tmp_path: Path, endpoint: str) -> None:
    tokenizer = tokenizer_for(tmp_path / "tok")
    dm = ImageTextDataModule(
        f"s3://{BUCKET}/no-such-dataset",
        tokenizer=tokenizer,
        storage_options=storage_options(endpoint),
        **IMAGE_OPTIONS,
    )
    with pytest.raises(ValueError, match=f"'s3://{BUCKET}/no-such-dataset' does not exist"):
        dm.prepare_data()
    video = VideoDataModule(
        f"s3://{BUCKET}/no-such-videos",
        tokenizer,
        max_text_len=24,
        batch_size=2,
        storage_options=storage_options(endpoint),
    )
    with pytest.raises(ValueError, match=f"is not a file: s3://{BUCKET}/no-such-videos/captions.jsonl does not exist"):
        video.prepare_data()
    with pytest.raises(ValueError, match="is not a folder written by datasets' save_to_disk"):
        HiddenStatesDataModule(
            f"s3://{BUCKET}/no-such-data", total_seq_len=64, storage_options=storage_options(endpoint)
        ).setup("fit")


def test_a_url_folder_that_is_not_a_saved_dataset_says_how_to_read_files_at_urls(tmp_path: Path, endpoint: str) -> None:
    folder = image_folder(tmp_path / "images", 2)
    url = upload(endpoint, folder, "plain-folder")
    dm = ImageTextDataModule(
        url, tokenizer=tokenizer_for(tmp_path / "tok"), storage_options=storage_options(endpoint), **IMAGE_OPTIONS
    )
    with pytest.raises(ValueError, match=r"is not a save_to_disk folder; for files at URLs, give a builder"):
        dm.prepare_data()


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_text_from_data_files_in_a_bucket_equals_the_local_batches(
    tmp_path: Path, endpoint: str, streaming: bool
) -> None:
    from datamodules import HFTextDataModule
    from examples.default_corpus import train_tokenizer

    docs = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 4 + 1) for i in range(60)]
    (tmp_path / "corpus.txt").write_text("\n".join(docs))
    tokenizer = str(train_tokenizer([tmp_path / "corpus.txt"], tmp_path / "tokenizer", vocab_size=300))
    local = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": docs}).to_parquet(local, batch_size=20)
    url = upload(endpoint, local, f"text-{streaming}/docs.parquet")
    common = {"seq_len": 16, "batch_size": 2, "num_proc": 1, "streaming": streaming, "pack_sequences": True}
    if streaming:  # each of 2 workers reads its own row groups, from the bucket
        common.update(steps_per_epoch=6, num_workers=2)

    def dm(data_files: str, cache: str, **kwargs: object) -> HFTextDataModule:
        return HFTextDataModule(
            "parquet", tokenizer, data_files=data_files, cache_dir=str(tmp_path / cache), **common, **kwargs
        )

    want = epochs(dm(str(local), "local"))
    got = epochs(dm(url, "remote", storage_options=storage_options(endpoint)))
    same_batches(want, got)


def test_generated_hidden_states_are_kept_in_and_deleted_from_a_bucket(endpoint: str) -> None:
    from datamodules.speculative.hidden_states_store import HiddenStateFiles
    from datamodules.storage.remote_files import RemoteFiles

    store = HiddenStateFiles(f"s3://{BUCKET}/generated/hidden_states", RemoteFiles(storage_options(endpoint)))
    states = {"hidden_states": torch.randn(5, 2, 4), "token_ids": torch.arange(5)}
    assert store.lookup(3) is None
    store.cache(3, states)
    found = store.lookup(3)
    assert found is not None and all(torch.equal(found[key], states[key]) for key in states)
    store.delete(store.describe(3))
    assert store.lookup(3) is None


def test_requests_other_than_ranged_reads_are_retried_within_the_same_budget(endpoint: str) -> None:
    """HEADs, listings, PUTs and DELETEs of generated hidden states survive transient faults (the
    client's own retries are off: ours are the only ones), and one that keeps failing is given up
    after 5 attempts with a message naming the object."""
    from datamodules.speculative.hidden_states_store import HiddenStateFiles
    from datamodules.storage.remote_files import RemoteFiles

    proxy = S3Proxy(endpoint)
    try:
        store = HiddenStateFiles(f"s3://{BUCKET}/faults/hidden_states", RemoteFiles(storage_options(proxy.url)))
        states = {"hidden_states": torch.randn(5, 2, 4), "token_ids": torch.arange(5)}
        proxy.other_faults = ["503", "reset"]
        store.cache(3, states)  # the PUT: a 503, then a reset connection, then stored
        assert not proxy.other_faults and proxy.puts == [f"/{BUCKET}/faults/hidden_states/hs_3.safetensors"] * 3
        proxy.other_faults = ["reset", "503"]
        found = store.lookup(3)  # the size (a HEAD), then the ranged read
        assert found is not None and torch.equal(found["hidden_states"], states["hidden_states"])
        proxy.other_faults = ["503"]
        assert store.cached_indices() == [3]  # the listing
        proxy.other_faults = ["503"]
        store.delete(store.describe(3))
        assert store.lookup(3) is None and not proxy.other_faults

        store.cache(4, states)
        proxy.reset_counts()
        proxy.other_faults = ["503"] * 20
        failed = r"reading the size of s3://media/faults/hidden_states/hs_4\.safetensors failed 5 times; last: "
        with pytest.raises(OSError, match=failed + ".*(Unavailable|reduce your request rate)"):
            store.lookup(4)
        # Per attempt, a HEAD and at most s3fs's listing fallback.
        assert proxy.methods["HEAD"] + proxy.methods["GET"] <= 5 * 2
    finally:
        proxy.close()


def noise_folder(root: Path, count: int, side: int) -> Path:
    """An imagefolder of ``count`` PNGs of random noise (``side`` pixels square: incompressible, so
    each is about ``3 * side**2`` bytes) with captions."""
    from PIL import Image

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(root / f"{i:04d}.png")
        rows.append({"file_name": f"{i:04d}.png", "text": f"caption of picture {i}"})
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_webdataset_shards_in_a_bucket_are_indexed_by_their_headers_and_read_from_the_resume_position(
    tmp_path: Path, endpoint: str
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from datamodules.storage.tar_index import shard_locations
    from tests.support import RecordingModel, quiet_trainer
    from tests.vision.webdataset_data import shards_of_folder

    pytest.importorskip("webdataset")
    tokenizer = tokenizer_for(tmp_path / "tok")
    folder = noise_folder(tmp_path / "images", 12, side=128)  # about 49 KB a member
    pattern = shards_of_folder(folder, tmp_path / "shards", per_shard=4)
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / "shards").iterdir())
    url = upload(endpoint, tmp_path / "shards", "wds")
    url_pattern = f"{url}/{Path(pattern).name}"
    common = {**IMAGE_OPTIONS, "tokenizer": tokenizer, "batch_size": 2, "image_field": "png", "text_field": "txt"}
    want = epochs(ImageTextDataModule("webdataset", data_files=pattern, **common,
                                      load_kwargs={"cache_dir": str(tmp_path / "local-index")}))  # fmt: skip
    names = [f"{url}/shard-{i:06d}.tar" for i in range(3)]
    assert shard_locations(url_pattern) == names  # a brace pattern: no request
    assert shard_locations(f"{url}/*.tar", storage_options(endpoint)) == names  # a glob: a listing
    assert shard_locations(url, storage_options(endpoint)) == names  # a folder: its .tar objects
    proxy = S3Proxy(endpoint)
    try:

        def remote(**more: object) -> ImageTextDataModule:
            options = {"storage_options": storage_options(proxy.url), "load_kwargs": {"cache_dir": str(tmp_path / "i")}}
            return ImageTextDataModule("webdataset", data_files=url_pattern, **common, **options, **more)

        dm = remote()
        dm.setup("fit")  # the index (built at setup, where a job's ranks share it): ranged reads of the headers only
        assert 0 < proxy.bytes_sent < shard_bytes / 4, (proxy.bytes_sent, shard_bytes)
        proxy.reset_counts()
        same_batches(want, epochs(dm))  # the index read from the cache: no header read again
        assert 2 * 6 <= proxy.ranged_gets <= 2 * 12  # a request a sample or a micro-batch's two, each epoch

        # Stopped at step 3 (6 samples), resumed to the epoch's end: only the later samples are fetched.
        trainer = quiet_trainer(max_steps=3, callbacks=[ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3)])
        trainer.fit(RecordingModel(), datamodule=remote())
        proxy.reset_counts()
        resumed = remote()
        checkpoint = next((tmp_path / "ckpt").glob("*.ckpt"))
        quiet_trainer(max_steps=6).fit(RecordingModel(), datamodule=resumed, ckpt_path=checkpoint)
        rows = resumed._train.dataset
        later = resumed.plan.locate(np.arange(6, 12))[1].tolist()  # the samples of positions 6 to 11

        def span(row: int) -> tuple[str, int, int]:
            (shard,), (start,), (end,) = rows.shards.spans([row])
            where = urlparse(rows.locations[shard])
            return f"/{where.netloc}{where.path}", start, end

        def joined(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
            """The byte ranges of each object, those that touch as one (a micro-batch's adjacent samples)."""
            out: list[tuple[str, int, int]] = []
            for path, start, end in sorted(ranges):
                if out and out[-1][0] == path and out[-1][2] == start:
                    start = out.pop()[1]
                out.append((path, start, end))
            return out

        requested = [(path, *map(int, bytes_range[6:].split("-"))) for path, bytes_range in proxy.requests]
        read = [(path, start, end + 1) for path, start, end in requested]
        assert joined(read) == joined(list(map(span, later))) and len(read) <= len(later)  # those rows only

        # A shard replaced under the running job: its next read is refused, not mixed with the old index.
        replaced = tmp_path / "replaced.tar"
        replaced.write_bytes((tmp_path / "shards" / "shard-000000.tar").read_bytes()[::-1])
        s3fs.S3FileSystem(**storage_options(endpoint)).put(str(replaced), f"{BUCKET}/wds/shard-000000.tar")
        rows.reader.verify_every = 0.0
        with pytest.raises(OSError, match=r"shard-000000\.tar changed during the run"):
            rows.prefetch([0])
    finally:
        proxy.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_webdataset_shard_replaced_in_the_bucket_under_a_run_stops_it_naming_the_shard(
    tmp_path: Path, endpoint: str, num_workers: int
) -> None:
    from datamodules.storage.range_reader import ChangedDuringRun
    from tests.support import RecordingModel, quiet_trainer
    from tests.vision.webdataset_data import ChangeAfterStep, captions_rewritten, shards_of_folder

    pytest.importorskip("webdataset")
    shards_of_folder(image_folder(tmp_path / "images", 24, prompts=False), tmp_path / "shards", per_shard=6)
    url = upload(endpoint, tmp_path / "shards", f"wds-replaced-{num_workers}")
    last = tmp_path / "shards" / "shard-000003.tar"
    dm = ImageTextDataModule(
        "webdataset",
        data_files=f"{url}/shard-{{000000..000003}}.tar",
        **{**IMAGE_OPTIONS, "tokenizer": tokenizer_for(tmp_path / "tok")},
        image_field="jpg;png",
        text_field="txt",
        on_bad_sample="skip",
        num_workers=num_workers,
        storage_options=storage_options(endpoint),
        load_kwargs={"cache_dir": str(tmp_path / "index")},
    )

    def replace() -> None:  # the same size and tar headers, other captions: only its ETag tells
        last.write_bytes(captions_rewritten(last))
        upload(endpoint, last, f"wds-replaced-{num_workers}/{last.name}")

    # 6 steps an epoch, 12 in all: the shard is read again after the change, each read carrying its ETag.
    with pytest.raises(ChangedDuringRun, match=rf"{url}/shard-000003\.tar changed during the run: .* ETag"):
        quiet_trainer(max_steps=12, callbacks=[ChangeAfterStep(2, replace)]).fit(RecordingModel(), datamodule=dm)
    assert not dm.bad_samples.reasons
