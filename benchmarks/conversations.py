"""Chat fine-tuning rows: how full ``ConversationDataModule`` packs them, against TRL's ``pack_dataset``
(strategy ``"bfd"``) on the same conversations, and how fast its loader hands them over, against a plain
``DataLoader`` over TRL's packed dataset.

Conversations: lognormal token counts (mean 600, sigma 0.8, cut at the row), random ids, a third of each
prompt (no loss), saved as a prepared folder (``input_ids``, ``loss_mask``, ``seq_len``), so no
tokenizer runs. Rows of 4,096 tokens. Token efficiency: tokens in rows over rows x 4,096, for one pass.
Rows/s: one row a batch, ours with every field of its batch (labels, positions, ``cu_seqlens``) against
TRL's packed rows through a ``DataLoader`` whose collate pads a row to 4,096 and builds its positions
from TRL's ``seq_lengths`` (the least a padding-free trainer needs), at ``num_workers`` 0 and 2,
alternating rounds, medians. TRL (``pip install -e '.[bench]'``) is skipped when not installed.
``python -m benchmarks.conversations [--quick]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks.common import add_run_arguments, data_directory, report, results_directory
from datamodules import ConversationDataModule

ROW = 4096


def conversations(directory: Path, count: int, mean: float = 600.0, sigma: float = 0.8, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, count), 8, ROW).astype(int)
    ids = [rng.integers(5, 32_000, n).tolist() for n in lengths]
    masks = [[0] * (n // 3) + [1] * (n - n // 3) for n in lengths]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": lengths.tolist()}).save_to_disk(
        str(directory)
    )
    return directory


def trl_packed(data: Path) -> Any:
    from trl import pack_dataset

    return pack_dataset(datasets.load_from_disk(str(data)).select_columns(["input_ids"]), ROW, strategy="bfd")


def trl_collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One TRL row padded to ``ROW`` tokens, with positions restarting per sequence (from ``seq_lengths``)."""
    ids = torch.zeros(len(rows), ROW, dtype=torch.int64)
    positions = torch.zeros(len(rows), ROW, dtype=torch.int64)
    for b, row in enumerate(rows):
        ids[b, : len(row["input_ids"])] = torch.as_tensor(row["input_ids"])
        positions[b, : len(row["input_ids"])] = torch.cat([torch.arange(n) for n in row["seq_lengths"]])
    return {"input_ids": ids, "position_ids": positions}


def rows_per_second(loader: Iterable, seconds: float) -> float:
    batches = iter(loader)
    next(batches)  # start-up excluded
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        try:
            count += len(next(batches)["input_ids"])
        except StopIteration:
            batches = iter(loader)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_run_arguments(parser)
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    count, seconds, rounds = (2_000, 0.5, 1) if args.quick else (args.conversations, args.seconds, args.rounds)
    has_trl = importlib.util.find_spec("trl") is not None
    with data_directory(args.data_dir) as directory:
        data = conversations(directory / "conversations", count)
        tokens = int(np.sum(datasets.load_from_disk(str(data))["seq_len"]))

        def ours(workers: int) -> ConversationDataModule:
            dm = ConversationDataModule(str(data), total_seq_len=ROW, num_workers=workers)
            dm.setup("fit")
            return dm

        packing = ours(0).packing()
        efficiency = [{"packer": "ours (multipack, a whole pass)", **packing}]
        loaders = {f"ours, num_workers={w}": (lambda w=w: ours(w).train_dataloader()) for w in (0, 2)}
        if has_trl:
            start = time.perf_counter()
            packed = trl_packed(data)
            trl_seconds = time.perf_counter() - start
            trl_tokens = int(sum(map(len, packed["input_ids"])))
            efficiency.append(
                {
                    "packer": "TRL pack_dataset(strategy='bfd')",
                    "rows": len(packed),
                    "conversations": count,
                    "token_efficiency": trl_tokens / (len(packed) * ROW),
                    "seconds": trl_seconds,
                }
            )
            for w in (0, 2):
                loaders[f"plain DataLoader over TRL's rows, num_workers={w}"] = lambda w=w: DataLoader(
                    packed, batch_size=1, shuffle=True, num_workers=w, collate_fn=trl_collate, persistent_workers=w > 0
                )
        speeds: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(rounds):
            for name, make in loaders.items():
                speeds[name].append(rows_per_second(make(), seconds))
    speed_rows = [{"loader": name, "rows/s": statistics.median(values)} for name, values in speeds.items()]
    if has_trl:
        for w in (0, 2):
            ours_rate = statistics.median(speeds[f"ours, num_workers={w}"])
            trl_rate = statistics.median(speeds[f"plain DataLoader over TRL's rows, num_workers={w}"])
            speed_rows.append({"loader": f"ours / plain TRL loader, num_workers={w}", "rows/s": ours_rate / trl_rate})
    checks = {"ours: token efficiency >= 0.99 of row capacity": packing["token_efficiency"] >= 0.99}
    if has_trl:
        trl_efficiency = efficiency[1]["token_efficiency"]
        checks["ours packs at least as full as TRL's bfd"] = packing["token_efficiency"] >= trl_efficiency
    config = {"conversations": count, "tokens": tokens, "row": ROW, "rounds": rounds, "trl": has_trl}
    tables = {
        "packing one pass": (["packer", "rows", "conversations", "token_efficiency", "seconds"], efficiency),
        "loader rows/s (medians)": (["loader", "rows/s"], speed_rows),
    }
    report("conversations", tables, config, checks, results_directory(args.results_dir, args.quick))


if __name__ == "__main__":
    main()
