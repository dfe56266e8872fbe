"""Streams: training data read in order, not by plan position, by one reader per (rank, worker).

A stream cannot seek to a global position, so it is cut among ``readers = ranks x workers``; each
reader yields batches together with its state after each one (its cursor and partial buffers). The
main process keeps, per reader, the state after the last batch the training loop has processed
(counted by the loop, so prefetching never runs the state ahead), and a checkpoint gathers every
rank's readers, since only rank 0 writes it. A resume gives each reader its state back and starts
the DataLoader's round robin at the reader whose batch comes next: the batches are those of the
uninterrupted run. On another number of ranks or workers, the stream deals what the old readers
had not finished to the new ones (``Stream.redeal``), their unbatched tokens included.
"""

from __future__ import annotations

import logging
import warnings
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from datamodules.plan.loader import keep_raw
from datamodules.plan.stopping import from_workers, stop_together
from datamodules.plan.worker_start import keep_inherited_memory_shared

log = logging.getLogger(__name__)

# Lightning warns of any IterableDataset with a length, in case its workers read the same data; a
# stream's workers never do, and its length is the epoch its loader stops at.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")

ReaderState = dict[str, Any]


class Stream(ABC):
    """A configured stream: its identity, its readers, and how a raw batch becomes tensors."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What fixes the stream's order (data, options, seed); a resume must match it."""

    @abstractmethod
    def read(self, reader: int, num_readers: int, state: ReaderState | None) -> Iterator[tuple[Any, ReaderState]]:
        """Endless ``(raw batch, state after it)`` of reader ``reader`` of ``num_readers``, from
        ``state`` (``None``: the start)."""

    @abstractmethod
    def idle_readers(self, num_readers: int) -> list[int]:
        """Readers given no data (the stream has fewer shards than readers)."""

    @abstractmethod
    def redeal(self, states: dict[int, ReaderState], old: int, new: int) -> dict[int, ReaderState]:
        """The states of ``new`` readers that read, once, everything ``old`` readers in ``states`` had
        not; a ``ValueError`` says why it cannot."""

    unit_parts: int | None = None  # how the stream cut its units for its readers (kept in the state)
    # What a raw batch holds (a source of the plan with the same ``raw_layout`` mixes with the stream).
    raw_layout = "raw batches"

    @abstractmethod
    def cut_units(self, parts: int) -> int:
        """Cuts the units as a checkpoint's run did; their number."""

    @abstractmethod
    def to_batch(self, raw: Any) -> dict[str, torch.Tensor]: ...

    def describe(self) -> str:
        """What the stream reads, for the data summary (its units; its rows where they are known)."""
        return type(self).__name__

    sample_tokens = 0  # tokens one sample trains, where that is fixed (the summary's token count)


class StreamDataset(IterableDataset):
    """The readers of one rank: DataLoader worker ``w`` plays local reader ``(w + first) % workers``."""

    def __init__(self, stream: Stream, rank: int, world: int, workers: int, states: dict[int, ReaderState], first: int):
        self.stream, self.rank, self.world, self.workers = stream, rank, world, workers
        self.states, self.first = states, first

    def __iter__(self) -> Iterator[tuple[Any, int, ReaderState]]:
        info = get_worker_info()
        local = ((info.id if info is not None else 0) + self.first) % self.workers
        reader = self.rank * self.workers + local
        for raw, state in self.stream.read(reader, self.world * self.workers, self.states.get(reader)):
            yield raw, reader, state


class StreamCursor:
    """Every local reader's state after each recent batch handed to training, by batch count."""

    def __init__(self, batches: int = 0, states: dict[int, ReaderState] | None = None) -> None:
        self.batches = batches  # batches handed out so far, over all restarts
        self.saved = dict(states or {})
        self._recent: dict[int, deque[tuple[int, ReaderState]]] = {}

    def record(self, reader: int, state: ReaderState) -> None:
        self.batches += 1
        self._recent.setdefault(reader, deque(maxlen=16)).append((self.batches, state))

    def states_at(self, batches: int) -> dict[int, ReaderState]:
        """Each reader's state once ``batches`` batches have been trained."""
        states = dict(self.saved)
        for reader, recent in self._recent.items():
            done = [state for count, state in recent if count <= batches]
            if done:
                states[reader] = done[-1]
            elif len(recent) == recent.maxlen:  # the state it needs was pushed out of the window
                raise RuntimeError(f"reader {reader}'s state at batch {batches} is no longer held")
        return states


