"""Tar shards' sample indexes: built from the headers (plain ones parsed directly, any other by tarfile,
the members alike), kept per node, rebuilt for a changed shard; a truncated or corrupt shard keeps
its complete members, a compressed one is refused with how to fix it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks.common import tiny_shards
from datamodules.storage.sample_table import IndexedShards, TarIndex
from datamodules.storage.tar_index import index_shards
from datamodules.storage.tar_members import TarWalk
from tests.storage.tar_data import tar_of
from tests.vision.image_data import caption

ROOT = Path(__file__).parents[2]


def keys(shards: IndexedShards) -> list[str]:
    return [shards.key(row) for row in range(len(shards))]


def test_a_truncated_shard_keeps_its_complete_samples_and_logs_the_lost_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    members = [(f"s{i}.txt", caption(i).encode() * 40) for i in range(8)]
    whole = tar_of(tmp_path / "whole.tar", members).read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: len(whole) // 2])
    shards = index_shards([str(cut)], str(tmp_path / "idx"))
    with tarfile.open(tmp_path / "whole.tar") as tar:
        ends = [m.offset_data + m.size for m in tar.getmembers()]
    assert len(shards) == sum(end <= len(whole) // 2 for end in ends) > 0
    assert shards.lost_bytes[0] > 0 and "cut.tar is truncated or corrupt" in caplog.text
    assert f"its last {shards.lost_bytes[0]} bytes" in caplog.text


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
    assert keys(allowed) == ["a", "b"]
    again = index_shards([str(tmp_path / "s.tar.gz")], str(tmp_path / "idx"), allow_compressed=True)
    assert again.read_locations == allowed.read_locations and again.bytes_read == 0  # the cached index and copy
    copy.unlink()
    again = index_shards([str(tmp_path / "s.tar.gz")], str(tmp_path / "idx"), allow_compressed=True)
    assert again.read_locations == allowed.read_locations and copy.read_bytes() == plain  # decompressed again


def test_the_index_is_kept_and_a_changed_shard_is_indexed_again(tmp_path: Path) -> None:
    shard = tar_of(tmp_path / "s.tar", [("a.txt", b"one"), ("b.txt", b"two")])
    first = index_shards([str(shard)], str(tmp_path / "idx"))
    kept = sorted((tmp_path / "idx").iterdir())  # the shard's index and the node table
    assert keys(first) == ["a", "b"] and first.bytes_read > 0 and len(kept) == 2
    again = index_shards([str(shard)], str(tmp_path / "idx"))
    assert keys(again) == ["a", "b"] and again.bytes_read == 0 and sorted((tmp_path / "idx").iterdir()) == kept
    tar_of(shard, [("a.txt", b"one"), ("b.txt", b"two"), ("c.txt", b"three")])
    assert keys(index_shards([str(shard)], str(tmp_path / "idx"))) == ["a", "b", "c"]


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_members_walked_are_tarfiles_own_in_each_tar_format(tmp_path: Path, tar_format: int) -> None:
    names = ["a/b/short.txt", f"{'deep/' * 30}long.name.txt", "naïve/ünïcode.json", "__key__", "noext", "c.x" * 50]
    path = tmp_path / "formats.tar"
    with tarfile.open(path, "w", format=tar_format) as tar:
        for i, name in enumerate(names):
            if tar_format == tarfile.USTAR_FORMAT and len(name) > 100 and "/" not in name:
                continue  # ustar holds no such name
            info = tarfile.TarInfo(name)
            info.size = 1000 * i
            tar.addfile(info, io.BytesIO(bytes(info.size)))
            folder, link = tarfile.TarInfo(f"folder{i}"), tarfile.TarInfo(f"link{i}.txt")
            folder.type, link.type, link.linkname = tarfile.DIRTYPE, tarfile.SYMTYPE, "a/b/short.txt"
            tar.addfile(folder)
            tar.addfile(link)
    with tarfile.open(path) as tar:
        theirs = [(m.offset, m.offset_data, m.size, m.name) for m in tar if m.isreg() and m.name != "__key__"]
    with path.open("rb") as f:
        ours = [(m.offset, m.data, m.size, m.name) for m in TarWalk(f, path.stat().st_size, str(path))]
    assert ours == theirs and len(ours) >= 4


def test_a_corrupt_header_ends_the_shard_where_tarfile_ends_it_and_a_file_no_tar_is_named(tmp_path: Path) -> None:
    data = bytearray(tar_of(tmp_path / "s.tar", [(f"s{i}.txt", caption(i).encode()) for i in range(4)]).read_bytes())
    with tarfile.open(tmp_path / "s.tar") as tar:
        third = tar.getmembers()[2].offset
    data[third + 10] ^= 1  # its name, and so its checksum, no longer match
    (tmp_path / "s.tar").write_bytes(data)
    with tarfile.open(tmp_path / "s.tar") as tar:
        assert [m.name for m in tar] == ["s0.txt", "s1.txt"]
    shards = index_shards([str(tmp_path / "s.tar")], str(tmp_path / "idx"))
    assert keys(shards) == ["s0", "s1"] and shards.lost_bytes == [len(data) - third]
    (tmp_path / "no.tar").write_bytes(b"a text file, not a tar" * 100)
    with pytest.raises(ValueError, match=r"no\.tar is not a tar file \(invalid header\)"):
        index_shards([str(tmp_path / "no.tar")], str(tmp_path / "idx"))


def test_processes_indexing_the_same_shards_at_once_share_one_table(tmp_path: Path) -> None:
    shards = [str(tar_of(tmp_path / f"s{i}.tar", [(f"{i}-{j}.txt", b"x" * j) for j in range(50)])) for i in range(4)]
    script = (
        "import json, sys; from datamodules.storage.tar_index import index_shards; "
        "shards = index_shards(json.loads(sys.argv[1]), sys.argv[2]); print(len(shards), shards.fingerprint)"
    )
    command = [sys.executable, "-c", script, json.dumps(shards), str(tmp_path / "idx")]
    racing = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(4)]
    printed = {process.communicate()[0] for process in racing}
    assert all(process.returncode == 0 for process in racing) and len(printed) == 1
    kept = sorted(path.name.split("-")[0] for path in (tmp_path / "idx").iterdir())
    assert kept == ["s0", "s1", "s2", "s3", "samples"]  # an index a shard and one table; no partial file left
    assert keys(index_shards(shards, str(tmp_path / "idx")))[:2] == ["0-0", "0-1"]


def index_files(folder: Path) -> dict[str, dict[str, object]]:
    """Each index file in ``folder`` by name: its arrays' bytes and its numbers."""
    found = {}
    for path in sorted(folder.glob("*.npz")):
        index = TarIndex.load(path)
        found[path.name] = {name: getattr(index, name) for name in ("end", "members", "fingerprint", "lost_bytes")}
        found[path.name].update({name: getattr(index, name).tobytes() for name in ("starts", "digests", "keys")})
    return found


