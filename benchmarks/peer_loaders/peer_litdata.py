"""litdata, set up the way its README sets up LLM pretraining on token data.

``convert`` writes each corpus with ``litdata.optimize(..., item_loader=TokensLoader())``: tokens stay
uint16 (litdata's ``no_header_tensor`` format has ``torch.uint16``), ``(seq_len + 1) * 8012`` tokens to
a chunk (the README's ``chunk_size=(2049 * 8012)``, ~33 MB of uint16). ``Contender`` reads them with
``StreamingDataset(item_loader=TokensLoader(block_size=seq_len + 1), shuffle=True, drop_last=True)``
and ``StreamingDataLoader``; the 70/30 mixture is ``CombinedStreamingDataset(weights=...,
iterate_over_all=False)`` over the two sources, as in the README's TinyLlama recipe. Resume state is
the loader's own ``state_dict()``. On a local path litdata maps the chunks in place ("POSIX-fast"): no
cache copy, so what is measured is the reading, not a download. Its shuffle there is ``FullShuffle``: the
chunk order is permuted each epoch, and a chunk's samples in blocks of 256 (its default item window).
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset, TokensLoader, optimize
from litdata.streaming.dataset import _replay_chunks_sampling, _replay_sampling

from benchmarks.peer_loaders.protocol import LoaderContender, Setup

BLOCKS_PER_CHUNK = 8012  # samples of seq_len + 1 tokens per chunk: the README's TokensLoader recipe


def _shard_pieces(path: str, piece: int) -> Iterator[torch.Tensor]:
    """One ``.npy`` shard, as uint16 tensors of one chunk's worth of tokens each.

    A chunk holds whole items, so a piece of exactly ``chunk_size`` tokens fills one chunk and no chunk
    mixes two shards (or two sources); a shard's tail makes a short chunk of its own.
    """
    tokens = np.load(path, mmap_mode="r")
    for lo in range(0, len(tokens), piece):
        yield torch.from_numpy(np.array(tokens[lo : lo + piece]))


def convert(corpus: Path, out: Path, seq_len: int) -> None:
    chunk_size = (seq_len + 1) * BLOCKS_PER_CHUNK
    for name in ("all", "source0", "source1"):
        shards = sorted(str(p) for p in (corpus / name).glob("*.npy"))
        optimize(
            fn=functools.partial(_shard_pieces, piece=chunk_size),
            inputs=shards,
            output_dir=str(out / name),
            chunk_size=chunk_size,
            item_loader=TokensLoader(),
            num_workers=min(2, len(shards)),
            reorder_files=False,
            keep_data_ordered=True,  # a static split of the shards: the same chunks on every conversion
            mode="overwrite",
            verbose=False,
        )


def _dataset(data: Path, setup: Setup) -> StreamingDataset:
    return StreamingDataset(
        input_dir=str(data),
        item_loader=TokensLoader(block_size=setup.seq_len + 1),
        shuffle=True,
        seed=setup.seed,
        drop_last=True,
    )


class Contender(LoaderContender):
    def __init__(self, setup: Setup, state: Any | None) -> None:
        data = Path(setup.data)
        self.sources: list[StreamingDataset] = []
        if setup.mixture:
            self.sources = [_dataset(data / "source0", setup), _dataset(data / "source1", setup)]
            # "stratified" draws each sample's source by weight; "per_stream" fills a whole batch from one
            # source, so stratified is the closer of litdata's two to the weights within a batch.
            dataset: Any = CombinedStreamingDataset(
                self.sources,
                weights=setup.weights,
                seed=setup.seed,
                iterate_over_all=False,
                batching_method="stratified",
            )
        else:
            dataset = _dataset(data / "all", setup)
        self.loader = StreamingDataLoader(dataset, batch_size=setup.batch_size, num_workers=setup.workers)
        if state is not None:
            self.loader.load_state_dict(state)


def _worker_items(dataset: StreamingDataset, workers: int, batch_size: int, epoch: int) -> list[list[Any]]:
    """Each loader worker's chunk intervals in ``epoch``, as litdata's shuffler assigns them."""
    dataset.get_len(workers, batch_size)  # builds the shuffler
    assert dataset.shuffler is not None
    _, intervals = dataset.shuffler.get_chunks_and_intervals_per_workers(
        dataset.distributed_env, max(1, workers), batch_size, epoch
    )
    return intervals


def _skipped_chunks(intervals: list[list[Any]], yielded: int, batch_size: int) -> list[int]:
    """Chunks each worker skips on resume, by litdata's own replay arithmetic (``StreamingDataset._resume``)."""
    indexes = _replay_sampling(yielded, batch_size, len(intervals))
    chunks, _ = _replay_chunks_sampling(dict(enumerate(intervals)), indexes)
    return [chunks[w] for w in range(len(intervals))]


