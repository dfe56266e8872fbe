"""``MixtureDataModule``: named sources mixed by weight, exactly per global batch and over the run.

Each global batch (one optimizer step) holds every source's floor or ceiling of its share of the
weights active at that step, chosen so that its count over the run tracks its weight within a few
samples (``datamodules.plan.sample_plan``); the ``PhaseScheduler`` callback installs weight changes
at exact steps.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from datamodules.plan.arguments import require_int
from datamodules.plan.datamodule import PlanDataModule
from datamodules.plan.loader import Source, SourceSpec, same_tokenizer
from datamodules.plan.sample_plan import MIXING_RULE, SamplePlan, Segment
from datamodules.plan.stream import Stream

log = logging.getLogger(__name__)


@dataclass
class MixtureComponent:
    """One named source of a mixture and its base weight.

    Args:
        name: unique name, used by phase weights and in logged metrics.
        weight: base sampling weight, finite and >= 0 (0: never sampled).
        source: the source spec, e.g. ``TokenShardSource(data_dir=...)``.
    """

    name: str
    weight: float
    source: SourceSpec

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"weight of source {self.name!r} must be finite and >= 0, got {self.weight!r}")


@dataclass
class WeightedSource:
    """A mixture source in the mapping form, ``{name: {weight, source}}``, as YAML configs write it:
    ``--data.init_args.sources.<name>.source.init_args.data_dir=...`` then overrides one path.

    Args:
        weight: base sampling weight, finite and >= 0.
        source: the source spec.
    """

    weight: float
    source: SourceSpec


def mixture_probabilities(weights: list[float], temperature: float) -> tuple[float, ...]:
    """``p_i ∝ w_i ** (1 / T)``; a zero weight stays exactly zero at every temperature."""
    scaled = np.asarray(weights, dtype=np.float64) ** (1.0 / temperature)
    return tuple(float(p) for p in scaled / scaled.sum())


class MixtureDataModule(PlanDataModule):
    """Mixes named sources by weight into every global batch, exactly.

    Every global batch (``batch_size x data-parallel size x accumulate_grad_batches`` samples, one
    optimizer step) holds ``floor(p_i G)`` or ``ceil(p_i G)`` samples of source ``i``, for
    ``p_i ∝ w_i ** (1/T)`` of the weights active at that step, in shuffled order; which sources get
    the ceiling varies from batch to batch so that each source's count over the run stays within a
    few samples of ``p_i`` times the samples drawn, however small ``p_i`` (a weight of 0 is never
    drawn). A source that runs out starts a new, freshly shuffled
    pass. Weights change at exact steps through the ``PhaseScheduler`` callback; resume is exact
    across a change, and elastic (a new data-parallel size continues at the saved position).

    A streamed source (``HFTextSource(..., streaming=True)``) is read in order by readers of its own
    (a reader per rank and DataLoader worker): the plan's positions of it take each rank's next windows
    of the stream, so its counts per batch and its share are the plan's like any source's. Its state
    (readers, and the windows read but not yet trained) is in the checkpoint: a resume is exact on
    the same ranks and workers, and on others every window and document is still trained once. It
    mixes with sources of token windows, and needs at least one that is not a stream; the epoch is
    the other sources' windows, the stream counting for none.

    Args:
        sources: the components: a mapping ``{name: {weight, source}}`` (the YAML form, whose
            entries the command line can override by name), or a list of ``MixtureComponent``.
        seq_len: tokens per sequence. batch_size: sequences per rank per micro-batch.
        temperature: ``T > 0``; 1 samples in proportion to the weights, larger flattens the mix.
        pack_sequences: document-aware batches (see ``TokenShardDataModule``).
        allow_mixed_tokenizers: mix sources whose metadata names different tokenizers or EOS
            ids; by default that is refused, since the same id would mean different tokens.
        seed, num_workers, allow_plan_change, pin_memory, prefetch_factor, broadcast_within,
            split_sequence_for, sequence_split: see
            ``PlanDataModule``.

    Example::

        MixtureDataModule(
            sources=[MixtureComponent("web", 0.7, TokenShardSource("web/")),
                     MixtureComponent("code", 0.3, TokenShardSource("code/"))],
            seq_len=2048, batch_size=8)
    """

    def __init__(
        self,
        sources: dict[str, WeightedSource] | list[MixtureComponent],
        seq_len: int,
        batch_size: int,
        temperature: float = 1.0,
        pack_sequences: bool = False,
        allow_mixed_tokenizers: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        broadcast_within: str | list[str] | None = None,
        split_sequence_for: str | list[str] | None = None,
        sequence_split: str = "head_tail",
    ) -> None:
        super().__init__(
            batch_size,
            seed=seed,
            num_workers=num_workers,
            allow_plan_change=allow_plan_change,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            broadcast_within=broadcast_within,
            split_sequence_for=split_sequence_for,
            sequence_split=sequence_split,
        )
        require_int("seq_len", seq_len, 1)
        if not sources:
            raise ValueError("a mixture needs at least one source")
        if isinstance(sources, dict):
            sources = [
                MixtureComponent(
                    name, *((c.weight, c.source) if isinstance(c, WeightedSource) else (c["weight"], c["source"]))
                )
                for name, c in sources.items()
            ]
        components = [c if isinstance(c, MixtureComponent) else MixtureComponent(**c) for c in sources]
        names = [c.name for c in components]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"source names must be unique, {duplicates} appear more than once")
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        self.components = components
        self.seq_len = seq_len
        self.temperature = temperature
        self.pack_sequences = pack_sequences
        self.allow_mixed_tokenizers = allow_mixed_tokenizers
        self.base_weights = [float(c.weight) for c in components]
        self._check_weights(self.base_weights, "base weights")
        self.phase_weights: list[tuple[int, list[float]]] = [(0, self.base_weights)]
        # Sources as plain values (no credentials, no objects): checkpoints load with weights_only.
        self.save_hyperparameters(ignore=["sources"])
        self.hparams["sources"] = {
            c.name: {"weight": c.weight, "source": c.source.hyperparameters()} for c in components
        }

    def _check_weights(self, weights: list[float], what: str) -> None:
        if not sum(weights) > 0:
            named = dict(zip([c.name for c in self.components], weights, strict=True))
            raise ValueError(f"{what} {named} are all zero: at least one source needs a positive weight")

    def set_phases(self, phases: list[dict[str, Any]]) -> None:
        super().set_phases(phases)
        self.set_phase_weights([(p["start_step"], p["dataset_weights"]) for p in phases])

    def set_phase_weights(self, phases: list[tuple[int, dict[str, float]]]) -> None:
        """Weights from each phase's ``start_step``: named sources change, the rest keep the base weight."""
        names = [c.name for c in self.components]
        schedule = []
        for start_step, weights in phases:
            unknown = sorted(set(weights) - set(names))
            if unknown:
                raise ValueError(f"phase at step {start_step} names unknown sources {unknown}; sources are {names}")
            full = [float(weights.get(n, base)) for n, base in zip(names, self.base_weights, strict=True)]
            self._check_weights(full, f"phase at step {start_step}: weights")
            schedule.append((start_step, full))
        self.phase_weights = schedule
        if self.sources is not None:
            self.check_global_batch()

    def sequence_length(self) -> int:
        return self.seq_len

    def source_specs(self) -> list[SourceSpec]:
        return [c.source for c in self.components]

    test_options = "give one of its sources a test split (test_fraction, test_split, test_dir or test_manifest)"

    def build_sources(self) -> list[tuple[str, Source | Stream, dict[str, Source]]]:
        built = []
        for c in self.components:
            streamed = c.source.build_stream(self.seq_len, self.batch_size, self.pack_sequences, self.seed, self.job)
            built.append((c.name, *(streamed or c.source.build(self.seq_len, self.pack_sequences, self.job))))
        known = [(name, train.vocabulary) for name, train, _ in built if getattr(train, "vocabulary", None)]
        for name, vocabulary in known[1:]:
            first, first_vocabulary = known[0]
            if not same_tokenizer(vocabulary, first_vocabulary) and not self.allow_mixed_tokenizers:
                raise ValueError(
                    f"sources {first!r} and {name!r} were tokenized differently: {first_vocabulary} vs {vocabulary}; "
                    "the same id would mean different tokens. Pass allow_mixed_tokenizers=True if that is intended"
                )
        return built

    def samples_per_step(self) -> list[dict[str, int]]:
        names = [c.name for c in self.components]
        steps = sorted({step for step, _ in self.phase_weights})
        most = [Segment(0, self.global_batch_size, self.probabilities_at(step)).most_per_block for step in steps]
        return [dict(zip(names, counts, strict=True)) for counts in most]

    def plan_identity(self) -> dict[str, Any]:
        identity = {**super().plan_identity(), "base_weights": self.base_weights, "temperature": self.temperature}
        return {**identity, "mixing": MIXING_RULE}

    def weights_at(self, step: int) -> list[float]:
        """The weights active at optimizer step ``step``."""
        return max((p for p in self.phase_weights if p[0] <= step), key=lambda p: p[0])[1]

    def probabilities_at(self, step: int) -> tuple[float, ...]:
        """The sampling probabilities at optimizer step ``step`` (the weights after temperature)."""
        return mixture_probabilities(self.weights_at(step), self.temperature)

    def build_plan(self, position: int, step: int) -> SamplePlan:
        block = self.global_batch_size
        # The schedule already trained is kept verbatim (it may have had another block size); from
        # the resume position on, phases map to positions with this run's global batch size.
        segments = [s for s in self._saved_segments if s.first_position < position]
        probabilities = self.probabilities_at(step)
        if not segments:
            segments = [Segment(0, block, probabilities)]
        elif (segments[-1].block_size, segments[-1].probabilities) != (block, probabilities):
            if (position - segments[-1].first_position) % segments[-1].block_size:
                raise ValueError(
                    f"cannot resume a mixture at position {position}: it is not on an optimizer-step boundary "
                    f"of the checkpoint's global batch of {segments[-1].block_size}"
                )
            segments.append(Segment(position, block, probabilities))
        for start_step, _ in self.phase_weights:
            if start_step > step:
                segments.append(
                    Segment(position + (start_step - step) * block, block, self.probabilities_at(start_step))
                )
        plan = SamplePlan(tuple(self.sources), seed=self.seed, segments=tuple(segments))
        # A reloaded train loader (reload_dataloaders_every_n_epochs) rebuilds the plan mid-run: the
        # segments trained by then, this plan's, are its history; a checkpoint loaded later replaces them.
        self._saved_segments = list(plan.segments)
        return plan

    def step_metrics(self) -> dict[str, float]:
        """Each source's weight and what it has given, besides what every plan logs."""
        metrics = super().step_metrics()
        step = self.trainer.global_step
        counts = self.realized_counts(self.positions_consumed + self.global_batch_size)
        for (name, drawn), weight in zip(counts.items(), self.weights_at(step), strict=True):
            metrics[f"mixture/{name}/weight"] = weight
            metrics.update({f"mixture/{name}/{key}": float(value) for key, value in drawn.items()})
        return metrics

    def source_weights(self) -> list[float]:
        return list(self.probabilities_at(getattr(self.trainer, "global_step", 0)))

    def realized_counts(self, position: int | None = None) -> dict[str, dict[str, float]]:
        """Samples, tokens and passes done (samples over the source's size: 0.5 is half a pass) of every
        source in positions ``[0, position)`` (default: the positions trained so far)."""
        if self.plan is None:
            return {}
        drawn = self.plan.samples_drawn(self.positions_consumed if position is None else position)
        counts = {}
        for s, d in zip(self.sources, drawn, strict=True):
            counts[s.name] = {"samples": int(d), "tokens": int(d) * self.seq_len}
            if "stream" not in s.details:  # a stream's passes are not known ahead
                counts[s.name]["passes"] = int(d) / s.num_samples
        return counts