class StreamLoader(DataLoader):
    """Yields a stream's tensor batches, recording each batch's reader state in ``cursor``.

    One iteration runs across epochs: each ``iter()`` continues where the last stopped, for
    ``epoch_batches()`` batches (``None``: endless), so no batch a prefetcher pulled is lost;
    ``epoch_length`` is a whole epoch's batches, its ``len`` (``None``: no length).
    """

    def __init__(
        self,
        dataset: StreamDataset,
        cursor: StreamCursor,
        epoch_batches: Callable[[], int | None],
        epoch_length: int | None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=keep_raw,
            prefetch_factor=prefetch_factor,
            worker_init_fn=keep_inherited_memory_shared,
        )
        self.cursor, self.epoch_batches, self.pin_batches = cursor, epoch_batches, pin_memory
        self.epoch_length = epoch_length
        self._raws: Iterator[tuple[Any, int, ReaderState]] | None = None
        self.stop_together = False  # several ranks: a failure ends the batches with a stop they vote on

    def __len__(self) -> int:
        if self.epoch_length is None:
            raise TypeError("an endless stream has no length")
        return self.epoch_length

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return stop_together(self._batches()) if self.stop_together else self._batches()

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        remaining = self.epoch_batches()
        to_batch = self.dataset.stream.to_batch
        while remaining is None or remaining > 0:
            batch = to_batch(self.next_raw())
            yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_batches else batch
            remaining = None if remaining is None else remaining - 1

    def next_raw(self) -> Any:
        """The next raw batch, its reader's state after it recorded; the readers run on from the last."""
        if self._raws is None:
            self._raws = from_workers(self, super().__iter__) if self.num_workers else super().__iter__()
        raw, reader, state = next(self._raws)
        self.cursor.record(reader, state)
        return raw

    def close(self) -> None:
        """Shut the workers down now (the DataModule's ``teardown``); the next iteration starts the
        readers again from the start."""
        raws, self._raws = self._raws, None
        if hasattr(raws, "close"):
            raws.close()  # the worker iterator, released, shuts its workers down

    # Resume state lives in the DataModule (reader states at the loop's batch count); these only tell
    # Lightning that this loader resumes exactly, so it does not warn.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def gathered(local: dict[int, Any], reads: bool = True, everywhere: bool = False) -> dict[int, Any]:
    """Every rank's part (reader states, or anything keyed by reader or data-parallel rank), on global
    rank 0, which alone writes a checkpoint (a collective when a process group runs); the other ranks
    get their own part back and receive nothing, so what a checkpoint costs them does not grow with the
    rank count (``everywhere``: on every rank, for parts of a few numbers a rank). A rank that does not
    read (a ``broadcast_within`` peer, whose group's first rank reads for it) gives nothing, so its
    stale copy never wins."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(local)
    mine = local if reads else {}
    root = everywhere or dist.get_rank() == 0
    parts: list[dict[int, Any] | None] | None = [None] * dist.get_world_size() if root else None
    if everywhere:
        dist.all_gather_object(parts, mine)
    else:
        dist.gather_object(mine, parts, dst=0)
    merged: dict[int, Any] = {}
    for part in parts if root else [mine]:
        merged.update(part or {})
    return merged


class StreamTraining:
    """The training side of a streamed source: its loader, its state and its resume.

    Args:
        stream: the stream.
        owner: the DataModule's name, for messages.
    """

    def __init__(self, stream: Stream, owner: str) -> None:
        self.stream, self.owner = stream, owner
        self.cursor = StreamCursor()
        self._restored: dict[str, Any] | None = None

    def loader(
        self,
        rank: int,
        world: int,
        num_workers: int,
        batches_trained: int,
        epoch_batches: Callable[[], int | None],
        epoch_length: int | None,
        **loader_kwargs: Any,
    ) -> StreamLoader:
        workers = max(1, num_workers)
        num_readers = world * workers
        states = self._redealt(self.cursor.states_at(batches_trained), world, workers)
        idle = set(self.stream.idle_readers(num_readers))
        if rank == 0 and idle:
            names = ", ".join(f"rank {r // workers} worker {r % workers}" for r in sorted(idle))
            log.warning("%s: the stream has fewer shards than its %d readers; idle: %s", self.owner, num_readers, names)
        self.cursor = StreamCursor(batches_trained, states)
        # Batch b of this rank comes from its b-th active reader, round robin: start there.
        active = [w for w in range(workers) if rank * workers + w not in idle]
        if not active:
            raise ValueError(
                f"{self.owner}: rank {rank} has no stream shard to read ({num_readers} readers, "
                f"{num_readers - len(idle)} shards); use fewer ranks or workers, or more files"
            )
        first = active[batches_trained % len(active)]
        dataset = StreamDataset(self.stream, rank, world, workers, states, first)
        return StreamLoader(dataset, self.cursor, epoch_batches, epoch_length, num_workers, **loader_kwargs)

    def _redealt(self, states: dict[int, ReaderState], world: int, workers: int) -> dict[int, ReaderState]:
        """``states``, dealt to this run's readers where the checkpoint's run had others."""
        saved = self._restored
        if saved is None or (saved["ranks"], saved["workers"]) == (world, workers):
            return states
        try:
            states = self.stream.redeal(states, saved["ranks"] * saved["workers"], world * workers)
        except ValueError as error:
            raise ValueError(
                f"{self.owner}: the checkpoint's stream was read by {saved['ranks']} ranks x {saved['workers']} "
                f"workers and cannot be dealt to {world} x {workers}: {error}; use fewer ranks or workers"
            ) from None
        log.info(
            "%s: the checkpoint's stream was read by %d ranks x %d workers; what they had not finished is "
            "dealt to this run's %d x %d",
            self.owner, saved["ranks"], saved["workers"], world, workers,
        )  # fmt: skip
        self._restored = {**saved, "ranks": world, "workers": workers}
        return states

    def state_dict(self, world: int, num_workers: int, batches_trained: int, reads: bool = True) -> dict[str, Any]:
        """This stream's state after ``batches_trained`` of its batches, with every rank's readers
        (collective; ``reads``: whether this rank reads, see ``gathered``)."""
        ranks, workers = world, max(1, num_workers)
        states = gathered(self.cursor.states_at(batches_trained), reads)
        return {
            "stream": self.stream.identity(),
            "ranks": ranks,
            "workers": workers,
            "unit_parts": self.stream.unit_parts,
            "batches": batches_trained,
            "readers": {int(k): v for k, v in sorted(states.items())},
        }

    def load_state_dict(self, state: dict[str, Any], allow_change: bool) -> bool:
        """Resumes from ``state``; ``False`` where it was another stream's (allowed: this one starts anew)."""
        if state.get("stream") != self.stream.identity():
            message = f"{self.owner}: the stream differs from the checkpoint's (data, tokenizer, options or seed)"
            if not allow_change:
                raise ValueError(message + "; pass allow_plan_change=True to start the new stream from its beginning")
            log.warning("%s; starting it from its beginning because allow_plan_change=True", message)
            return False
        if state.get("unit_parts"):
            self.stream.cut_units(state["unit_parts"])
        self._restored = state
        self.cursor = StreamCursor(int(state["batches"]), {int(k): v for k, v in state["readers"].items()})
        return True


def as_tensor(values: np.ndarray) -> torch.Tensor:
    """An array for a checkpoint: a tensor (``torch.load(weights_only=True)`` reads it back)."""
    return torch.from_numpy(np.ascontiguousarray(values))
