"""Token shards read from an S3 server on 127.0.0.1: moto's ``ThreadedMotoServer`` started here, the
clients (s3fs, boto3) unchanged. The same batches as from the same files on disk, in every layout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.object_store.server import S3Proxy, create_bucket, storage_options
from datamodules import TokenShardDataModule
from datamodules.text.shard_metadata import ShardMetadata
from tests.support import make_token_shards
from tests.text.test_token_shard_datamodule import write_megatron_pair

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "corpora"


options = storage_options


@pytest.fixture(scope="module")
def layouts(endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Local folders of each layout, and the same files uploaded under s3://corpora/<layout>."""
    root = tmp_path_factory.mktemp("layouts")
    prepared = make_token_shards(root / "prepared", 5_000, shard_tokens=1_300, doc_len=37)
    npy = root / "npy"
    npy.mkdir()
    for i, size in enumerate((1_700, 900, 2_300)):
        np.save(npy / f"part_{i}.npy", (np.arange(size) + 10_000 * i).astype(np.uint16))
    parts = root / "parts"
    for index in range(2):
        part = make_token_shards(
            parts / f"part-{index:05d}", 2_000, shard_tokens=700, doc_len=29, first_value=index * 5_000
        )
        metadata = ShardMetadata.read(part)
        metadata.extra.update(part_index=index, num_parts=2)
        metadata.write(part)
    megatron = root / "megatron"
    megatron.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        documents = [[rng.integers(0, 30_000, rng.integers(5, 60)).tolist()] for _ in range(60)]
        write_megatron_pair(megatron / name, documents)
    create_bucket(endpoint, BUCKET)
    fs = s3fs.S3FileSystem(**options(endpoint))
    found = {}
    for folder in (prepared, npy, parts, megatron):
        fs.put(str(folder), f"{BUCKET}/{folder.name}", recursive=True)
        found[folder.name] = (folder, f"s3://{BUCKET}/{folder.name}")
    return found


def batches(dm: TokenShardDataModule, count: int) -> list[dict[str, torch.Tensor]]:
    dm.setup("fit")
    taken, loader = [], iter(dm.train_dataloader())
    while len(taken) < count:
        for batch in loader:
            taken.append(batch)
            if len(taken) == count:
                break
        loader = iter(dm.train_dataloader())  # the next epoch
    return taken


def test_a_range_answering_503_forever_is_requested_max_attempts_times_with_the_defaults(
    layouts: dict, proxy: S3Proxy
) -> None:
    """No client retry loop under ours: botocore's and s3fs's own retries are off by default."""
    from datamodules.text.token_shards import TokenShards

    remote = TokenShards(layouts["npy"][1], storage_options=options(proxy.url))
    reader = remote._readers[0]
    reader.backoff = 0.01
    proxy.faults, before = ["503"] * 50, proxy.ranged_gets
    started = time.monotonic()
    with pytest.raises(OSError, match=r"reading bytes \d+-\d+ of s3://corpora/npy/part_0.npy failed 5 times"):
        remote.read_windows(np.array([10], dtype=np.int64), 100)
    assert proxy.ranged_gets - before == reader.attempts == 5 and time.monotonic() - started < 5
    proxy.faults = []


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    ("layout", "pack"), [("prepared", False), ("prepared", True), ("npy", False), ("parts", True), ("megatron", True)]
)
def test_batches_from_s3_equal_the_batches_from_disk(
    layouts: dict, endpoint: str, layout: str, pack: bool, num_workers: int
) -> None:
    local, url = layouts[layout]
    kwargs = {"seq_len": 16, "batch_size": 4, "pack_sequences": pack, "num_workers": num_workers, "seed": 5}
    expected = batches(TokenShardDataModule(str(local), **kwargs), 30)
    remote = batches(TokenShardDataModule(url, storage_options=options(endpoint), **kwargs), 30)
    assert len(remote) == 30
    for want, got in zip(expected, remote, strict=True):
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key


