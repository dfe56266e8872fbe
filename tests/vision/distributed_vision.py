"""What the vision DDP tests share: a ``train_record.py`` run over a folder, and every sample's digest."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.distributed_support import Run, train_record
from tests.support import row_digest


def train_vision(
    folder_flag: str, data: tuple[Path, str], root: Path, seq_len: int, batch: int, devices: int, **kw: object
) -> Run:
    """``train_record.py --<folder_flag> FOLDER`` on ``devices`` ranks (``ddp`` when more than one)."""
    folder, tokenizer = data
    args = [f"--{folder_flag}", str(folder), "--tokenizer", tokenizer, "--seq-len", str(seq_len)]
    args += ["--batch-size", str(batch), "--devices", str(devices), "--strategy", "ddp" if devices > 1 else "auto"]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return train_record(args, root)


def source_digests(source: Any, seq_len: int) -> tuple[Counter, Counter]:
    """Digests of every training and validation sample's tokens, as one process builds them."""
    out = [Counter(), Counter()]
    train, held = source.build(seq_len, False)
    for i, samples in enumerate((train, held.get("validation"))):
        if samples is not None:
            keys = np.zeros(len(samples), dtype=np.uint64)
            ids = torch.from_numpy(samples.fetch(np.arange(len(samples)), keys)["input_ids"].astype(np.int64))
            out[i] = Counter(row_digest(row) for row in ids)
    return out[0], out[1]
