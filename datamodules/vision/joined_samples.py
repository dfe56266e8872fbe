"""``JoinedSamples``: vision sources read as one, for mixtures."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from datamodules.plan.bad_samples import BadSampleLog


class JoinedSamples:
    """Several vision sources of one kind one after another (how a mixture reads a batch from all of
    them); each sample is read, and replaced or masked if bad, within its own source. The parts must
    agree on ``shape_key`` (what their arrays' shapes and normalization depend on)."""

    batches_per_message = 1
    uses_sample_keys = True

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

    def __len__(self) -> int:
        return int(self._ends[-1])

    def fetch(self, indices: np.ndarray, keys: np.ndarray) -> dict[str, Any]:
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self._ends, indices, side="right")
        starts = np.concatenate([[0], self._ends[:-1]])
        order, pieces = [], []
        for part in np.unique(which).tolist():
            at = np.flatnonzero(which == part)
            raw = self.parts[part].fetch(indices[at] - starts[part], keys[at])
            if "error" in raw:
                return raw
            order.append(at)
            pieces.append(raw)
        inverse = np.argsort(np.concatenate(order), kind="stable")
        joined = {key: np.concatenate([p[key] for p in pieces])[inverse] for key in pieces[0] if key != "skipped"}
        return {**joined, "skipped": [entry for p in pieces for entry in p["skipped"]]}

    def to_batch(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        batch = self.parts[0].to_batch({**raw, "skipped": []})
        self.bad_samples.record(raw["skipped"])
        return batch

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.parts[0].on_device(batch)  # the parts normalize alike (``shape_key``)