def test_a_missing_bucket_or_folder_is_one_short_error_at_setup(layouts: dict, endpoint: str) -> None:
    for url in (f"s3://no-such-bucket/{BUCKET}", f"s3://{BUCKET}/no-such-folder"):
        dm = TokenShardDataModule(url, seq_len=16, batch_size=4, storage_options=options(endpoint))
        with pytest.raises(FileNotFoundError, match=f"token shard directory '{url}' does not exist"):
            dm.setup("fit")


def test_storage_options_for_a_local_path_or_a_filesystem_not_installed_are_one_line(tmp_path: Path) -> None:
    dm = TokenShardDataModule(str(tmp_path), seq_len=16, batch_size=4, storage_options={"anon": True})
    with pytest.raises(ValueError, match="storage_options are for URLs .* is a local path"):
        dm.setup("fit")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        dm = TokenShardDataModule("gs://bucket/corpus", seq_len=16, batch_size=4)
        with pytest.raises(ImportError, match="cannot read token shards at 'gs://bucket/corpus': .*gcsfs"):
            dm.setup("fit")


def test_storage_options_are_kept_out_of_the_checkpoint(layouts: dict, endpoint: str) -> None:
    dm = TokenShardDataModule(layouts["npy"][1], seq_len=16, batch_size=4, storage_options=options(endpoint))
    assert "storage_options" not in dm.hparams
    assert "testing" not in repr(dict(dm.hparams))


@pytest.fixture(scope="module")
def proxy(endpoint: str) -> Iterator[S3Proxy]:
    proxy = S3Proxy(endpoint)
    yield proxy
    proxy.close()


