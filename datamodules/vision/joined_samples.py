"""``JoinedSamples``: vision sources read as one, for mixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from datamodules.plan.bad_samples import BadSampleLog
from datamodules.plan.multipack import row_layout
from datamodules.storage.file_cache import CacheStats
from datamodules.storage.planned_reads import CACHE_COUNTS


class JoinedSamples:
    """Several vision sources of one kind one after another (how a mixture reads a batch from all of
    them); each sample is read, and replaced or masked if bad, within its own source. The parts must
    agree on ``shape_key`` (what their arrays' shapes and normalization depend on)."""

    batches_per_message = 1
    uses_sample_keys = True
    uses_positions = True

    def __init__(self, parts: list[Any]) -> None:
        keys = {p.shape_key for p in parts}
        if len(keys) != 1:
            raise ValueError(
                "mixed vision sources need one max_text_len, image-token count, pixel (and frame) shape and pixel "
                f"normalization (mean/std, or processor); got {sorted(map(str, keys))}"
            )
        self.parts = parts
        self._ends = np.cumsum([len(p) for p in parts])
        self.fingerprint = "+".join(p.fingerprint for p in parts)
        self.bad_samples = BadSampleLog()
        self.file_cache = CacheStats()

    def __len__(self) -> int:
        return int(self._ends[-1])

    def spawn_reasons(self) -> list[str]:
        """Why forking workers would be unsafe for any of the parts (a video source that decoded here)."""
        return sorted({reason for part in self.parts for reason in getattr(part, "spawn_reasons", list)()})

    @property
    def instead_of_fork(self) -> str:
        """How workers start where a part gives a reason not to fork: a forkserver if a part asks for one."""
        asked = {getattr(part, "instead_of_fork", "spawn") for part in self.parts}
        return "forkserver" if "forkserver" in asked else "spawn"

    def _by_part(self, indices: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(part, where in indices, indices within the part)`` for each part the indices fall in."""
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self._ends, indices, side="right")
        starts = np.concatenate([[0], self._ends[:-1]])
        for part in np.unique(which).tolist():
            at = np.flatnonzero(which == part)
            yield part, at, indices[at] - starts[part]

    @property
    def plans_file_reads(self) -> bool:
        return any(getattr(part, "plans_file_reads", False) for part in self.parts)

    @property
    def planned_uses(self) -> Any:
        return self.parts[0].planned_uses

    @planned_uses.setter
    def planned_uses(self, uses: Any) -> None:  # the joined order's: the parts read in it
        for part in self.parts:
            if getattr(part, "plans_file_reads", False):
                part.planned_uses = uses

    @property
    def file_cache_summary(self) -> str | None:
        lines = {getattr(part, "file_cache_summary", None) for part in self.parts} - {None}
        return "\n".join(sorted(lines)) or None

    def file_keys(self, indices: np.ndarray, passes: np.ndarray | None = None) -> np.ndarray:
        keys = np.zeros(len(indices), dtype=np.uint64)
        for part, at, within in self._by_part(indices):
            if getattr(self.parts[part], "plans_file_reads", False):
                keys[at] = self.parts[part].file_keys(within)
        return keys

    def fetch(self, indices: np.ndarray, keys: np.ndarray, positions: np.ndarray | None = None) -> dict[str, Any]:
        order, pieces = [], []
        for part, at, within in self._by_part(indices):
            takes_positions = positions is not None and getattr(self.parts[part], "uses_positions", False)
            extra = {"positions": positions[at]} if takes_positions else {}
            raw = self.parts[part].fetch(within, keys[at], **extra)
            if "error" in raw:
                return raw
            order.append(at)
            pieces.append(raw)
        counts = [p.pop(CACHE_COUNTS) for p in pieces if CACHE_COUNTS in p]
        inverse = np.argsort(np.concatenate(order), kind="stable")
        joined = {key: np.concatenate([p[key] for p in pieces])[inverse] for key in pieces[0] if key != "skipped"}
        if counts:
            joined[CACHE_COUNTS] = np.sum(counts, axis=0)
        return {**joined, "skipped": [entry for p in pieces for entry in p["skipped"]]}

    def to_batch(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        raw = dict(raw)
        if CACHE_COUNTS in raw:
            self.file_cache.add(raw.pop(CACHE_COUNTS))
        batch = self.parts[0].to_batch({**raw, "skipped": []})
        self.bad_samples.record(raw["skipped"])
        return batch

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.parts[0].on_device(batch)  # the parts normalize alike (``shape_key``)


class JoinedDocuments(JoinedSamples):
    """Interleaved documents and conversations with images of several sources, one after another (a
    mixture's): all packed (``InterleavedRows``) or all one a row. A batch is read in runs of
    consecutive samples of one source, in order, and the runs' rows and images put one after another,
    so each row keeps its images (however many, of whatever size); packed rows' offsets are laid out
    again for the whole batch."""

    def __init__(self, parts: list[Any]) -> None:
        kinds = {type(p).__name__ for p in parts}
        if len(kinds) != 1:
            raise ValueError(
                "mixed interleaved sources are either all packed (pack_sequences=True) or all one document a "
                f"row; got {sorted(kinds)}"
            )
        super().__init__(parts)
        self.uses_passes = getattr(parts[0], "uses_passes", False)  # packed rows: packed afresh every pass
        self.most_per_row = max(getattr(p, "most_per_row", 0) for p in parts)

    def _runs(self, indices: np.ndarray) -> Iterator[tuple[int, slice, np.ndarray]]:
        """``(part, span of indices, indices within the part)`` of each run of one part, in order."""
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self._ends, indices, side="right")
        starts = np.concatenate([[0], self._ends[:-1]])
        cuts = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), len(indices)]
        for first, stop in zip(cuts[:-1], cuts[1:], strict=True):
            part = int(which[first])
            yield part, slice(first, stop), indices[first:stop] - starts[part]

    def file_keys(self, indices: np.ndarray, passes: np.ndarray | None = None) -> np.ndarray:
        found = []
        for part, span, within in self._runs(indices):
            if getattr(self.parts[part], "plans_file_reads", False):
                keys = self.parts[part].file_keys(within, None if passes is None else passes[span])
                found.append((span, keys.reshape(len(within), -1)))
        keys = np.zeros((len(indices), max((k.shape[1] for _, k in found), default=1)), dtype=np.uint64)
        for span, part_keys in found:
            keys[span, : part_keys.shape[1]] = part_keys
        return keys

    def fetch(
        self,
        indices: np.ndarray,
        keys: np.ndarray,
        passes: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> dict[str, Any]:
        pieces = []
        for part, span, within in self._runs(indices):
            extra: dict[str, np.ndarray] = {} if passes is None or not self.uses_passes else {"passes": passes[span]}
            if positions is not None and getattr(self.parts[part], "uses_positions", False):
                extra["positions"] = positions[span]
            raw = self.parts[part].fetch(within, keys[span], **extra)
            if "error" in raw:
                return raw
            pieces.append(raw)
        counts = [p.pop(CACHE_COUNTS) for p in pieces if CACHE_COUNTS in p]
        laid_out = ("skipped", "cu_seqlens", "num_sequences", "max_seqlen")
        joined = {key: np.concatenate([p[key] for p in pieces]) for key in pieces[0] if key not in laid_out}
        if self.uses_passes:  # the offsets of the whole batch's documents
            lengths = [np.bincount(row[row >= 0]).tolist() for row in joined["document_ids"]]
            joined.update(row_layout(lengths, joined["input_ids"].shape[1], self.most_per_row))
        if counts:
            joined[CACHE_COUNTS] = np.sum(counts, axis=0)
        return {**joined, "skipped": [entry for p in pieces for entry in p["skipped"]]}
