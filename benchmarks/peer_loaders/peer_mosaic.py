"""Mosaic ``streaming`` (mosaicml-streaming 0.13) as a contender of ``benchmarks.peers``.

Measured: the corpus rewritten by ``MDSWriter`` into uncompressed MDS shards (one sample per
non-overlapping ``seq_len + 1``-token window of each ``.npy`` shard, its uint16 bytes in a ``bytes``
column: Mosaic's fixed-shape ``ndarray:uint16:<seq_len + 1>`` column stores the same bytes less a
4-byte size, but its decoder parses the encoding string for every sample, so ``bytes`` plus one
``np.frombuffer`` reads a sample ~25% faster, ~18 against ~24 us here), read back by a
``StreamingDataset`` over the local copy (no remote, so nothing is downloaded) with its defaults for
one node (``py1e`` shuffle seeded ``setup.seed``, ``relaxed`` partition, ``num_canonical_nodes`` = 1)
through a ``StreamingDataLoader``; each sample comes out as int64 token ids (what an embedding
lookup takes), so a batch is one ``[batch, seq_len + 1]`` tensor. The weighted mixture is two
``Stream``s with relative ``proportion``s and ``batching_method="stratified"``, the mode that gives
every batch the same share of each stream: whole samples, so 6 + 2 of 8 for 0.7/0.3, and an epoch
ends when the stream that runs out first cannot fill its share (the other's remaining samples are
dropped; Mosaic logs a warning per epoch). Resumption is Mosaic's documented one:
``StreamingDataLoader.state_dict()`` and ``load_state_dict()``. This is what a user of Mosaic
writes for token windows on local disk, which is why it is the setup compared.

Mosaic coordinates its workers through named shared memory and file locks in the temp folder,
keyed by a small integer prefix. Each contender clears what a crashed run may have left before it
starts, and releases its own on ``close()``, so runs in fresh processes (or several contenders in
one process, one after another) do not see each other's. Two Mosaic runs on one machine at the
same time would: run the measurements one at a time.

Runs in the virtual environment of its own (``benchmarks/.venvs/mosaic``): imports only numpy,
torch, the standard library, ``streaming`` and the protocol.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from streaming import MDSWriter, Stream, StreamingDataLoader, StreamingDataset
from streaming.base.batching import generate_work
from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK
from streaming.base.util import clean_stale_shared_memory
from streaming.base.world import World

from benchmarks.peer_loaders.protocol import LoaderContender, Setup

COLUMN = "tokens"
SIZE_LIMIT = 1 << 26  # Mosaic's default shard size, 64 MiB: 16,344 windows of 2,049 uint16 tokens
DATASETS = ("all", "source0", "source1")
_LOCK_FILE = re.compile(rf"^\d{{6}}_({BARRIER_FILELOCK}|{CACHE_FILELOCK})$")


def convert(corpus: Path, out: Path, seq_len: int) -> None:
    """``out/all``, ``out/source0`` and ``out/source1`` as MDS, one sample per window; windows stay in their shard."""
    window = seq_len + 1
    columns = {COLUMN: "bytes"}
    for name in DATASETS:
        writer = MDSWriter(out=str(out / name), columns=columns, compression=None, size_limit=SIZE_LIMIT, exist_ok=True)
        with writer:
            for path in sorted((corpus / name).glob("*.npy")):
                tokens = np.load(path, mmap_mode="r")
                for row in tokens[: len(tokens) // window * window].reshape(-1, window):
                    writer.write({COLUMN: row.tobytes()})


class _TokenWindows(StreamingDataset):
    """A sample as its window of token ids, int64 (what an embedding lookup takes), so the default collate stacks
    a batch into one ``[batch, seq_len + 1]`` tensor."""

    def get_item(self, sample_id: int, retry: int = 7) -> np.ndarray:
        return np.frombuffer(super().get_item(sample_id, retry)[COLUMN], np.uint16).astype(np.int64)


def _clean_stale() -> None:
    """Release the shared memory and lock files a previous Mosaic run on this machine left behind."""
    clean_stale_shared_memory()
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if _LOCK_FILE.match(name):
            try:
                os.remove(os.path.join(root, name))
            except FileNotFoundError:
                pass


def _dataset(setup: Setup) -> _TokenWindows:
    _clean_stale()
    order = {"shuffle": True, "shuffle_seed": setup.seed, "batch_size": setup.batch_size}
    if setup.mixture:
        streams = [
            Stream(local=str(Path(setup.data) / f"source{i}"), proportion=weight)
            for i, weight in enumerate(setup.weights)
        ]
        return _TokenWindows(streams=streams, batching_method="stratified", **order)
    return _TokenWindows(local=str(Path(setup.data) / "all"), **order)


def _release(dataset: _TokenWindows) -> None:
    """Stop the dataset's download threads (in-process loading), free its shared memory and lock files."""
    if hasattr(dataset, "_iterator"):
        dataset._iterator.exit()  # what Mosaic does when a new epoch starts before the last one ended
    if hasattr(dataset, "_executor"):
        dataset._executor.shutdown()
    clean_stale_shared_memory()
    for lock in (BARRIER_FILELOCK, CACHE_FILELOCK):
        try:
            os.remove(os.path.join(dataset._filelock_root, f"{dataset._shm_prefix_int:06}_{lock}"))
        except FileNotFoundError:
            pass


class Contender(LoaderContender):
    def __init__(self, setup: Setup, state: Any | None) -> None:
        self.dataset = _dataset(setup)
        self.loader = StreamingDataLoader(self.dataset, batch_size=setup.batch_size, num_workers=setup.workers)
        if state is not None:
            self.loader.load_state_dict(state)

    def close(self) -> None:
        super().close()
        _release(self.dataset)


def state_at(setup: Setup, step: int) -> tuple[dict[str, Any], str]:
    dataset = _dataset(setup)
    try:
        # Batches per epoch, from the sample order Mosaic lays out for epoch 0 (the stratified mode ends an epoch
        # when one stream cannot fill its share, so it is not simply the epoch size over the batch size).
        dataset.state_dict(0, True)  # settles num_canonical_nodes and the shuffle block size, as __iter__ does
        work = generate_work(dataset.batching_method, dataset, World.detect(), 0, 0).reshape(-1, setup.batch_size)
        per_epoch = int((work != -1).any(axis=1).sum())
        epoch, batch = divmod(step, per_epoch)
        dataset.next_epoch = epoch + 1  # in epoch `epoch`, as StreamingDataset.__iter__ leaves it
        state = dataset.state_dict(batch * setup.batch_size, True)
        samples = dataset.epoch_size
    finally:
        _release(dataset)
    replays = (
        f"no sample: to start epoch {epoch} (of {per_epoch} batches) at sample {state['sample_in_epoch']}, the first "
        f"worker (the main process without workers) rebuilds that epoch's whole sample order, as at any epoch start: "
        f"stream resampling, partition and py1e shuffle of all {samples} samples, seeded by seed + epoch; it then "
        f"slices off the first {state['sample_in_epoch']} ids without reading them. O(epoch size) numpy work, the "
        f"same at any step"
    )
    return state, replays
