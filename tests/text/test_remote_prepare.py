"""``prepare --output s3://...``: each part written locally, then uploaded with its metadata last, to
an S3 server on 127.0.0.1 (moto); training from the bucket reads what training from disk reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.object_store.server import S3Proxy, proxied_bucket, storage_options
from datamodules import TokenShardDataModule
from datamodules.text.prepare import main, prepare
from tests.text.test_prepare import DOCS, jsonl
from tests.text.test_prepare import tokenizer as tokenizer  # noqa: F401 (a fixture)

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "prepared"


@pytest.fixture(scope="module")
def proxy(endpoint: str) -> Iterator[S3Proxy]:
    with proxied_bucket(endpoint, BUCKET) as proxy:
        yield proxy


def inputs(root: Path) -> list[str]:
    for i in range(3):
        (root / f"in{i}.jsonl").write_bytes(jsonl(DOCS[i * 13 : (i + 1) * 13]))
    return sorted(str(p) for p in root.glob("in*.jsonl"))


def batches(data_dir: str, **kwargs: object) -> list[dict[str, torch.Tensor]]:
    dm = TokenShardDataModule(data_dir, seq_len=16, batch_size=2, pack_sequences=True, **kwargs)
    dm.setup("fit")
    return list(dm.train_dataloader())


def test_parts_prepared_into_a_bucket_train_like_parts_on_disk_and_each_metadata_lands_last(
    tmp_path: Path, tokenizer: str, proxy: S3Proxy
) -> None:
    files = inputs(tmp_path)
    url, options = f"s3://{BUCKET}/corpus", storage_options(proxy.url)
    proxy.reset_counts()
    for part in range(3):  # one job of a job array each; the last through the command line
        if part < 2:
            prepare(files, url, tokenizer, num_proc=1, num_parts=3, part_index=part, storage_options=options)
        else:
            main([*files, "--output", url, "--tokenizer", tokenizer, "--num-proc", "1", "--num-parts", "3"]
                 + ["--part-index", "2", "--storage-options", json.dumps(options)])  # fmt: skip
        prepare(files, tmp_path / "local", tokenizer, num_proc=1, num_parts=3, part_index=part)
    for part in range(3):
        uploads = [path for path in proxy.puts if f"/part-{part:05d}/" in path]
        assert uploads and uploads[-1].endswith(f"/corpus/part-{part:05d}/metadata.json"), uploads
    remote, local = batches(url, storage_options=options), batches(str(tmp_path / "local"))
    assert len(remote) == len(local) > 0
    for want, got in zip(local, remote, strict=True):
        assert all(torch.equal(want[key], got[key]) for key in want)
    # Run again, the part is up to date: nothing is uploaded.
    proxy.reset_counts()
    prepare(files, url, tokenizer, num_proc=1, num_parts=3, part_index=1, storage_options=options)
    assert proxy.puts == []


def test_a_bucket_output_of_other_inputs_is_refused_unless_overwritten(
    tmp_path: Path, tokenizer: str, proxy: S3Proxy
) -> None:
    from datamodules.text.prepare_inputs import PrepareError

    files = inputs(tmp_path)
    url, options = f"s3://{BUCKET}/single", storage_options(proxy.url)
    prepare(files[:1], url, tokenizer, num_proc=1, storage_options=options)
    with pytest.raises(PrepareError, match="already holds shards of other inputs or options"):
        prepare(files, url, tokenizer, num_proc=1, storage_options=options)
    prepare(files, url, tokenizer, num_proc=1, storage_options=options, overwrite=True)
    prepare(files, tmp_path / "local", tokenizer, num_proc=1)
    remote, local = batches(url, storage_options=options), batches(str(tmp_path / "local"))
    assert [b["input_ids"].tolist() for b in remote] == [b["input_ids"].tolist() for b in local]


def test_inputs_in_a_bucket_prepare_the_tokens_of_the_same_files_on_disk(
    tmp_path: Path, tokenizer: str, proxy: S3Proxy
) -> None:
    import gzip

    import s3fs

    from datamodules import TokenShards
    from tests.support import all_tokens

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"in{i}.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS[i * 13 : (i + 1) * 13])))
    options = storage_options(proxy.url)
    s3fs.S3FileSystem(**options).put(str(docs), f"{BUCKET}/inputs", recursive=True)
    main([f"s3://{BUCKET}/inputs", "--output", str(tmp_path / "from-bucket"), "--tokenizer", tokenizer,
          "--num-proc", "1", "--storage-options", json.dumps(options)])  # fmt: skip
    prepare([str(docs)], tmp_path / "from-disk", tokenizer, num_proc=1)
    remote, local = TokenShards(tmp_path / "from-bucket"), TokenShards(tmp_path / "from-disk")
    assert remote.num_tokens == local.num_tokens > 0
    assert (all_tokens(remote) == all_tokens(local)).all()
