"""The dataset and DataLoader every plan-driven source shares.

Workers (or the main process) turn a span of plan positions into a compact raw batch; the main
process turns it into tensors, so worker processes never pay per-tensor IPC.
"""

from __future__ import annotations

import dataclasses
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.plan.docstrings import expand_argument_docs
from datamodules.plan.parallelism import Job
from datamodules.plan.permutation import mix64
from datamodules.plan.sample_plan import SamplePlan
from datamodules.plan.stopping import from_workers, stop_together
from datamodules.plan.worker_start import keep_inherited_memory_shared

if TYPE_CHECKING:
    from datamodules.plan.stream import Stream

IGNORE_INDEX = -100  # label of a position that takes no loss (PyTorch cross-entropy's ignore_index)
_CHUNK = 4096
MESSAGE_BATCHES = 16  # micro-batches per worker message, unless a source says otherwise
# With ``in_order=False``, each batch names the first plan position of its span (a plain int, popped
# before the model sees the batch), so the DataModule can record which batches were trained.
POSITION = "plan_position"
# With streams in the plan, each row's plan source (``StreamSlots`` fills the streams' rows).
PLAN_SOURCES = "plan_sources"


class Source(Protocol):
    """What a map-style source gives the plan: a length, batched raw reads, and tensor assembly."""

    fingerprint: str

    def __len__(self) -> int: ...

    def fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]: ...

    # A source with ``uses_sample_keys = True`` gets ``fetch(indices, keys=...)``: one uint64 per sample,
    # a pure function of (seed, plan position), from which it draws any random choice (augmentation),
    # so a sample looks the same on every run, with any worker count, and after resume. One with
    # ``uses_passes = True`` also gets ``passes=...``: how many passes over it came before each sample
    # (packed rows are packed afresh every pass); one with ``uses_positions = True`` gets each sample's
    # plan position (``positions=...``). A source may define ``mask_rows(batch, invalid)``
    # to take the loss off padding rows; the default sets their ``labels`` to ``IGNORE_INDEX``. One
    # with ``fetch_many(calls)`` reads the spans of a whole worker message at once (a list of
    # ``(indices, extra)``, a raw batch for each), so their slow fetches overlap. One that knows which
    # tokenizer wrote its ids says so in ``vocabulary`` (compared by ``same_tokenizer``).

    def to_batch(self, raw: dict[str, np.ndarray]) -> dict[str, torch.Tensor]: ...

    @classmethod
    def join(cls, parts: list[Source]) -> Source:
        """One source holding ``parts``' samples one after another (how a mixture reads in one go)."""
        ...


def same_tokenizer(first: Any, second: Any) -> bool:
    """Whether two sources' ``vocabulary`` give an id the same token: by the tokenizer's content
    (``tokenizer_hash``) where both record it, so one tokenizer loaded from two paths is one, else
    (data prepared before the hash was recorded) by the tokenizer's name or path."""
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return first == second
    ignored = "tokenizer" if first.get("tokenizer_hash") and second.get("tokenizer_hash") else "tokenizer_hash"
    return {k: v for k, v in first.items() if k != ignored} == {k: v for k, v in second.items() if k != ignored}


