"""The LightningDataModule base every plan-driven source shares: rank views, state and resume.

A subclass only builds its sources (and, for a mixture, its schedule); slicing by rank, exact
resume and plan checks live here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

from datamodules.plan.arguments import require_int
from datamodules.plan.docstrings import expand_argument_docs
from datamodules.plan.loader import POSITION, PlanDataLoader, PlanDataset, Source, SourceSpec
from datamodules.plan.model_parallel import BATCHES_AHEAD, BroadcastGroup, BroadcastLoader, broadcast_groups
from datamodules.plan.parallelism import Job, data_parallel_rank_and_size
from datamodules.plan.planned_uses import DEFAULT_HORIZON, PlannedUses
from datamodules.plan.sample_plan import PlannedSource, SamplePlan, Segment, describe_changes
from datamodules.plan.sampler import PlanSampler
from datamodules.plan.sequence_split import SequenceSplit
from datamodules.plan.stopping import STOP, RankVote
from datamodules.plan.stream import Stream, StreamTraining, as_tensor, gathered
from datamodules.plan.stream_slots import STREAM_SAMPLES, StreamSlots, left_for
from datamodules.plan.trained_spans import TrainedSpans
from datamodules.plan.worker_start import start_method

log = logging.getLogger(__name__)


class PlanDataModule(LightningDataModule):
    """Serves sources through the global sample plan.

    Its state is rank-agnostic: the plan positions the training loop has consumed, the plan's
    fingerprint and, for a mixture, the schedule segments already trained. Positions are counted
    from Lightning's own count of processed training batches, so prefetching loaders and worker
    processes never make the state run ahead of training.

    Args:
        batch_size: samples per data-parallel rank per micro-batch.
        seed: seed of the data order, separate from the model's seed.
        num_workers: DataLoader worker processes; the order does not depend on it.
        allow_plan_change: resume from a checkpoint whose plan differs (other data or seed),
            continuing at the saved position of the new plan instead of refusing; or from a checkpoint
            past step 0 that holds no state of this DataModule (another DataModule's run), starting its
            data from the beginning.
        pin_memory: copy batches into pinned (page-locked) memory, for faster host-to-GPU copies;
            default ``None``: on when the Trainer's accelerator is a CUDA GPU.
        prefetch_factor: worker messages (of 16 micro-batches) each worker prepares ahead;
            default ``None``: the DataLoader's default (2). Needs ``num_workers > 0``.
        in_order: ``False`` hands batches to training as workers finish them, so one slow batch does
            not stall the rest (needs ``num_workers > 0``). The order is then not reproducible, but a
            resume still trains every batch exactly once: the state records the batches trained out of
            order, and resumes on the same number of data-parallel ranks.
        broadcast_within: the dimension(s) of the strategy's device mesh whose ranks train on the same
            batch (``"tensor_parallel"`` under ``ModelParallelStrategy``; any named dimensions of a
            custom strategy's ``device_mesh``): only the first rank of each such group reads the data
            (its loader alone starts workers), and sends each batch to the others over a gloo group.
            The data order, the state and resume are the same with or without it. Default ``None``:
            every rank reads its own batches.
        split_sequence_for: the dimension(s) of the device mesh whose ranks each train on a share of
            every row of one batch (``"context_parallel"``): the group's first rank reads, as with
            ``broadcast_within``, and every rank keeps its share of the per-token tensors
            (``sequence_split.py``), with ``sequence_index`` (the row positions it holds) and
            ``full_seq_len``; ``document_ids`` and ``cu_seqlens`` stay whole. Text, conversation and
            hidden-state batches only; the rows' length must split into equal chunks.
        sequence_split: how a row is shared: ``"head_tail"`` (chunks ``r`` and ``2C - 1 - r`` of
            ``2C``, balanced for ring attention under a causal mask) or ``"contiguous"`` (chunk ``r``
            of ``C``, for Ulysses all-to-all attention).
    """

    def __init__(
        self,
        batch_size: int,
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        in_order: bool = True,
        broadcast_within: str | list[str] | None = None,
        split_sequence_for: str | list[str] | None = None,
        sequence_split: str = "head_tail",
    ) -> None:
        super().__init__()
        self.batch_size = require_int("batch_size", batch_size, 1)
        self.seed = require_int("seed", seed, 0)
        self.num_workers = require_int("num_workers", num_workers, 0)
        if prefetch_factor is not None:
            require_int("prefetch_factor", prefetch_factor, 1)
            if num_workers == 0:
                raise ValueError(f"prefetch_factor={prefetch_factor} needs num_workers > 0 (workers prefetch)")
        if not in_order and num_workers == 0:
            raise ValueError(
                "in_order=False hands over batches as worker processes finish them; it needs num_workers > 0"
            )
        self.in_order = in_order
        for option, dims in (("broadcast_within", broadcast_within), ("split_sequence_for", split_sequence_for)):
            if dims is not None and not (
                isinstance(dims, str) or (isinstance(dims, (list, tuple)) and all(isinstance(d, str) for d in dims))
            ):
                raise ValueError(f"{option} names mesh dimensions (a name or a list), got {dims!r}")
        SequenceSplit(0, 1, sequence_split)  # a layout it knows
        self.broadcast_within, self.split_sequence_for = broadcast_within, split_sequence_for
        self.sequence_split = sequence_split
        self._broadcast: BroadcastGroup | None = None
        self.allow_plan_change = allow_plan_change
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.plan: SamplePlan | None = None
        self.sources: list[PlannedSource] | None = None
        self._train: Source | None = None
        self._held: dict[str, list[tuple[str, Source]]] = {}  # held-out splits by role: (source name, samples)
        self._sampler: PlanSampler | None = None
        self._anchor_positions = 0
        self._anchor_batches: int | None = None
        self._saved_segments: list[Segment] = []
        self._epoch_end: int | None = None  # from a checkpoint: where the epoch in progress ends
        self._pending_state: dict[str, Any] | None = None
        self._resume_checked = False  # a checkpoint's state of this DataModule, or its absence, was looked at
        self._stream: StreamTraining | None = None
        # Streams among the plan's sources (a mixture's streamed components), by plan source id.
        self._plan_streams: dict[int, StreamTraining] = {}
        self._slots: StreamSlots | None = None
        self._slots_resumed: tuple[dict[int, int], dict[int, dict[str, Any]]] = ({}, {})
        self._trained: TrainedSpans | None = None  # with batches out of order: which were trained
        self._resume_spans: list[int] = []  # this rank's spans trained out of order before the checkpoint
        self.phases: list[dict[str, Any]] | None = None  # the PhaseScheduler's schedule, when one runs
        self._checkpoint_phases: list[dict[str, Any]] | None = None
        self._summarized = False  # the data summary is shown once per fit
        self._logged_step: int | None = None  # the last step whose metrics were looked at
        self._vote = RankVote(type(self).__name__)  # several ranks stop together (stopping.py)
        self._loaders: weakref.WeakSet = weakref.WeakSet()  # closed at teardown

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that ship the DataModule to their processes (``ddp_spawn``, Ray) pickle it; the
        # loaders it made stay with the process that runs them.
        state = self.__dict__.copy()
        state["_loaders"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._loaders = weakref.WeakSet()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        expand_argument_docs(cls)  # every argument's own help in LightningCLI (``--data.help``)

    def build_sources(self) -> list[tuple[str, Source | None, dict[str, Source]]]:
        """``(name, train, held)`` of every source: ``held`` maps ``"validation"`` and ``"test"`` to
        their samples, where the source has them (a bare ``Source`` or ``None`` is taken as validation)."""
        raise NotImplementedError

    def build_stream(self) -> Stream | None:
        """The training stream of a source read in order rather than by plan position; ``None``
        (default) for plan-driven training. ``build_sources`` then gives validation only."""
        return None

    @property
    def job(self) -> Job:
        """The job's processes and collectives, from the Trainer's strategy (``job(make)``: ``make()``
        on global rank 0, its value broadcast to every rank)."""
        return Job(self.trainer)

    def set_phases(self, phases: list[dict[str, Any]]) -> None:
        """The ``PhaseScheduler``'s phases (``{start_step, dataset_weights, lr_scale}``), installed at its
        ``setup``. They are saved with the data state, so that a resume without the callback continues
        the phases trained so far, or is refused where only the callback could (an LR scale)."""
        self.phases = [dict(p) for p in phases]

    def _continue_checkpoint_phases(self, step: int) -> None:
        """A resume without the callback the checkpoint trained with: the phases trained so far go on."""
        saved, self._checkpoint_phases = self._checkpoint_phases, None
        if saved is None or self.phases is not None:
            return
        trained = [p for p in saved if p["start_step"] <= step]
        active, later = trained[-1], [p for p in saved if p["start_step"] > step]
        name = type(self).__name__
        if active["lr_scale"] != 1:
            raise ValueError(
                f"{name}: the checkpoint trained with a PhaseScheduler whose phase from step {active['start_step']} "
                f"scales the LR by {active['lr_scale']}; resumed at step {step} without that callback, the LR would "
                f"jump back to the scheduler's. Add PhaseScheduler(phases={saved}) to the Trainer's callbacks"
            )
        if later:
            log.warning(
                "%s: resumed at step %d without the PhaseScheduler the checkpoint trained with: phase %s goes on; "
                "the later phases %s start only with the callback",
                name,
                step,
                active,
                later,
            )
        self.set_phases(trained)

    def source_specs(self) -> list[SourceSpec]:
        """The configured sources, whose ``prepare`` runs in ``prepare_data``."""
        return []

    def prepare_data(self) -> None:
        # Lightning runs this in one process per node (prepare_data_per_node=True) or one in all.
        for spec in self.source_specs():
            spec.prepare()

    def plan_identity(self) -> dict[str, Any]:
        """What fixes the data order of the positions already trained; a resume must match it."""
        return {"seed": self.seed, "sources": [asdict(s) for s in self.sources]}

    def build_plan(self, position: int, step: int) -> SamplePlan:
        """The plan for a run whose next position is ``position`` at optimizer step ``step``."""
        return SamplePlan(tuple(self.sources), seed=self.seed)

    @property
    def _built(self) -> bool:
        return self._train is not None or self._stream is not None

    def setup(self, stage: str) -> None:
        self._summarized = False
        self._resume_checked = False
        self._vote = RankVote(type(self).__name__)
        if not self._built:
            stream = self.build_stream()
            if stream is not None:
                self._stream = StreamTraining(stream, type(self).__name__)
                self._held = held_by_role(self.build_sources())
        if not self._built:
            parts = self.build_sources()
            streams = {i: train for i, (_, train, _) in enumerate(parts) if isinstance(train, Stream)}
            trains = [train for i, (_, train, _) in enumerate(parts) if i not in streams]
            self._check_streams(parts, streams, trains)
            self._train = trains[0] if len(trains) == 1 else type(trains[0]).join(trains)
            self._held = held_by_role(parts)
            self.sources = [planned_source(name, train) for name, train, _ in parts]
            owner = type(self).__name__
            self._plan_streams = {
                i: StreamTraining(stream, f"{owner} source {parts[i][0]!r}") for i, stream in streams.items()
            }
        self.dp_rank, self.dp_size = data_parallel_rank_and_size(self.trainer)
        if (self.broadcast_within or self.split_sequence_for) is not None and self._broadcast is None:
            self._broadcast = self._broadcast_group()
        if self._stream is None:
            self.check_global_batch()
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)

    def _check_streams(self, parts: list[tuple[str, Any, Any]], streams: dict[int, Stream], trains: list) -> None:
        """Streams among the sources need a map-style source beside them, whose samples they match."""
        if not streams:
            return
        names = [name for name, _, _ in parts]
        if not trains:
            raise ValueError(
                f"{type(self).__name__}: sources {names} are all streams; a plan needs at least one map-style "
                "source beside its streams (token shards, or a HuggingFace dataset without streaming)"
            )
        if not self.in_order:
            raise ValueError(f"{type(self).__name__}: streamed sources give their samples in order; keep in_order=True")
        for i, stream in streams.items():
            for name, train, _ in parts:
                if not isinstance(train, Stream) and getattr(train, "raw_layout", None) != stream.raw_layout:
                    raise ValueError(
                        f"{type(self).__name__}: the streamed source {names[i]!r} gives {stream.raw_layout}, but "
                        f"source {name!r} gives {getattr(train, 'raw_layout', type(train).__name__)}; a stream mixes "
                        "only with sources of the same samples"
                    )

    def _broadcast_group(self) -> BroadcastGroup | None:
        """This rank's group of ``broadcast_within`` and ``split_sequence_for``, its ranks checked to share a
        data-parallel rank, its rows checked to split."""
        group = broadcast_groups(self.trainer, self.broadcast_within, self.split_sequence_for, self.sequence_split)
        if group is None:
            return None
        if group.split is not None:
            group.split.check(self.sequence_length(), "seq_len" if hasattr(self, "seq_len") else "total_seq_len")
        import torch.distributed as dist

        dp_ranks: list[Any] = [None] * len(group.ranks)
        dist.all_gather_object(dp_ranks, self.dp_rank, group=group.group)
        if len(set(dp_ranks)) > 1:
            raise ValueError(
                f"{type(self).__name__}: ranks {list(group.ranks)} "
                f"share batches but have data-parallel ranks {dp_ranks}; the strategy's "
                "distributed_sampler_kwargs must give the ranks of a model-parallel group one data-parallel rank"
            )
        return group

    def teardown(self, stage: str) -> None:
        self._vote.finish()
        # The Trainer's objects end in reference cycles; a worker iterator collected with them is shut
        # down after the collector closed its queues, and each worker then waits out torch's 5 s join.
        for loader in list(self._loaders):
            loader.close()

    def on_exception(self, exception: BaseException) -> None:
        self._vote.finish(failed=True)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks: one block of the plan."""
        return self.batch_size * self.dp_size * self.accumulate_grad_batches

    def samples_per_step(self) -> list[dict[str, int]]:
        """Samples of each source in one optimizer step, for every set of weights the run uses."""
        return [{self.sources[0].name: self.global_batch_size}]

    def check_global_batch(self) -> None:
        """A global batch must not hold more samples of a source than it has: rows would repeat in it."""
        sizes = {s.name: s.num_samples for s in self.sources}
        for counts in self.samples_per_step():
            for name, count in counts.items():
                if count > sizes[name]:
                    raise ValueError(
                        f"a global batch of {self.global_batch_size} samples (batch_size {self.batch_size} x "
                        f"{self.dp_size} data-parallel ranks x {self.accumulate_grad_batches} accumulated) takes "
                        f"{count} samples of source {name!r}, which has only {sizes[name]}: rows would repeat within "
                        "a batch; use a smaller batch or more data"
                    )

    def _require_setup(self) -> Source | None:
        if not self._built:
            raise RuntimeError(f"call {type(self).__name__}.setup('fit') before asking for a dataloader")
        return self._train

    @property
    def accumulate_grad_batches(self) -> int:
        return int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)

    def _batches_trained(self) -> int:
        fit_loop = getattr(self.trainer, "fit_loop", None)
        if fit_loop is not None:
            return fit_loop.epoch_loop.batch_progress.total.processed
        if self._stream is not None:
            return self._stream.cursor.batches
        return self._sampler.batches_yielded if self._sampler is not None else 0

    @property
    def positions_consumed(self) -> int:
        """Plan positions trained so far, over all ranks and all restarts (out of order: up to the
        first span of this rank not yet trained)."""
        if self._trained is not None:
            return self._trained.position
        if self._anchor_batches is None or self._sampler is None:
            return self._anchor_positions
        return self._sampler.position_after(self._anchor_positions, self._batches_trained() - self._anchor_batches)

    def _start_position(self) -> int:
        # Anchored at the first iter(), after Lightning has restored its loop counters.
        if self._anchor_batches is None:
            self._anchor_batches = self._batches_trained()
        return self.positions_consumed

    def _refuse_checkpoint_without_state(self) -> None:
        """Lightning restores a DataModule's state by its class name and says nothing when the checkpoint
        has none: a run resumed at step 500 from another DataModule's checkpoint would train this one's
        data from position 0. That is refused, once per fit, unless ``allow_plan_change``."""
        checked, self._resume_checked = self._resume_checked, True
        path, step = getattr(self.trainer, "ckpt_path", None), getattr(self.trainer, "global_step", 0)
        if checked or path is None or not step:
            return
        name = type(self).__name__
        held = datamodule_states(path)
        holds = f"it holds the state of {', '.join(held)}" if held else "it holds no DataModule state of this library"
        message = (
            f"{name}: the checkpoint {path} was saved at step {step}, but {holds}, not of {name}: its data would "
            "start again at position 0"
        )
        if not self.allow_plan_change:
            raise ValueError(
                f"{message}. Resume with the DataModule that wrote it, or pass allow_plan_change=True to start "
                f"{name}'s data from its beginning"
            )
        rank_zero_warn(f"{message}; starting it from its beginning because allow_plan_change=True")

    def train_dataloader(self) -> DataLoader:
        train = self._require_setup()
        self._refuse_checkpoint_without_state()
        if self._stream is not None:
            return self._stream_loader()
        self._anchor_positions, self._anchor_batches = self.positions_consumed, None
        step = getattr(self.trainer, "global_step", 0)
        self._continue_checkpoint_phases(step)
        self.plan = self.build_plan(self._anchor_positions, step)
        dataset = PlanDataset(train, self.plan, streams=frozenset(self._plan_streams))
        if getattr(train, "plans_file_reads", False):  # its file cache evicts by the plan's next use
            train.planned_uses = PlannedUses(
                dataset.sample_indices,
                train.file_keys,
                self._anchor_positions,
                self.batch_size,
                self.dp_size,
                self._node_ranks(),
                min(self.file_cache_horizon, 2 * len(train)),  # two passes of every sample look far enough
            )
        # Whole optimizer steps per epoch, so every global batch is one optimizer step.
        steps_per_epoch = max(1, len(train) // self.global_batch_size)
        self._sampler = PlanSampler(
            dataset,
            batch_size=self.batch_size,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            num_batches=steps_per_epoch * self.accumulate_grad_batches,
            start_position=self._start_position,
            accumulate=self.accumulate_grad_batches,
            epoch_end=self._current_epoch_end(steps_per_epoch),
        )
        if not self.in_order or self._resume_spans:
            # Batches are recorded as they are trained (``on_after_batch_transfer``), by their span.
            trained = self._trained.ahead if self._trained is not None else self._resume_spans
            self._trained = TrainedSpans(self._sampler, self._anchor_positions, trained)
            self._sampler.skip, self._resume_spans = set(trained), []
            dataset.tag_positions = True
        self._align_epoch_progress()
        self._log_summary(steps_per_epoch)
        loader = self._loader(dataset, self._sampler, ahead=BATCHES_AHEAD)
        if self._plan_streams:
            plan_loader = getattr(loader, "loader", loader)  # under a BroadcastLoader, the loader it reads
            plan_loader.fill_streams = self._stream_slots().fill
        return loader

    def _stream_slots(self) -> StreamSlots:
        """The plan's streams on this rank, from where the trained batches left them."""
        handed = self._batches_trained()
        if self._slots is not None:  # a reloaded train loader: the old one's state at the loop's count
            read, left = self._slots.state_at(handed)
            self._slots.close()
        else:
            read, left = self._slots_resumed
        loaders = {}
        for s, training in self._plan_streams.items():
            loaders[s] = training.loader(
                self.dp_rank, self.dp_size, self.num_workers, read.get(s, 0), lambda: None, None,
                prefetch_factor=self.prefetch_factor,
            )  # fmt: skip
            self._loaders.add(loaders[s])
        self._slots = StreamSlots(loaders, handed, read, left)
        return self._slots

    @property
    def _known_epoch_end(self) -> int | None:
        """Where the epoch in progress ends, as the last loader or the checkpoint left it."""
        return self._sampler.epoch_end if self._sampler is not None else self._epoch_end

    def _current_epoch_end(self, steps_per_epoch: int) -> int:
        """The known epoch end, else (a checkpoint that did not say) the next multiple of this run's epoch."""
        if self._known_epoch_end is not None:
            return self._known_epoch_end
        epoch = steps_per_epoch * self.global_batch_size
        return -(-self._anchor_positions // epoch) * epoch

    def _align_epoch_progress(self) -> None:
        """On resume, restate Lightning's in-epoch batch count in this run's batches.

        Lightning restores how many batches of the epoch were done in the checkpoint's units; on
        another number of ranks that would end the epoch early or late, or off an optimizer step. The
        sampler knows the truth: the batches left, in whole optimizer steps, to the epoch's end.
        """
        epoch_loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        if epoch_loop is None or not epoch_loop.restarting:
            return
        start, sampler, current = self._anchor_positions, self._sampler, epoch_loop.batch_progress.current
        if not sampler.resumes_epoch(start):  # an epoch boundary: finished, or not begun
            done = sampler.num_batches if current.processed > 0 else 0
        else:
            done = sampler.num_batches - sampler.batches_left(start) + len(sampler.skip)
        # Shift every counter alike: Lightning itself completes the batch a checkpoint was saved in.
        shift = done - current.processed
        if shift:
            log.info("resumed at plan position %d: batch %d of %d of this epoch", start, done, sampler.num_batches)
            for name in ("ready", "started", "processed", "completed"):
                setattr(current, name, getattr(current, name) + shift)

    # Batches per epoch of a stream (``None``: endless, so the Trainer needs max_steps).
    stream_steps_per_epoch: int | None = None

    def _stream_loader(self) -> DataLoader:
        steps = self.stream_steps_per_epoch
        max_steps = getattr(self.trainer, "max_steps", -1)
        if steps is None and self.trainer is not None and not (max_steps and max_steps > 0):
            raise ValueError(
                f"{type(self).__name__}: a stream has no length until it is read, so training on it needs "
                "Trainer(max_steps=N), or steps_per_epoch=N for epochs of N optimizer steps"
            )
        epoch_batches = None if steps is None else steps * self.accumulate_grad_batches

        def remaining() -> int | None:
            # A resumed epoch has done some of its batches already (the loop's own count).
            if epoch_batches is None:
                return None
            loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
            done = loop.batch_progress.current.processed if loop is not None else 0
            return epoch_batches - min(done, epoch_batches)

        loader = self._stream.loader(
            self.dp_rank,
            self.dp_size,
            self.num_workers,
            self._batches_trained(),
            remaining,
            epoch_batches,
            **self._loader_options(),
        )
        self._log_summary(steps)
        return self._stopping_together(loader, ahead=BATCHES_AHEAD)

    def _node_ranks(self) -> range:
        """The data-parallel ranks on this node, as Lightning places ranks: node by node, a node's
        ranks consecutive (a cache planned for other ranks stays correct, only less effective)."""
        per_node = -(-self.dp_size // max(1, self.job.nodes))
        first = self.dp_rank // per_node * per_node
        return range(first, min(first + per_node, self.dp_size))

    def _loader_options(self) -> dict[str, Any]:
        pin = self.pin_memory
        if pin is None:
            pin = isinstance(getattr(self.trainer, "accelerator", None), CUDAAccelerator)
        elif pin and not torch.cuda.is_available():
            rank_zero_warn(f"{type(self).__name__}: pin_memory=True, but no CUDA device is available; not pinning")
            pin = False
        return {"pin_memory": pin, "prefetch_factor": self.prefetch_factor}

    # How far a planned file cache looks ahead: this node's next positions (``PlannedUses``).
    file_cache_horizon: int = DEFAULT_HORIZON

    # How workers start where ``spawn_reasons`` gives a reason not to fork: ``"spawn"`` or ``"forkserver"``.
    instead_of_fork: str = "spawn"

    # How worker processes start (``"fork"``, ``"spawn"``, ``"forkserver"``); ``None``: spawn where
    # ``spawn_reasons`` gives one, else the platform's default (fork on Linux).
    worker_start_method: str | None = None

    def spawn_reasons(self) -> list[str]:
        """Why forking workers from this process would be unsafe: the training source's own reasons (a
        video source in a process that decoded video, alone or in a mixture), else none (the sources
        re-open their files and clients in each worker)."""
        reasons = getattr(self._train, "spawn_reasons", None)
        return reasons() if reasons is not None else []

    def _loader(self, dataset: PlanDataset, sampler: PlanSampler, ahead: int = 0) -> PlanDataLoader:
        options = self._loader_options()
        method = None
        if self.num_workers > 0:
            instead = getattr(self._train, "instead_of_fork", self.instead_of_fork)  # the source's choice first
            method = start_method(self.worker_start_method, self.spawn_reasons(), type(self).__name__, instead)
        return self._stopping_together(
            PlanDataLoader(
                dataset, sampler, self.num_workers, multiprocessing_context=method, in_order=self.in_order, **options
            ),
            ahead,
        )

    def _stopping_together(self, loader: Any, ahead: int = 0) -> Any:
        """On several ranks, a loader's failure becomes a stop every rank votes on (``stopping.py``);
        with ``broadcast_within``, the group's first rank alone reads (``model_parallel.py``), training
        batches ``ahead`` of the step; every loader made is closed at ``teardown``."""
        if self._broadcast is not None:
            loader = BroadcastLoader(loader, self._broadcast, ahead)
        loader.stop_together = getattr(self.trainer, "world_size", 1) > 1
        self._loaders.add(loader)
        return loader

    def sequence_length(self) -> int:
        """The tokens of every row of a batch: what ``split_sequence_for`` cuts, in the families that take it."""
        raise NotImplementedError(f"{type(self).__name__} batches hold no rows of tokens to split")

    def source_weights(self) -> list[float] | None:
        """Each source's share of the samples at the current step (a mixture's); ``None``: one source."""
        return None

    def _log_summary(self, steps_per_epoch: int | None) -> None:
        """What the data is, once per fit on global rank 0, as a table in the style of Lightning's model
        summary and through its rank-zero logger (shown without any logging set up)."""
        if self._summarized or not getattr(self.trainer, "is_global_zero", True):
            return
        self._summarized = True
        max_steps = getattr(self.trainer, "max_steps", -1)
        max_steps = max_steps if max_steps is not None and max_steps > 0 else None
        header, rows = self._stream_summary(max_steps) if self._stream is not None else self._plan_summary(max_steps)
        epoch = f"{steps_per_epoch:,} steps per epoch" if steps_per_epoch else "a stream, endless epochs"
        resumed = self._batches_trained() if self._stream is not None else 0
        rank_zero_info(
            f"{type(self).__name__}: {epoch} of {self.global_batch_size:,} samples (batch_size {self.batch_size} x "
            f"{self.dp_size} data-parallel ranks x {self.accumulate_grad_batches} accumulated)"
            + (f", resuming at batch {resumed:,}" if resumed else "")
            + f"\n{table(header, rows)}"
            + "".join(f"\n{line}" for line in [getattr(self._train, "file_cache_summary", None)] if line)
        )

    def _plan_summary(self, max_steps: int | None) -> tuple[list[str], list[list[str]]]:
        """Per source: its samples, tokens, weight, and the passes over it that ``max_steps`` implies."""
        drawn = self.plan.samples_drawn(max_steps * self.global_batch_size) if max_steps else None
        weights = self.source_weights() or [1.0] * len(self.sources)
        rows = []
        for i, source in enumerate(self.sources):
            seq_len = source.details.get("seq_len", 0)
            stream = "stream" in source.details  # endless: samples and passes are not known
            rows.append(
                [
                    str(i),
                    source.name,
                    "stream" if stream else f"{source.num_samples:,}",
                    f"{source.num_samples * seq_len:,}" if seq_len and not stream else "-",
                    f"{weights[i]:.4g}",
                    f"{drawn[i] / source.num_samples:.2f}" if drawn is not None and not stream else "-",
                ]
            )
        passes = f"Passes in max_steps={max_steps}" if max_steps else "Passes"
        return ["", "Source", "Samples", "Tokens", "Weight", passes], rows

    def _stream_summary(self, max_steps: int | None) -> tuple[list[str], list[list[str]]]:
        """What the stream reads, by how many readers, and the samples and tokens ``max_steps`` reads."""
        stream, workers = self._stream.stream, max(1, self.num_workers)
        readers = self.dp_size * workers
        samples = max_steps * self.global_batch_size if max_steps else None
        in_steps = f" in max_steps={max_steps}" if max_steps else ""
        header = ["", "Source", "Data", "Readers", "Idle readers", f"Samples{in_steps}", f"Tokens{in_steps}"]
        row = [
            "0",
            "train",
            stream.describe(),
            f"{readers:,} ({self.dp_size} ranks x {workers} workers)",
            str(len(stream.idle_readers(readers))),
            f"{samples:,}" if samples is not None else "-",
            f"{samples * stream.sample_tokens:,}" if samples is not None and stream.sample_tokens else "-",
        ]
        return header, [row]

    @property
    def _vals(self) -> list[tuple[str, Source]]:
        return self._held.get("validation", [])

    def _held_loaders(self, role: str, options: str) -> DataLoader | list[DataLoader]:
        """One loader per source holding a ``role`` split, each sample once across ranks."""
        self._require_setup()
        loaders = [self._val_loader(name, held) for name, held in self._held.get(role, [])]
        if not loaders and role != "validation":
            raise ValueError(f"{type(self).__name__} has no {role} split: {options}")
        return loaders[0] if len(loaders) == 1 else loaders

    # How a family names its held-out splits, for the message of a test loader asked for without one.
    test_options = "give it one (test_fraction, or the family's test_split, test_dir or test_manifest)"

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._held_loaders("validation", "")

    def held_out_names(self, role: str = "validation") -> list[str]:
        """The source of each ``role`` loader (``"validation"`` or ``"test"``), in the loaders' order: a
        model names its metrics by them (``val_loss/web``) rather than by ``dataloader_idx``."""
        return [name for name, _ in self._held.get(role, [])]

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        """The test split(s), evaluated as validation is: every sample once across ranks."""
        return self._held_loaders("test", self.test_options)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Logs ``step_metrics`` on the first micro-batch of each step the Trainer logs; then the model's
        own ``on_before_batch_transfer`` (Lightning calls only the DataModule's when both define it)."""
        self._log_step_metrics()
        model = getattr(self.trainer, "lightning_module", None)
        if model is not None and is_overridden("on_before_batch_transfer", model):
            batch = model.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def _log_step_metrics(self) -> None:
        trainer = self.trainer
        step = getattr(trainer, "global_step", None)
        if trainer is None or not trainer.training or not trainer.loggers or step == self._logged_step:
            return
        self._logged_step = step
        if (step + 1) % max(1, trainer.log_every_n_steps) and step + 1 != trainer.max_steps:
            return
        metrics = self.step_metrics()
        if metrics:
            # Lightning's own row for this step, as LearningRateMonitor logs it.
            row = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", step)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=row)

    def step_metrics(self) -> dict[str, float]:
        """What the data did so far, logged every ``log_every_n_steps``: the file cache's counts in
        this rank's loaders (``file_cache/hits``, ``misses``, ``hit_rate``, ``bytes_fetched`` against
        ``bytes_read``, ``evictions``, ``not_kept``), where the source reads files through one."""
        stats = getattr(self._train, "file_cache", None)
        return stats.metrics() if stats is not None and stats.hits + stats.misses else {}

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """What a source leaves for the accelerator, on the batch once it is there (image sources
        normalize their uint8 pixels: a quarter of the bytes cross the loader and the host-to-device
        copy); then the model's own ``on_after_batch_transfer``, which Lightning would otherwise skip
        when a DataModule defines the hook."""
        self._vote.check(batch.pop(STOP, None))
        position = batch.pop(POSITION, None)
        if position is not None and self._trained is not None:
            self._trained.record(position)
        on_device = getattr(self._train, "on_device", None)
        if on_device is not None:
            batch = on_device(batch)
        model = getattr(self.trainer, "lightning_module", None)
        if model is not None and is_overridden("on_after_batch_transfer", model):
            batch = model.on_after_batch_transfer(batch, dataloader_idx)
        return batch

    def _val_loader(self, name: str, val: Source) -> DataLoader:
        plan = SamplePlan((PlannedSource(name, len(val), val.fingerprint),), shuffle=False)
        dataset = PlanDataset(val, plan, limit=len(val))
        # Padding rows (no loss) keep every rank at the same batch count, each window seen once.
        sampler = PlanSampler(
            dataset,
            batch_size=self.batch_size,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            num_batches=math.ceil(len(val) / (self.batch_size * self.dp_size)),
            start_position=lambda: 0,
        )
        return self._loader(dataset, sampler)

    def _fingerprint(self) -> str:
        return hashlib.blake2b(json.dumps(self.plan_identity(), sort_keys=True).encode(), digest_size=16).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        if self._stream is not None:
            trained = self._batches_trained()
            return {"stream": self._stream.state_dict(self.dp_size, self.num_workers, trained, self._reads)}
        state: dict[str, Any] = {"positions_consumed": self.positions_consumed}
        if self._trained is not None:
            state.update(self._out_of_order_state())
        if self.sources is not None:
            state.update(plan_fingerprint=self._fingerprint(), plan=self.plan_identity())
        segments = self.plan.segments if self.plan is not None else self._saved_segments
        state["segments"] = [[s.first_position, s.block_size, list(s.probabilities)] for s in segments]
        if self._plan_streams:
            state["streams"] = self._streams_state()
        if self._known_epoch_end is not None:
            state["epoch_end"] = self._known_epoch_end
        if self.phases is not None:
            state["phases"] = self.phases
        return state

    @property
    def _reads(self) -> bool:
        """Whether this rank reads its batches (not a ``broadcast_within`` peer, which receives them)."""
        return self._broadcast is None or self._broadcast.leads

    def _streams_state(self) -> dict[str, Any]:
        """Each plan stream's readers and, per data-parallel rank, the stream batches it read and the
        samples it left, after the batches trained (collectives: only rank 0 writes the checkpoint)."""
        reads = self._reads  # a peer's loader never fills: it gives nothing
        read, left = self._slots.state_at(self._batches_trained()) if self._slots and reads else self._slots_resumed
        states = {}
        for s, training in self._plan_streams.items():
            state = training.state_dict(self.dp_size, self.num_workers, read.get(s, 0), reads)
            mine = {"batches": read.get(s, 0), "left": {k: as_tensor(v) for k, v in left.get(s, {}).items()}}
            states[self.sources[s].name] = {**state, "data_parallel_ranks": gathered({self.dp_rank: mine}, reads)}
        return states

    def _load_streams_state(self, saved: dict[str, Any]) -> None:
        """Each plan stream resumed: on the checkpoint's ranks, where this rank stood; on others, the
        readers' work dealt anew (``StreamTraining``) and the samples left by old rank ``r`` to ``r % new``."""
        read, left = {}, {}
        for s, training in self._plan_streams.items():
            state = saved.get(self.sources[s].name)
            if state is None or not training.load_state_dict(state, self.allow_plan_change):
                continue  # a changed stream, allowed: it starts from its beginning
            ranks = {int(r): part for r, part in state["data_parallel_ranks"].items()}
            if state["ranks"] == self.dp_size:
                read[s] = int(ranks[self.dp_rank]["batches"])
            left[s] = left_for(ranks, self.dp_rank, self.dp_size)
        self._slots, self._slots_resumed = None, (read, left)

    def _out_of_order_state(self) -> dict[str, Any]:
        """Every rank's trained spans (a collective: each rank trained other spans, and only rank 0
        writes the checkpoint): the position all ranks have trained up to and the spans past it."""
        local = {self.dp_rank: (self._trained.prefix, sorted(self._trained.ahead))}
        position, spans = self._trained.saved(gathered(local, everywhere=True))  # a few numbers a rank
        if not any(spans):
            return {"positions_consumed": position}
        layout = {"ranks": self.dp_size, "batch_size": self.batch_size, "spans": spans}
        return {"positions_consumed": position, "trained_out_of_order": layout}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_checked = True
        if not self._built:
            self._pending_state = state_dict
            return
        self._pending_state = None
        if self._stream is not None or "stream" in state_dict:
            if self._stream is None or "stream" not in state_dict:
                kinds = ("a stream", "plan positions") if self._stream is not None else ("plan positions", "a stream")
                raise ValueError(f"{type(self).__name__} reads {kinds[0]}, but the checkpoint holds {kinds[1]}")
            self._stream.load_state_dict(state_dict["stream"], self.allow_plan_change)
            return
        saved = state_dict.get("plan_fingerprint")
        if saved is not None and saved != self._fingerprint():
            changes = describe_changes(state_dict.get("plan", {}), self.plan_identity()) or ["plan definition"]
            message = (
                f"{type(self).__name__}: the data plan differs from the checkpoint's ({'; '.join(changes)}). "
                "Resuming would not continue the same data order."
            )
            if not self.allow_plan_change:
                raise ValueError(message + " Pass allow_plan_change=True to resume on the new plan anyway.")
            log.warning(
                "%s Continuing at position %d because allow_plan_change=True.",
                message,
                state_dict["positions_consumed"],
            )
        self._anchor_positions = int(state_dict["positions_consumed"])
        self._anchor_batches = None
        self._sampler, self._epoch_end = None, state_dict.get("epoch_end")
        self._trained, self._resume_spans = None, []
        self._checkpoint_phases = state_dict.get("phases")
        out_of_order = state_dict.get("trained_out_of_order")
        if out_of_order is not None:
            saved = (out_of_order["ranks"], out_of_order["batch_size"])
            if saved != (self.dp_size, self.batch_size):
                raise ValueError(
                    f"{type(self).__name__}: the checkpoint was saved while batches were trained out of order "
                    f"(in_order=False) on {saved[0]} data-parallel ranks with batch_size {saved[1]}; it resumes only "
                    f"so, not on {self.dp_size} ranks with batch_size {self.batch_size}"
                )
            self._resume_spans = list(out_of_order["spans"][self.dp_rank])
        self._saved_segments = [Segment(p, b, tuple(c)) for p, b, c in state_dict.get("segments", [])]
        if self._plan_streams:
            self._load_streams_state(state_dict.get("streams", {}))


def datamodule_states(path: str | Path) -> list[str]:
    """The names under which a checkpoint holds a DataModule state of this library (those with plan
    positions or a stream cursor); empty where it holds none or cannot be read here (a remote path)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # only a message's detail depends on it
        return []
    return sorted(
        key
        for key, value in checkpoint.items()
        if isinstance(value, dict) and ("positions_consumed" in value or "stream" in value)
    )


def table(header: list[str], rows: list[list[str]]) -> str:
    """Rows under a header, in columns, as Lightning's model summary prints them."""
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def planned_source(name: str, train: Source | Stream) -> PlannedSource:
    """A source as the plan sees it; a stream counts as endless (``STREAM_SAMPLES``), its identity its
    fingerprint."""
    if not isinstance(train, Stream):
        return PlannedSource(name, len(train), train.fingerprint, dict(getattr(train, "details", {})))
    identity = json.dumps(train.identity(), sort_keys=True, default=str).encode()
    fingerprint = hashlib.blake2b(identity, digest_size=16).hexdigest()
    details = {"stream": train.describe(), "seq_len": train.sample_tokens}
    return PlannedSource(name, STREAM_SAMPLES, fingerprint, details)


def held_by_role(parts: list[tuple[str, Any, Any]]) -> dict[str, list[tuple[str, Source]]]:
    """``build_sources``' held-out splits gathered by role: ``{"validation": [(name, samples), ...], ...}``."""
    held: dict[str, list[tuple[str, Source]]] = {}
    for name, _, splits in parts:
        if not isinstance(splits, dict):  # a bare validation source (or None), as sources once returned
            splits = {"validation": splits}
        for role, samples in splits.items():
            if samples is not None:
                held.setdefault(role, []).append((name, samples))
    return held
