"""torchdata's ``StatefulDataLoader`` over the same map-style ``np.memmap`` dataset as the plain loader.

It is ``DataLoader`` with ``state_dict``/``load_state_dict``: its sampler restores the permutation's
generator and skips the indices already yielded in the epoch (no data read). It has no weighted
mixture of datasets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from benchmarks.peer_loaders.peer_plain import windows
from benchmarks.peer_loaders.protocol import LoaderContender, Setup


def convert(corpus: Path, out: Path, seq_len: int) -> None:
    """Nothing to convert: the dataset reads the ``.npy`` shards."""


class Contender(LoaderContender):
    def __init__(self, setup: Setup, state: dict[str, Any] | None) -> None:
        self.loader = StatefulDataLoader(
            windows(setup),
            batch_size=setup.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(setup.seed),
            num_workers=setup.workers,
            persistent_workers=setup.workers > 0,
        )
        if state is not None:
            self.loader.load_state_dict(state)


def state_at(setup: Setup, step: int) -> tuple[dict[str, Any], str]:
    """The loader's own state after ``step`` batches, reached by driving the same loader over a dataset
    that reads nothing, so only the sampler runs (its state does not depend on what the dataset reads)."""

    class Indices(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, index: int) -> int:
            return index

    loader = StatefulDataLoader(
        Indices(len(windows(setup))),
        batch_size=setup.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(setup.seed),
    )
    remaining = step
    while remaining:
        for _ in zip(range(remaining), loader, strict=False):
            remaining -= 1
    per_epoch = len(loader)
    return loader.state_dict(), (
        f"the sampler's indices in the current epoch (up to {per_epoch * setup.batch_size:,}); "
        "restores the generator, no data"
    )