def _single_state_at(setup: Setup, step: int, state: dict[str, Any], loader: StreamingDataLoader) -> str:
    workers, bs = max(1, setup.workers), setup.batch_size
    per_epoch = len(loader)  # every batch is full: drop_last gives each worker whole batches
    epochs_done, k = divmod(step, per_epoch)
    if k == 0 and step > 0:  # just after an epoch's last batch, before the next pass starts
        epochs_done, k = epochs_done - 1, per_epoch
    epoch, yielded = epochs_done + 1, k * bs
    # StreamingDataLoader.state_dict: the loader's counters, then StreamingDataset.state_dict's
    state.update(current_epoch=epoch, num_samples_yielded=yielded, latest_worker_idx=(k - 1) % workers)
    ds = state["dataset"]
    ds.update(current_epoch=epoch, num_samples_yielded=yielded, sample_in_epoch=yielded * ds["world_size"])
    if yielded >= len(loader.dataset):
        return "nothing: the checkpoint closes an epoch, so litdata starts the next one afresh"
    intervals = _worker_items(loader.dataset, setup.workers, bs, epoch)
    skipped = _skipped_chunks(intervals, yielded, bs)
    return (
        f"nothing: each worker skips {skipped} of {[len(i) for i in intervals]} chunks by index and re-permutes "
        "one chunk's item ids (StreamingDataset._resume, _replay_sampling, _replay_chunks_sampling)"
    )


def _mixture_state_at(setup: Setup, step: int, state: dict[str, Any], sources: list[StreamingDataset]) -> str:
    """The counters a fresh run has after ``step`` batches, replaying litdata's mixture bookkeeping:

    each worker's ``_CombinedDatasetIterator`` draws every sample's source with ``random.Random(seed)``
    (the same seed in every worker and every epoch) and stops at the first draw of a source it has used
    up; torch then yields the workers' batches round robin, a worker's last batch possibly short, and
    ``StreamingDataLoader`` files each batch's per-source counts under the next worker id of a plain cycle.
    """
    workers, bs = max(1, setup.workers), setup.batch_size
    weights = [w / sum(setup.weights) for w in setup.weights]
    # A worker's item budget per source is the same every epoch (it depends on the totals alone).
    budgets = [
        [sum(iv[2] - iv[1] for iv in intervals) for intervals in _worker_items(ds, setup.workers, bs, 1)]
        for ds in sources
    ]
    draws = np.array(random.Random(setup.seed).choices([0, 1], weights=weights, k=sum(map(sum, budgets)) + 1))
    counts = np.stack([np.cumsum(draws == s) for s in (0, 1)])  # counts[s, i]: source s in draws[: i + 1]
    per_worker = []  # per worker: (samples before its stop, the source whose draw stopped it)
    for w in range(workers):
        over = [np.flatnonzero(counts[s] > budgets[s][w]) for s in (0, 1)]
        stop = min(int(o[0]) for o in over if len(o))
        per_worker.append((stop, int(draws[stop])))
    order = []  # (worker, batch end) of each batch of an epoch, in the order the loader yields them
    for r in range(max(-(-n // bs) for n, _ in per_worker)):
        order += [(w, min((r + 1) * bs, n)) for w, (n, _) in enumerate(per_worker) if r * bs < n]
    epochs_done, k = divmod(step, len(order))
    if k == 0 and step > 0:
        epochs_done, k = epochs_done - 1, len(order)
    epoch = epochs_done + 1
    filed: dict[int, list[int]] = {}
    for t, (_maker, end) in enumerate(order[:k]):  # filed under the cycle's id, not the maker's
        filed[t % workers] = [int(counts[0, end - 1]), int(counts[1, end - 1])]
    state.update(current_epoch=epoch, latest_worker_idx=(k - 1) % workers, num_samples_yielded=filed)
    if setup.workers == 0:  # the in-process iterator's own counts, which the filed ones equal
        totals = filed[0]
    else:
        totals = [sum(c[s] for c in filed.values()) for s in (0, 1)]
    for s in (0, 1):
        ds = state["dataset"][str(s)]
        ds.update(current_epoch=epoch, num_samples_yielded=totals[s], sample_in_epoch=totals[s] * ds["world_size"])
    n, stopper = per_worker[0]
    if setup.workers == 0 and k == len(order) and n % bs:
        # In process, the source that ran out did so inside the last (short) batch and moved to the next epoch.
        state["dataset"][str(stopper)]["current_epoch"] = epoch + 1
    replayed = [sum(c) for _, c in sorted(filed.items())]
    replays = (
        f"the mixture's {replayed} source draws per worker (random.Random.choices in _CombinedDatasetIterator, "
        "no data read); then each source skips its used chunks by index, as a single StreamingDataset does"
    )
    if setup.workers > 0:
        replays += " (from its count summed over the workers, re-split as if in whole batches)"
    return replays


def state_at(setup: Setup, step: int) -> tuple[Any, str]:
    """A real ``state_dict()`` after one batch, its counters set to those after ``step`` batches."""
    contender = Contender(setup, None)
    if step == 0:
        return contender.state_dict(), "nothing: the fresh loader's state"
    next(contender.batches())
    state = copy.deepcopy(contender.state_dict())
    contender.close()
    if setup.mixture:
        replays = _mixture_state_at(setup, step, state, contender.sources)
    else:
        replays = _single_state_at(setup, step, state, contender.loader)
    return state, replays