def test_an_offline_build_killed_half_way_indexes_only_the_rest_when_started_again(tmp_path: Path) -> None:
    shards = tiny_shards(tmp_path / "shards", 16, 6_000)  # tens of ms a shard: the kill lands half way
    pattern = str(tmp_path / "shards" / "shard-{00000..00015}.tar")
    command = [sys.executable, "-m", "datamodules.storage.index", pattern, "--cache-dir", str(tmp_path / "idx")]
    build = subprocess.Popen([*command, "--io-threads", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while len(list((tmp_path / "idx").glob("*.npz"))) < 4 and build.poll() is None:
        time.sleep(0.005)
    build.kill()
    build.wait()
    done = len(list((tmp_path / "idx").glob("*.npz")))
    assert 4 <= done < len(shards), "the build was not stopped half way"
    assert not list((tmp_path / "idx").glob(".*")), "a partial index file was left behind"
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    assert f"indexed {len(shards) - done} tar shards ({done} kept from before); the table: assembled" in again.stdout
    # What the two runs left is what one uninterrupted run writes, and the DataModule's setup maps it.
    subprocess.run([*command[:3], pattern, "--cache-dir", str(tmp_path / "whole")], cwd=ROOT, check=True)
    assert index_files(tmp_path / "idx") == index_files(tmp_path / "whole")
    table = index_shards([str(shard) for shard in shards], str(tmp_path / "idx"))
    assert len(table) == 16 * 6_000 and table.bytes_read == 0  # nothing indexed again
    assert keys(table)[6_000] == f"{6_000:07d}"


def test_the_offline_build_splits_into_parts_and_the_last_part_assembles_the_table(tmp_path: Path) -> None:
    tiny_shards(tmp_path / "shards", 5, 10)
    command = [sys.executable, "-m", "datamodules.storage.index", str(tmp_path / "shards"), "--num-parts", "2"]
    command += ["--cache-dir", str(tmp_path / "idx")]
    first = subprocess.run([*command, "--part-index", "1"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "indexed 2 tar shards (0 kept from before); the table: waiting for 3 shards of other parts" in first.stdout
    last = subprocess.run([*command, "--part-index", "0"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "indexed 3 tar shards (0 kept from before); the table: assembled" in last.stdout
    wrong = subprocess.run([*command, "--part-index", "2"], cwd=ROOT, capture_output=True, text=True)
    assert wrong.returncode == 2 and wrong.stderr.strip().endswith("--part-index must be in [0, 2), got 2")
