"""The dataset and DataLoader every plan-driven source shares.

Workers (or the main process) turn a span of plan positions into a compact raw batch; the main
process turns it into tensors, so worker processes never pay per-tensor IPC.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.sample_plan import SamplePlan
from datamodules.token_windows import IGNORE_INDEX

_CHUNK = 4096


class Source(Protocol):
    """What a map-style source gives the plan: a length, batched raw reads, and tensor assembly."""

    fingerprint: str

    def __len__(self) -> int: ...

    def fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]: ...

    def to_batch(self, raw: dict[str, np.ndarray]) -> dict[str, torch.Tensor]: ...


class PlanDataset(Dataset):
    """Reads the samples at a span of plan positions from ``source``.

    Args:
        source: the samples.
        plan: maps positions to sample indices.
        limit: positions at or past ``limit`` are padding (rows with no loss) rather than samples;
            ``None`` reads an endless stream of passes.
    """

    def __init__(self, source: Source, plan: SamplePlan, limit: int | None = None) -> None:
        self.source = source
        self.plan = plan
        self.limit = limit
        self._chunk = (0, np.empty(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.source)

    def _indices(self, first: int, stop: int) -> np.ndarray:
        # The plan is evaluated a chunk of positions at a time: its per-call overhead then vanishes.
        chunk_first, indices = self._chunk
        if not chunk_first <= first <= stop <= chunk_first + len(indices):
            _, indices = self.plan.locate(np.arange(first, first + max(_CHUNK, stop - first)))
            self._chunk = chunk_first, indices = first, indices
        return indices[first - chunk_first : stop - chunk_first]

    def __getitem__(self, span: tuple[int, int]) -> dict[str, np.ndarray]:
        first, stop = span
        if self.limit is None:
            return self.source.fetch(self._indices(first, stop))
        valid = np.arange(first, stop) < self.limit
        indices = np.zeros(stop - first, dtype=np.int64)
        real = int(valid.sum())
        indices[:real] = self._indices(first, first + real)
        return {**self.source.fetch(indices), "valid": valid}


def _keep(raw: Any) -> Any:
    return raw


class PlanDataLoader(DataLoader):
    """A ``DataLoader`` over a ``PlanDataset`` and ``PlanSampler`` that yields tensor batches."""

    def __init__(self, dataset: PlanDataset, sampler: torch.utils.data.Sampler, num_workers: int = 0) -> None:
        super().__init__(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=_keep,
            persistent_workers=num_workers > 0,
        )

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        to_batch = self.dataset.source.to_batch
        for raw in super().__iter__():
            batch = to_batch(raw)
            if "valid" in raw:
                batch["labels"][torch.from_numpy(~raw["valid"])] = IGNORE_INDEX
            yield batch

    # Resume state lives in the DataModule (positions consumed, derived from the training loop).
    # These two methods only tell Lightning that this loader resumes exactly, so it does not warn.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
