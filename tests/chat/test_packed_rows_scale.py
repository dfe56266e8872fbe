"""A million conversations packed into rows: the rows, their lengths and each pass's packing are
computed once on the node and mapped by every process of it. A process that sets up over the node's
arrays, and its DataLoader workers, hold next to nothing per conversation; the packing is the one a
process computes alone."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from benchmarks.common import tiny_conversations
from datamodules.chat.conversation_rows import ConversationRows
from datamodules.plan.multipack import NODE_KIND, PackedRows
from datamodules.storage.node_arrays import is_mapped, node_array_names

CONVERSATIONS = 1_000_000
ROW = 64  # tokens per packed row


@pytest.fixture(scope="module")
def million(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved dataset of a million conversations of 1 to 12 tokens, and the node's arrays made for it
    by a first process (as the first rank of a node would)."""
    folder = tiny_conversations(tmp_path_factory.mktemp("conversations") / "data", CONVERSATIONS)
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder), "first"], **RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


# glibc keeps the freed buffers of a setup's passing work (loading the dataset, hashing the rows) in its
# heap, where they read as private memory; a fixed mmap threshold hands them back, leaving what is held.
RUN = {
    "capture_output": True,
    "text": True,
    "cwd": Path(__file__).parents[2],
    "env": {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
}
PROBE = "import sys; from tests.chat.test_packed_rows_scale import probe; probe(*sys.argv[1:])"


def rows_of(dataset: datasets.Dataset) -> ConversationRows:
    return ConversationRows(dataset, np.arange(CONVERSATIONS), total_seq_len=ROW, seed=3)


def probe(folder: str, role: str) -> None:
    """In a fresh process: sets up the rows (the first process makes the node's arrays, for passes 0
    and 1), reads rows of both passes here and in two DataLoader workers; prints what it cost."""
    dataset = datasets.load_from_disk(folder)
    before = anonymous_bytes()
    rows = rows_of(dataset)
    found = {"setup_private": anonymous_bytes() - before}
    before = anonymous_bytes()
    spans = [rows.packed_rows(np.array([7, 70_000]), np.array([pass_, pass_]))[0] for pass_ in (0, 1)]
    found.update(read_private=anonymous_bytes() - before, spans=spans, pickled=len(pickle.dumps(rows)))
    found["mapped"] = all(is_mapped(a) for a in (rows.rows, rows.packed.lengths, rows.packed.row(1, 0).base))
    if role == "measured":
        loader = torch.utils.data.DataLoader(Growth(rows), None, num_workers=2, worker_init_fn=Growth.start)
        found["workers_private"] = list(dict(list(loader)).values())
    print(json.dumps(found))


def anonymous_bytes() -> int:
    """The process's own memory: its anonymous pages. (Not ``Private_Dirty``: the node's files, freshly
    written, sit dirty in the page cache, and their pages read here would count as this process's.)"""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["Anonymous"].split()[0]) * 1024


class Growth(torch.utils.data.Dataset):
    """In a worker: each item reads a packed row of pass 1 and gives the worker's pid and the private
    memory it has gained since it started."""

    def __init__(self, rows: ConversationRows) -> None:
        self.rows, self.started = rows, 0

    @staticmethod
    def start(_: int) -> None:
        torch.utils.data.get_worker_info().dataset.started = anonymous_bytes()

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.rows.packed_rows(np.array([i * 977 % len(self.rows)]), np.array([1]))
        return os.getpid(), anonymous_bytes() - self.started


def test_a_process_over_the_nodes_arrays_and_its_workers_hold_almost_nothing_a_conversation(million: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, str(million), "measured"], **RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["mapped"], found
    # A process's own rows, lengths, sizes and two passes' packings were 48 bytes a conversation.
    assert found["setup_private"] / CONVERSATIONS < 1, found
    assert found["read_private"] / CONVERSATIONS < 1, found  # each pass's packing is the node's, mapped
    assert found["pickled"] < 64 << 10, found  # what a spawned worker receives: no row, no length
    # A worker's own packing of a pass would be 16 MB.
    assert len(found["workers_private"]) == 2, found
    assert all(grown < 1 << 20 for grown in found["workers_private"]), found


def test_the_nodes_packing_is_the_one_a_process_computes_alone(million: Path) -> None:
    rows = rows_of(datasets.load_from_disk(str(million)))
    lengths = np.asarray(datasets.load_from_disk(str(million)).data.column("seq_len"), dtype=np.int64)
    alone = PackedRows(lengths, ROW, seed=3)  # shared_as=None: held by this process
    assert rows.packed.fingerprint == alone.fingerprint and len(rows) == len(alone)
    for pass_ in (0, 1, 2):
        for row in (0, 12_345, len(alone) - 1):
            assert rows.packed.row(pass_, row).tolist() == alone.row(pass_, row).tolist()
    # Making pass 2 dropped pass 0 from the node: a loader reads at most two passes at once.
    held = sorted(name.rpartition("/")[2] for name in node_array_names(NODE_KIND, rows.shared_as))
    assert held == ["base", "pass-1", "pass-2", "rows"]