class PlanDataset(Dataset):
    """Reads the samples at a span of plan positions from ``source``.

    Args:
        source: the samples; for a mixture, the plan's sources joined one after another.
        plan: maps positions to (plan source, sample index).
        limit: positions at or past ``limit`` are padding (rows with no loss) rather than samples;
            ``None`` reads an endless stream of passes.
    """

    def __init__(
        self, source: Source, plan: SamplePlan, limit: int | None = None, streams: frozenset[int] = frozenset()
    ) -> None:
        self.source = source
        self.plan = plan
        self.limit = limit
        self.streams = streams
        # Where each plan source starts inside the joined ``source`` (a stream has no part in it).
        sizes = [0 if i in streams else s.num_samples for i, s in enumerate(plan.sources)]
        self._offsets = np.cumsum([0] + sizes[:-1])
        empty = np.empty(0, dtype=np.int64)
        self._chunk = (0, empty, empty, empty)
        self.tag_positions = False  # set by a loader that hands batches over out of order

    def __len__(self) -> int:
        return len(self.source)

    def sample_indices(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sample (in the joined source; -1 for a stream's rows) at each of ``positions``, and the
        passes over its source before it."""
        sources, indices, passes = self.plan.locate_in_passes(positions)
        indices += self._offsets[sources]
        if self.streams:
            indices[np.isin(sources, list(self.streams))] = -1
        return indices, passes

    def _indices(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample indices (in the joined source), passes and plan sources of positions ``[first, stop)``."""
        # The plan is evaluated a chunk of positions at a time: its per-call overhead then vanishes.
        chunk_first, indices, passes, sources = self._chunk
        if not chunk_first <= first <= stop <= chunk_first + len(indices):
            sources, indices, passes = self.plan.locate_in_passes(np.arange(first, first + max(_CHUNK, stop - first)))
            indices += self._offsets[sources]
            self._chunk = chunk_first, indices, passes, sources = first, indices, passes, sources
        span = slice(first - chunk_first, stop - chunk_first)
        return indices[span], passes[span], sources[span]

    def __getitem__(self, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Samples at positions ``[first, stop)``; positions from ``limit`` on are padding."""
        indices, extra, marks = self._request(span)
        return self._finish(self.source.fetch(indices, **extra), span, marks)

    def __getitems__(self, spans: list[tuple[int, int]]) -> list[dict[str, np.ndarray]]:
        """The spans of one worker message (the DataLoader calls this when the dataset has it)."""
        fetch_many = getattr(self.source, "fetch_many", None)
        if fetch_many is None:
            return [self[span] for span in spans]
        requests = [self._request(span) for span in spans]
        raws = fetch_many([(indices, extra) for indices, extra, _ in requests])
        return [self._finish(raw, span, marks) for raw, span, (_, _, marks) in zip(raws, spans, requests, strict=True)]

    def _finish(self, raw: dict[str, Any], span: tuple[int, int], marks: dict[str, np.ndarray]) -> dict[str, Any]:
        raw.update(marks)
        if self.tag_positions:
            raw[POSITION] = span[0]
        return raw

    def _request(self, span: tuple[int, int]) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(indices, extra fetch arguments, marks)`` of a span. ``marks`` go into the raw batch: which
        rows are real (``valid``, where there is padding), and with streams each row's plan source
        (``PLAN_SOURCES``): the source reads only the other rows, the loader fills the stream's."""
        first, stop = span
        positions = np.arange(first, stop)
        marks = {}
        if self.limit is None:
            indices, passes, sources = self._indices(first, stop)
            if self.streams:
                marks[PLAN_SOURCES] = sources
                mapped = ~np.isin(sources, list(self.streams))
                indices, passes, positions = indices[mapped], passes[mapped], positions[mapped]
        else:
            marks["valid"] = valid = positions < self.limit
            indices = np.zeros(stop - first, dtype=np.int64)
            passes = np.zeros(stop - first, dtype=np.int64)
            real = int(valid.sum())
            indices[:real], passes[:real], _ = self._indices(first, first + real)
        extra = {}
        if getattr(self.source, "uses_sample_keys", False):
            extra["keys"] = mix64(positions.astype(np.uint64) ^ mix64(np.array([self.plan.seed], dtype=np.uint64)))
        if getattr(self.source, "uses_passes", False):
            extra["passes"] = passes
        if getattr(self.source, "uses_positions", False):
            extra["positions"] = positions
        return indices, extra, marks


def mask_labels(batch: dict[str, torch.Tensor], invalid: torch.Tensor) -> None:
    """Padding rows take no loss: their ``labels`` become ``IGNORE_INDEX``."""
    batch["labels"][invalid] = IGNORE_INDEX


def keep_raw(raw: Any) -> Any:
    return raw


def in_groups(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of ``size`` items (the last may be shorter)."""
    while group := list(itertools.islice(items, size)):
        yield group


def read_ahead(read: Callable[[Any], Any], items: Iterator[Any]) -> Iterator[Any]:
    """``read(item)`` for each item, in order, each read running in a thread while the caller
    works on the previous one's result. A read's error surfaces at once: the read already started
    is left to finish in the background, not waited for (a loader closed normally waits for it)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="plan-read-ahead")
    failed = False
    try:
        pending = None
        for item in items:
            following = pool.submit(read, item)
            if pending is not None:
                yield pending.result()
            pending = following
        if pending is not None:
            yield pending.result()
    except Exception:
        failed = True
        raise
    finally:
        pool.shutdown(wait=not failed, cancel_futures=True)


class PlanDataLoader(DataLoader):
    """A ``DataLoader`` over a ``PlanDataset`` and ``PlanSampler`` that yields tensor batches.

    Worker processes send ``MESSAGE_BATCHES`` raw micro-batches per message (the DataLoader's "batch" is a
    list of them): one message between processes costs ~150 us here, ten times the reading of a
    token micro-batch. A source whose micro-batch costs far more (decoded images) sets
    ``batches_per_message`` lower, so the first batch does not wait for sixteen.
    In-process, each span goes straight from the sampler to the dataset, skipping the
    DataLoader's per-item machinery, and the sampler advances no further than what was yielded.
    With ``in_order=False`` (workers only), worker messages are handed over as they finish rather
    than in plan order; a dataset with ``tag_positions`` then names each batch's span (``POSITION``).
    With ``stop_together`` (several ranks), a failure does not raise here: it ends the batches with a
    stop every rank votes on (``stopping.py``).
    """

    def __init__(
        self,
        dataset: PlanDataset,
        sampler: torch.utils.data.Sampler,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        multiprocessing_context: str | None = None,
        in_order: bool = True,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=getattr(dataset.source, "batches_per_message", MESSAGE_BATCHES) if num_workers > 0 else None,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=keep_raw,
            persistent_workers=num_workers > 0,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
            in_order=in_order,
            worker_init_fn=keep_inherited_memory_shared,
        )
        # Tensors are built here in the main process, so they are pinned here, on both paths; the
        # DataLoader's own pinning would only see the workers' numpy arrays.
        self.pin_batches = pin_memory
        self.stop_together = False
        # With streams in the plan: a raw batch with its streams' rows filled in (``StreamSlots.fill``).
        self.fill_streams: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # micro-batches, however many travel in one worker message

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return stop_together(self._batches()) if self.stop_together else self._batches()

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        group = getattr(self.dataset.source, "batches_per_message", MESSAGE_BATCHES)
        if self.num_workers == 0 and hasattr(self.dataset.source, "fetch_many"):
            # Concurrent fetches in-process too: a group of spans at a time, the next group fetched in
            # a thread while this one trains (the sampler runs ahead by at most two groups; the
            # DataModule's state comes from the Trainer's count, not the sampler's).
            raws = itertools.chain.from_iterable(
                read_ahead(self.dataset.__getitems__, in_groups(iter(self.sampler), group))
            )
        elif self.num_workers == 0:
            raws = map(self.dataset.__getitem__, self.sampler)
        else:
            raws = itertools.chain.from_iterable(from_workers(self, super().__iter__))
        to_batch = self.dataset.source.to_batch
        mask_rows = getattr(self.dataset.source, "mask_rows", mask_labels)
        for raw in raws:
            position = raw.pop(POSITION, None)
            if PLAN_SOURCES in raw:
                raw = self.fill_streams(raw)
            batch = to_batch(raw)
            if "valid" in raw:
                mask_rows(batch, torch.from_numpy(~raw["valid"]))
            if self.pin_batches:
                batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            yield batch if position is None else {**batch, POSITION: position}

    def close(self) -> None:
        """Shut the persistent workers down now (the DataModule's ``teardown``); the next iteration
        starts new ones."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    # Resume state lives in the DataModule (positions consumed, derived from the training loop).
    # These two methods only tell Lightning that this loader resumes exactly, so it does not warn.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class SourceSpec(ABC):
    """A configured source (a YAML entry): builds its training samples and validation samples."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        expand_argument_docs(cls)  # every argument's own help in LightningCLI (``--data.help``)

    def hyperparameters(self) -> dict[str, Any]:
        """The source as a config names it (``class_path`` and ``init_args`` of plain values), for a
        checkpoint's hyperparameters; ``storage_options`` (credentials) and objects are left out."""

        def plain(value: Any) -> bool:
            if isinstance(value, (list, tuple)):
                return all(map(plain, value))
            if isinstance(value, dict):
                return all(isinstance(k, str) and plain(v) for k, v in value.items())
            return value is None or isinstance(value, (str, int, float, bool))

        names = [f.name for f in dataclasses.fields(self)] if dataclasses.is_dataclass(self) else []
        fields = {name: getattr(self, name) for name in names if name != "storage_options"}
        kind = type(self)
        return {
            "class_path": f"{kind.__module__}.{kind.__qualname__}",
            "init_args": {name: value for name, value in fields.items() if plain(value)},
        }

    def prepare(self) -> None:  # noqa: B027 (optional hook: most sources need no preparation)
        """Work done before ``build`` in one process per node, or one in all (Lightning's
        ``prepare_data``), such as tokenizing into a cache; nothing by default."""

    def build_stream(
        self, seq_len: int, batch_size: int, pack_sequences: bool, seed: int, job: Job | None = None
    ) -> tuple[Stream, dict[str, Source]] | None:
        """``(stream, held)`` for a source read as a stream (in order, by readers of its own) rather than
        by plan position; ``None`` (default): a map-style source, which ``build`` builds."""
        return None

    @abstractmethod
    def build(self, seq_len: int, pack_sequences: bool, job: Job | None = None) -> tuple[Source, dict[str, Source]]:
        """``(train, held)``: the training samples and the held-out splits by role
        (``{"validation": ..., "test": ...}``, each present only when configured).

        ``job``: the job's processes and collectives (``job(make)`` runs ``make`` on global rank 0
        and hands its value to every rank); a source reads what describes its data once per job
        through it. ``None``: this is the only process.
        """
