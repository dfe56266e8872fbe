"""Token shards' layout is read once per job: global rank 0 lists the folder and reads what describes
it, every other rank receives it and sends no request; a node cache keyed by the listing spares a
restart all but the listing, and a shard changed since is read again."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.object_store.server import S3Proxy, proxied_bucket, storage_options
from datamodules import TokenShardDataModule
from tests.support import make_token_shards

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "once-per-job"


@pytest.fixture(scope="module")
def proxy(endpoint: str) -> Iterator[S3Proxy]:
    with proxied_bucket(endpoint, BUCKET) as proxy:
        yield proxy


def upload(local: Path, endpoint: str) -> str:
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(local), f"{BUCKET}/{local.name}", recursive=True)
    return f"s3://{BUCKET}/{local.name}"


def set_up(url: str, proxy: S3Proxy, **kwargs: object) -> TokenShardDataModule:
    """``setup("fit")`` of a one-process DataModule over ``url`` read through ``proxy``, counted from zero."""
    proxy.reset_counts()
    dm = TokenShardDataModule(url, storage_options=storage_options(proxy.url), **kwargs)
    dm.setup("fit")
    return dm


def test_a_4_rank_job_sends_the_requests_of_one_process_and_trains_its_plan(
    tmp_path: Path, endpoint: str, proxy: S3Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.plan.test_distributed import BATCH, SEQ_LEN, WINDOWS, consumed, train

    url = upload(make_token_shards(tmp_path / "corpus", WINDOWS * SEQ_LEN + 1, shard_tokens=17), endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "one-process"))
    one = set_up(url, proxy, seq_len=SEQ_LEN, batch_size=BATCH)
    one_process = Counter(proxy.unconditional)
    assert one_process[("GET", f"/{BUCKET}")] == 1  # one listing; then metadata, document starts, each shard's ends
    assert one_process.total() == 1 + 2 + 31
    one.train_dataloader()  # the plan of a fresh run
    plan = one.plan.locate(np.arange(3 * 4 * BATCH))[1].tolist()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "job"))  # an empty node cache, as the one process had
    proxy.reset_counts()
    run = train(
        url, tmp_path / "ddp", devices=4, strategy="ddp", max_steps=3, storage_options=storage_options(proxy.url)
    )
    # Every request but the reads of training windows (sent with the ETag from rank 0's listing):
    # what one process sends. Ranks 1 to 3 sent nothing.
    assert Counter(proxy.unconditional) == one_process
    assert len(proxy.paths) > len(proxy.unconditional)
    by_position = consumed(run, dp_size=4)
    assert [by_position[p] for p in range(len(plan))] == plan


def test_a_restart_with_the_node_cache_sends_only_the_listing_and_a_shard_uploaded_again_is_read_again(
    tmp_path: Path, endpoint: str, proxy: S3Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    local = tmp_path / "bare"
    local.mkdir()
    for i in range(20):
        np.save(local / f"part_{i:02d}.npy", np.arange(300, dtype=np.uint16) + 1_000 * i)
    url = upload(local, endpoint)
    first = set_up(url, proxy, seq_len=16, batch_size=4)
    assert len(proxy.paths) == 1 + 20  # the listing; a ranged GET per (small) shard: its header and ends

    again = set_up(url, proxy, seq_len=16, batch_size=4)
    assert proxy.paths == [("GET", f"/{BUCKET}")]  # the listing, no shard read
    assert again.sources == first.sources

    # part_05 uploaded again: the same size, other tokens.
    tokens = np.arange(300, dtype=np.uint16) + 5_000
    tokens[100:200] = 7
    np.save(local / "part_05.npy", tokens)
    s3fs.S3FileSystem(**storage_options(endpoint)).put(str(local / "part_05.npy"), f"{BUCKET}/bare/part_05.npy")
    changed = set_up(url, proxy, seq_len=16, batch_size=4)
    assert len(proxy.paths) == 1 + 20  # the listing saw the new ETag: the layout read again
    # Its reads carry the new ETag (a stale one would be answered 412 and stop the run): the new tokens.
    shards = changed._train.shards
    assert shards.read_windows(np.array([5 * 300 + 100]), 4).tolist() == [[7, 7, 7, 7]]


def test_a_local_shard_rewritten_since_the_cached_start_is_refused_as_without_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shards = make_token_shards(tmp_path / "shards", 1_000, shard_tokens=97)
    TokenShardDataModule(shards, seq_len=8, batch_size=4).setup("fit")
    assert len(list((tmp_path / "cache" / "datamodules" / "token_shards").iterdir())) == 1
    tokens = np.load(shards / "shard_00003.npy")
    np.save(shards / "shard_00003.npy", tokens[::-1].copy())  # the same size: its mtime tells the listing
    with pytest.raises(ValueError, match=r"changed since they were prepared: shard_00003.npy"):
        TokenShardDataModule(shards, seq_len=8, batch_size=4).setup("fit")


def test_an_error_reading_the_layout_on_rank_0_stops_every_rank_with_it(tmp_path: Path) -> None:
    from tests.plan.test_distributed import train

    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "tokens.bin").write_bytes(b"\0" * 64)  # no metadata: refused on rank 0, which alone reads it
    run = train(folder, tmp_path / "ddp", devices=2, strategy="ddp", max_steps=1, failing_ranks=2)
    for rank in range(2):
        assert "holds raw .bin shards (tokens.bin, ...)" in run.error(rank)
