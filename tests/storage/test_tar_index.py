"""Tar shards' member indexes: built from the headers, kept per node, rebuilt for a changed shard; a
truncated shard keeps its complete members, a compressed one is refused with how to fix it."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from datamodules.storage.tar_index import index_shards
from tests.storage.tar_data import tar_of
from tests.vision.image_data import caption


def test_a_truncated_shard_keeps_its_complete_samples_and_logs_the_lost_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    members = [(f"s{i}.txt", caption(i).encode() * 40) for i in range(8)]
    whole = tar_of(tmp_path / "whole.tar", members).read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: len(whole) // 2])
    shards = index_shards([str(cut)], str(tmp_path / "idx"))
    complete = shards.indexes[0]
    with tarfile.open(tmp_path / "whole.tar") as tar:
        ends = [m.offset_data + m.size for m in tar.getmembers()]
    assert len(complete.names) == sum(end <= len(whole) // 2 for end in ends) > 0
    assert complete.lost_bytes > 0 and "cut.tar is truncated or corrupt" in caplog.text
    assert f"its last {complete.lost_bytes} bytes" in caplog.text


def test_a_compressed_shard_is_refused_with_how_to_recompress_or_decompressed_once_when_allowed(tmp_path: Path) -> None:
    import gzip

    plain = tar_of(tmp_path / "s.tar", [("a.txt", b"x"), ("b.txt", b"yz")]).read_bytes()
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress(plain))
    with pytest.raises(
        ValueError, match=r"s\.tar\.gz is a gzip-compressed tar: .*gzip -dc < shard\.tar\.gz > shard\.tar"
    ):
        index_shards([str(tmp_path / "s.tar.gz")], str(tmp_path / "idx"))
    allowed = index_shards([str(tmp_path / "s.tar.gz")], str(tmp_path / "idx"), allow_compressed=True)
    copy = Path(allowed.read_locations[0])
    assert copy.parent == tmp_path / "idx" and copy.read_bytes() == plain
    assert allowed.indexes[0].member_names() == ["a.txt", "b.txt"] and allowed.indexes[0].decompressed
    again = index_shards([str(tmp_path / "s.tar.gz")], str(tmp_path / "idx"), allow_compressed=True)
    assert again.read_locations == allowed.read_locations and again.bytes_read == 0  # the cached index and copy


def test_the_index_is_kept_and_a_changed_shard_is_indexed_again(tmp_path: Path) -> None:
    shard = tar_of(tmp_path / "s.tar", [("a.txt", b"one"), ("b.txt", b"two")])
    first = index_shards([str(shard)], str(tmp_path / "idx"))
    assert first.indexes[0].member_names() == ["a.txt", "b.txt"] and len(list((tmp_path / "idx").iterdir())) == 1
    again = index_shards([str(shard)], str(tmp_path / "idx"))
    assert again.indexes[0].member_names() == ["a.txt", "b.txt"] and len(list((tmp_path / "idx").iterdir())) == 1
    tar_of(shard, [("a.txt", b"one"), ("b.txt", b"two"), ("c.txt", b"three")])
    assert index_shards([str(shard)], str(tmp_path / "idx")).indexes[0].member_names() == ["a.txt", "b.txt", "c.txt"]
