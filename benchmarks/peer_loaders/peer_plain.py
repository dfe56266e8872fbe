"""A plain ``torch.utils.data.DataLoader`` over a map-style ``np.memmap`` dataset: what one writes first.

The dataset cuts each shard into windows of ``seq_len + 1`` tokens (consecutive windows share one
token, as ours do) and returns one int64 tensor per window; ``shuffle=True`` with a seeded generator.
``DataLoader`` keeps no position, so resuming is hand-rolled the way ``accelerate``'s
``skip_first_batches`` does it: replay the sampler's indices (every epoch's permutation up to the
step) without reading their data. A mixture is not something it offers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from benchmarks.peer_loaders.protocol import Setup, Unsupported


def convert(corpus: Path, out: Path, seq_len: int) -> None:
    """Nothing to convert: the dataset reads the ``.npy`` shards."""


class MemmapWindows(Dataset):
    """Window ``i``: tokens ``[i * seq_len, i * seq_len + seq_len + 1)`` of the shards, in order."""

    def __init__(self, directory: Path, seq_len: int) -> None:
        self.paths = sorted(directory.glob("*.npy"))
        self.seq_len = seq_len
        counts = [(len(np.load(p, mmap_mode="r")) - 1) // seq_len for p in self.paths]
        self.first_window = np.concatenate([[0], np.cumsum(counts)])
        self.maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.first_window[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.maps is None:  # opened in the process that reads (a worker's own maps)
            self.maps = [np.load(p, mmap_mode="r") for p in self.paths]
        shard = int(np.searchsorted(self.first_window, index, side="right")) - 1
        start = (index - int(self.first_window[shard])) * self.seq_len
        return torch.from_numpy(self.maps[shard][start : start + self.seq_len + 1].astype(np.int64))


def windows(setup: Setup) -> MemmapWindows:
    if setup.mixture:
        raise Unsupported("DataLoader has no weighted mixture of datasets")
    return MemmapWindows(Path(setup.corpus) / "all", setup.seq_len)


class Contender:
    def __init__(self, setup: Setup, state: dict[str, int] | None) -> None:
        self.setup = setup
        self.dataset = windows(setup)
        # The sampler owns the generator, so only permutations consume it (not the loader's worker seeds).
        self.sampler = RandomSampler(self.dataset, generator=torch.Generator().manual_seed(setup.seed))
        self.loader = DataLoader(
            self.dataset,
            batch_size=setup.batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=setup.workers,
            persistent_workers=setup.workers > 0,
        )
        self.yielded = 0 if state is None else state["batches"]
        self._resume_loader = None if state is None else self._skip(state["batches"])

    def _skip(self, batches: int) -> DataLoader | None:
        """accelerate's ``skip_first_batches``: replay the sampler (whole epochs, then the first batches
        of this one) without reading data; a loader over the rest of this epoch's batches."""
        per_epoch = len(self.loader)
        for _ in range(batches // per_epoch):
            for _ in self.sampler:
                pass
        rest = list(itertools.islice(self.loader.batch_sampler, batches % per_epoch, None))
        return DataLoader(self.dataset, batch_sampler=rest, num_workers=self.setup.workers)

    def batches(self) -> Iterator[torch.Tensor]:
        if self._resume_loader is not None:
            loader, self._resume_loader = self._resume_loader, None
            for batch in loader:
                self.yielded += 1
                yield batch
        while True:
            for batch in self.loader:
                self.yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        """What a hand-rolled checkpoint keeps: the batches consumed."""
        return {"batches": self.yielded}

    def close(self) -> None:
        self.loader = self._resume_loader = None


def state_at(setup: Setup, step: int) -> tuple[dict[str, int], str]:
    per_epoch = len(windows(setup)) // setup.batch_size
    return (
        {"batches": step},
        f"the sampler's {step * setup.batch_size:,} indices ({step // per_epoch} epochs of permutations), no data",
    )
