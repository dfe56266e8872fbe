"""speculators' own loader over a folder of conversations and cached hidden states: conversations/s.

Run by ``benchmarks.hidden_states`` with the Python of ``benchmarks/.venvs/speculators`` (speculators pins
``datasets`` and ``transformers`` below ours); it imports speculators, torch and datasets only. It builds
what speculators' trainer builds (``ArrowDataset`` and ``_setup_dataloader``: multipack batches,
``CollateFn``, ``spawn`` workers) with ``on_missing="raise"`` and prints ``RESULT {"rate": ...}``: the
conversations per second after the first batch, for ``--seconds``.

    benchmarks/.venvs/speculators/bin/python benchmarks/peer_loaders/speculators_hidden_states.py \\
        --data DIR --total-seq-len 2048 --hidden-size 1024 --num-workers 2 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import datasets
import torch
from speculators.train.data import ArrowDataset
from speculators.train.dataloader import _setup_dataloader


def torch_formatted(data: Path, into: Path) -> Path:
    """The folder as speculators' ``prepare-data`` leaves it (torch format), beside the same states."""
    rows = datasets.load_from_disk(str(data))
    rows.set_format(type="torch")
    rows.save_to_disk(str(into))
    (into / "hidden_states").symlink_to(data / "hidden_states")
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--total-seq-len", type=int, required=True)
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        data = torch_formatted(args.data, Path(scratch) / "data")
        dataset = ArrowDataset(
            max_len=args.total_seq_len, datapath=str(data), on_missing="raise", hidden_states_dtype=torch.bfloat16
        )
        loader = _setup_dataloader(
            dataset, args.total_seq_len, args.hidden_size, num_workers=args.num_workers, prefetch_factor=4
        )
        batches = iter(loader)
        next(batches)
        conversations, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < args.seconds:
            try:
                # Counted as for ours: the documents of each row (speculators' document_ids are ours).
                conversations += int((next(batches)["document_ids"].amax(dim=1) + 1).sum())
            except StopIteration:
                batches = iter(loader)
        print("RESULT " + json.dumps({"rate": conversations / elapsed}), flush=True)
    # Not through the loader's shutdown: its spawned workers abort as they exit ("terminate called without
    # an active exception"), after the measurement, which has nothing to do with it.
    os._exit(0)


if __name__ == "__main__":
    main()