def without_client_retries(url: str) -> dict:
    """Options whose clients do not retry on their own, so every retry counted is ours."""
    return {**options(url), "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}


def our_retries_only(remote: object) -> object:
    """s3fs retries some errors itself (a class attribute, not an option): off, so every retry counted is ours."""
    reader = remote._readers[0]
    reader.fs.retries = 1
    reader.backoff = 0.01
    return remote


def test_a_slowdown_a_reset_and_a_truncated_body_are_retried(layouts: dict, proxy: S3Proxy) -> None:
    from datamodules.text.token_shards import TokenShards

    local, url = layouts["npy"]
    remote = our_retries_only(TokenShards(url, storage_options=without_client_retries(proxy.url)))
    starts = np.array([0, 2_000, 4_000], dtype=np.int64)  # three shards: three ranged GETs
    proxy.faults, before = ["503", "reset", "truncated"], proxy.ranged_gets
    got = remote.read_windows(starts, 100)
    assert np.array_equal(got, TokenShards(local).read_windows(starts, 100))
    # Each spoiled GET was sent once more: the 503 and the short body by our retry; the reset by
    # ours, or by the HTTP client, which re-sends a request whose kept-alive connection was closed.
    assert proxy.faults == [] and proxy.ranged_gets - before == 6
    assert remote._readers[0].retries in (2, 3)


def test_a_range_that_keeps_failing_is_one_error_naming_the_object(layouts: dict, proxy: S3Proxy) -> None:
    from datamodules.text.token_shards import TokenShards

    remote = our_retries_only(TokenShards(layouts["npy"][1], storage_options=without_client_retries(proxy.url)))
    proxy.faults = ["503"] * 5
    with pytest.raises(OSError, match=r"reading bytes \d+-\d+ of s3://corpora/npy/part_0.npy failed 5 times"):
        remote.read_windows(np.array([10], dtype=np.int64), 100)
    assert proxy.faults == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mixture_of_a_local_and_a_remote_source_reads_both(layouts: dict, endpoint: str, num_workers: int) -> None:
    from datamodules import MixtureComponent, MixtureDataModule, TokenShardSource

    def mixture(remote: bool) -> MixtureDataModule:
        prepared = TokenShardSource(layouts["prepared"][1], storage_options=options(endpoint))
        sources = [
            MixtureComponent("npy", 0.5, TokenShardSource(str(layouts["npy"][0]))),
            MixtureComponent("prepared", 0.5, prepared if remote else TokenShardSource(str(layouts["prepared"][0]))),
        ]
        return MixtureDataModule(sources, seq_len=16, batch_size=4, num_workers=num_workers, seed=2)

    for want, got in zip(batches(mixture(False), 30), batches(mixture(True), 30), strict=True):
        assert all(torch.equal(want[key], got[key]) for key in want)


def test_a_resumed_run_fetches_only_the_windows_it_trains_next(layouts: dict, proxy: S3Proxy) -> None:
    """Resumed at step 40 with ``prefetch_steps=4``: after 5 batches, the windows of steps 40-47
    (two groups) have been fetched, those of steps 48-51 may be on their way, and nothing else."""
    from datamodules.text.token_shards import TokenShards

    local, url = layouts["npy"]
    seq_len, batch, group = 16, 4, 4
    dm = TokenShardDataModule(
        url, seq_len=seq_len, batch_size=batch, seed=5, storage_options=options(proxy.url), prefetch_steps=group
    )
    dm.setup("fit")
    resume_at = 40 * batch  # a checkpoint at step 40
    dm.load_state_dict({**dm.state_dict(), "positions_consumed": resume_at})
    proxy.reset_counts()
    batches = iter(dm.train_dataloader())
    for _ in range(5):
        next(batches)
    # The tokens fetched, from the logged ranges.
    shards = TokenShards(local)
    fetched = np.zeros(shards.num_tokens, dtype=bool)
    for path, header in list(proxy.requests):
        i = next(i for i, shard in enumerate(shards._shards) if path.endswith("/" + shard.path.name))
        first, last = (int(x) for x in header.removeprefix("bytes=").split("-"))
        shard = shards._shards[i]
        lo = int(shards._starts[i]) + (first - shard.offset) // 2
        fetched[lo : lo + (last + 1 - first) // 2] = True

    def tokens_of_steps(steps: int) -> np.ndarray:
        _, windows = dm.plan.locate(np.arange(resume_at, resume_at + steps * batch))
        planned = np.zeros_like(fetched)
        for window in windows.tolist():
            planned[window * seq_len : window * seq_len + seq_len + 1] = True
        return planned

    assert not (fetched & ~tokens_of_steps(3 * group)).any()
    assert (fetched | ~tokens_of_steps(2 * group)).all()


def test_io_threads_bounds_the_requests_in_flight(tmp_path: Path, layouts: dict, endpoint: str) -> None:
    slow = S3Proxy(endpoint, delay=0.05)  # a far-away bucket: requests overlap
    try:
        for io_threads in (2, 16):
            dm = TokenShardDataModule(
                layouts["npy"][1], seq_len=16, batch_size=8, storage_options=options(slow.url), io_threads=io_threads
            )
            dm.setup("fit")
            slow.reset_counts()
            next(iter(dm.train_dataloader()))
            # Reached and never passed: 16 is above the 10 connections s3fs's client keeps by default.
            assert slow.most_in_flight == io_threads
    finally:
        slow.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_object_changed_under_the_run_is_refused_at_its_next_read(
    tmp_path: Path, layouts: dict, endpoint: str, num_workers: int
) -> None:  # layouts: the bucket exists
    from datamodules.storage.range_reader import ChangedDuringRun

    local = tmp_path / "changing"
    local.mkdir()
    tokens = np.arange(3_000, dtype=np.uint16)
    np.save(local / "a.npy", tokens)
    fs = s3fs.S3FileSystem(**options(endpoint))
    url = f"s3://{BUCKET}/changing-{num_workers}"
    fs.put(str(local), url.removeprefix("s3://"), recursive=True)
    dm = TokenShardDataModule(url, seq_len=16, batch_size=4, storage_options=options(endpoint), num_workers=num_workers)
    dm.setup("fit")
    # Rewritten in place after setup: the same size, other tokens (a new ETag).
    np.save(local / "a.npy", tokens[::-1].copy())
    fs.put(str(local / "a.npy"), f"{url.removeprefix('s3://')}/a.npy")
    # Each ranged GET carries the ETag recorded at setup (If-Match), not only a HEAD every 10 minutes.
    with pytest.raises(ChangedDuringRun, match=r"a\.npy changed during the run: 6128 bytes, ETag .* now 6128 bytes"):
        next(iter(dm.train_dataloader()))


def test_the_sizes_and_etags_of_a_large_folder_come_from_listing_it_and_agree_with_each_head(
    tmp_path: Path, layouts: dict, endpoint: str, proxy: S3Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datamodules.storage.range_reader import RangeReader
    from datamodules.text.token_shards import TokenShards

    monkeypatch.setattr(RangeReader, "verify_every", 0.0)  # every read checks its shards
    local = tmp_path / "many"
    local.mkdir()
    for i in range(24):
        np.save(local / f"part_{i:02d}.npy", np.arange(500, dtype=np.uint16) + i)
    s3fs.S3FileSystem(**options(endpoint)).put(str(local), f"{BUCKET}/many", recursive=True)
    proxy.reset_counts()
    remote = TokenShards(f"s3://{BUCKET}/many", storage_options=options(proxy.url))
    assert proxy.methods["HEAD"] < 24  # the expected versions: one listing, not a HEAD per shard
    proxy.reset_counts()
    starts = np.array([0, 5_000, 11_000], dtype=np.int64)  # three shards: checked by HEAD before reading
    assert np.array_equal(remote.read_windows(starts, 50), TokenShards(local).read_windows(starts, 50))
    assert proxy.methods["HEAD"] == 3  # and what each HEAD says matches what the listing said


@pytest.mark.parametrize("argument", ["prefetch_steps", "io_threads"])
def test_prefetch_steps_and_io_threads_must_be_positive_integers(argument: str) -> None:
    with pytest.raises(ValueError, match=f"{argument} must be a positive integer, got 0"):
        TokenShardDataModule("s3://bucket/corpus", seq_len=16, batch_size=4, **{argument: 0})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_run_on_s3_stopped_and_resumed_through_trainer_fit_trains_the_uninterrupted_batches(
    tmp_path: Path, layouts: dict, endpoint: str, num_workers: int
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.support import RecordingModel, quiet_trainer

    def fit(max_steps: int, checkpoint_every: int = 0, resume: Path | None = None) -> list[dict]:
        dm = TokenShardDataModule(
            layouts["prepared"][1], seq_len=16, batch_size=4, pack_sequences=True, num_workers=num_workers,
            storage_options=options(endpoint),
        )  # fmt: skip
        callbacks = [ModelCheckpoint(tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1)]
        model = RecordingModel()
        quiet_trainer(max_steps=max_steps, callbacks=callbacks if checkpoint_every else []).fit(
            model, datamodule=dm, ckpt_path=resume
        )
        return model.records

    whole = fit(90)  # 78 steps an epoch: the resumed run crosses into the second
    first = [r for r in fit(40, checkpoint_every=38) if r["step"] < 38]  # killed two steps after the checkpoint
    (checkpoint,) = tmp_path.glob("*-step=38.ckpt")
    resumed = first + fit(90, resume=checkpoint)
    assert [r["digest"] for r in resumed] == [r["digest"] for r in whole]


def test_a_2_rank_ddp_checkpoint_on_s3_resumes_on_1_rank_consuming_every_position_once(
    tmp_path: Path,
    layouts: dict,
    endpoint: str,  # layouts: the bucket exists
) -> None:
    from tests.distributed_support import assert_positions_consumed_once
    from tests.plan.test_distributed import BATCH, SEQ_LEN, WINDOWS, consumed, train

    local = make_token_shards(tmp_path / "elastic", WINDOWS * SEQ_LEN + 1, shard_tokens=97)
    s3fs.S3FileSystem(**options(endpoint)).put(str(local), f"{BUCKET}/elastic", recursive=True)
    url, storage = f"s3://{BUCKET}/elastic", options(endpoint)
    # Two DDP processes read the server; a checkpoint at step 3, "killed" two steps later.
    stopped = train(
        url, tmp_path / "ddp", devices=2, strategy="ddp", max_steps=5, every_n_steps=3, storage_options=storage
    )
    resumed = train(
        url, tmp_path / "one", devices=1, max_epochs=1, resume=stopped.checkpoint(3), storage_options=storage
    )
    before = consumed(stopped, dp_size=2, before_step=3)
    after = consumed(resumed, dp_size=1, first_step=3, first_position=3 * 2 * BATCH)
    plan = TokenShardDataModule(str(local), seq_len=SEQ_LEN, batch_size=BATCH)
    plan.setup("fit")
    plan.train_dataloader()
    assert_positions_consumed_once([before, after], WINDOWS, lambda n: plan.plan.locate(np.arange(n))[1].tolist())


def test_setup_reads_headers_and_fingerprints_by_small_ranges(
    tmp_path: Path, layouts: dict, endpoint: str, proxy: S3Proxy
) -> None:
    """Headers (.npy) and the fingerprint's first and last 4 KB are ranged requests of their own size,
    not a file opened with read-ahead (s3fs would fetch up to a 50 MB block for each)."""
    from datamodules.text.token_shards import TokenShards

    local = tmp_path / "large"
    local.mkdir()
    for i in range(2):
        np.save(local / f"part_{i}.npy", np.arange(200_000, dtype=np.uint16))  # 400 KB each
    s3fs.S3FileSystem(**options(endpoint)).put(str(local), f"{BUCKET}/large", recursive=True)
    proxy.requests.clear()
    shards = TokenShards(f"s3://{BUCKET}/large", storage_options=options(proxy.url))
    lengths = []
    for _, header in proxy.requests:
        first, last = (int(x) for x in header.removeprefix("bytes=").split("-"))
        lengths.append(last + 1 - first)
    assert lengths and max(lengths) <= 16_384, lengths
    assert shards.fingerprint == TokenShards(local).fingerprint


def test_missing_credentials_are_one_line_at_setup_naming_the_url(
    layouts: dict, endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_keys = {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    dm = TokenShardDataModule(layouts["npy"][1], seq_len=16, batch_size=4, storage_options=no_keys)
    with pytest.raises(
        OSError, match=r"cannot read token shards at 's3://corpora/npy': NoCredentialsError: .*check the key"
    ):
        dm.setup("fit")


def test_a_failed_read_surfaces_at_once_not_after_the_next_round() -> None:
    from datamodules.plan.loader import read_ahead

    def read(item: int) -> int:
        if item == 0:
            raise OSError("bytes 0-100 of s3://b/x failed 5 times")
        time.sleep(3)  # the next round's reads, still failing
        return item

    started = time.monotonic()
    with pytest.raises(OSError, match="failed 5 times"):
        list(read_ahead(read, iter(range(3))))
    assert time.monotonic() - started < 1.5


def test_a_shard_header_answering_503_forever_fails_setup_within_the_budget_naming_the_object(
    layouts: dict, proxy: S3Proxy
) -> None:
    from datamodules.text.token_shards import TokenShards

    proxy.faults, before = ["503"] * 100, proxy.ranged_gets
    started = time.monotonic()
    with pytest.raises(OSError, match=r"reading bytes 0-\d+ of s3://corpora/npy/part_\d+\.npy failed 5 times") as err:
        TokenShards(layouts["npy"][1], storage_options=options(proxy.url))
    headers = len({path for path, _ in proxy.requests[before:]})
    assert proxy.ranged_gets - before <= 5 * headers and time.monotonic() - started < 15
    assert str(err.value).count("s3://corpora/npy'") <= 1  # the folder named once, then the object
    proxy.faults = []
