"""A million WebDataset samples: their node table costs 16 bytes a sample on disk besides the keys; a
process that sets up rows over the cached index holds next to nothing per sample and maps only the
pages of the rows it reads; its DataLoader workers add nothing per sample; the rows are webdataset's."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.common import tiny_caption, tiny_shards
from datamodules.storage.tar_index import index_shards
from datamodules.vision.webdataset_rows import WebDatasetRows, indexed_shards

SAMPLES, SHARDS = 1_000_000, 100
FIELDS = {"txt": "txt"}
READS = 20  # rows read in the probe: each maps at most a fault-around (16 pages) of each of 3 table files


@pytest.fixture(scope="module")
def million(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """The shards of a million tiny samples, and the index cache, built once."""
    folder = tmp_path_factory.mktemp("million")
    shards = [str(path) for path in tiny_shards(folder / "shards", SHARDS, SAMPLES // SHARDS)]
    index_shards(shards, str(folder / "idx"))
    return shards, folder / "idx"


def test_the_node_table_holds_16_bytes_a_sample_besides_the_keys(million: tuple[list[str], Path]) -> None:
    _, cache = million
    (table,) = cache.glob("samples-*")
    sizes = {path.name: path.stat().st_size for path in table.iterdir()}
    keys = sizes.pop("keys.npy") + sizes.pop("key_offsets.npy")
    assert sum(sizes.values()) / SAMPLES < 16.1  # a sample's start and digest, and a few lines a shard
    assert keys / SAMPLES < 7 + 8 + 0.1  # a key's 7 bytes and its offset


def test_rows_cost_a_process_and_its_workers_almost_nothing_a_sample(million: tuple[list[str], Path]) -> None:
    shards, cache = million
    arguments = json.dumps([shards, str(cache)])
    script = (
        f"import json, sys; from tests.vision.test_webdataset_scale import probe; probe(*json.loads({arguments!r}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["setup_seconds"] < 1.0, found  # a mapped open and a few numbers a shard
    assert found["setup_private"] / SAMPLES < 4, found
    assert found["read_private"] / SAMPLES < 4, found
    assert 0 < found["table_resident"] <= READS * 3 * 16 * 4096, found  # the pages of the rows read, not the table
    assert found["pickled"] < 64 << 10, found  # what a spawned worker receives
    # A worker's first reads allocate a few MB (buffers, caches); a copy of the table would be 31 MB.
    assert len(found["workers_private"]) == 2 and all(grown < 8 << 20 for grown in found["workers_private"]), found


def probe(shards: list[str], cache: str) -> None:
    """In a fresh process: sets up rows over the cached index, reads some, in this process and in two
    DataLoader workers, and prints what each step cost as a JSON line."""
    picks = np.random.default_rng(0).choice(SAMPLES, READS, replace=False).tolist()
    before = private_bytes()
    started = time.perf_counter()
    rows = WebDatasetRows(indexed_shards(shards, cache, None, False), FIELDS, ())
    found = {"setup_seconds": time.perf_counter() - started, "setup_private": private_bytes() - before}
    before = private_bytes()
    assert [rows[row]["txt"] for row in picks] == [tiny_caption(row) for row in picks]
    found.update(read_private=private_bytes() - before, table_resident=resident_bytes(rows.shards.folder))
    found["pickled"] = len(pickle.dumps(rows))
    loader = torch.utils.data.DataLoader(PrivateGrowth(rows), None, num_workers=2, worker_init_fn=PrivateGrowth.start)
    found["workers_private"] = list(dict(list(loader)).values())
    print(json.dumps(found))


class PrivateGrowth(torch.utils.data.Dataset):
    """In a worker: each item reads a row, and gives the worker's pid and how much private memory it
    has gained since it started."""

    def __init__(self, rows: WebDatasetRows) -> None:
        self.rows, self.started = rows, 0

    @staticmethod
    def start(_: int) -> None:
        torch.utils.data.get_worker_info().dataset.started = private_bytes()

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.rows[i * 2477 % len(self.rows)]
        return os.getpid(), private_bytes() - self.started


def private_bytes() -> int:
    """The process's private memory: its anonymous and written pages (not the clean pages of a map)."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["Private_Dirty"].split()[0]) * 1024


def resident_bytes(folder: Path) -> int:
    """The pages of the files in ``folder`` that this process has mapped in."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef":  # a mapping's first line: its addresses, then its file
                inside = str(folder) in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_rows_are_webdatasets_own_across_the_shards(million: tuple[list[str], Path]) -> None:
    wds = pytest.importorskip("webdataset")
    shards, cache = million
    rows = WebDatasetRows(indexed_shards(shards, str(cache), None, False), FIELDS, ())
    assert len(rows) == SAMPLES
    per_shard = SAMPLES // SHARDS
    picks = np.random.default_rng(1).choice(per_shard, 100, replace=False)
    for shard in (0, SHARDS // 2, SHARDS - 1):
        theirs = list(wds.WebDataset(shards[shard], shardshuffle=False))
        for i in picks.tolist():
            row = shard * per_shard + i
            assert rows.describe(row) == f"{shards[shard]}:{theirs[i]['__key__']}"
            assert rows[row] == {"txt": theirs[i]["txt"].decode()}
