"""``HiddenStateRows``: conversations and their verifier hidden states packed into rows of
``total_seq_len`` tokens, a plan source (the plan's samples are the packed rows).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch

from datamodules.plan.bad_samples import BadSample, BadSampleLog
from datamodules.speculative.hidden_states_store import HiddenStatesStore, check_states
from datamodules.speculative.multipack import OverLong, PackedRows

log = logging.getLogger(__name__)

MISSING_POLICIES = ("skip", "warn", "raise")
NOISES = ("uniform", "gaussian")
Batch = dict[str, torch.Tensor]


def column_lengths(dataset: Any, column: str) -> np.ndarray:
    """Lengths of a list column of a ``datasets.Dataset``, from Arrow's offsets (no row is read)."""
    return np.asarray(pc.list_value_length(dataset.data.column(column)), dtype=np.int64)


class HiddenStateRows:
    """Rows ``[first, stop)`` of a tokenized dataset, packed by multipack, with hidden states from ``store``.

    A row gives ``input_ids``, ``loss_mask``, ``position_ids`` (restarting in every conversation),
    ``document_ids`` (the conversation's place in the row, ``-1`` on padding): ``[B, total_seq_len]``;
    ``hidden_states`` (layers ``1..L-1`` side by side) ``[B, total_seq_len, (L-1) * H]`` and
    ``verifier_last_hidden_states`` (layer ``L``) ``[B, total_seq_len, H]``, cast to ``dtype`` as they
    are copied in. A conversation whose states are missing or do not match its tokens is never
    trained on: ``on_missing="raise"`` names it, ``"skip"`` counts it, ``"warn"`` also logs each;
    the rest of its row closes up, and no other row moves.

    Args:
        dataset: a ``datasets.Dataset`` with ``input_ids``, ``loss_mask`` and ``seq_len``.
        first, stop: the dataset rows of this split.
        store: where the hidden states are.
        total_seq_len: tokens per packed row.
        layers, hidden_size: ``L`` and ``H`` every state must have.
        dtype: the dtype of the hidden-state tensors.
        seed: the data-order seed (the packing of every pass follows it).
        over_long, length_quantum: see ``PackedRows``.
        on_missing: ``"raise"`` | ``"skip"`` | ``"warn"``.
        noise, noise_std: noise added to ``hidden_states`` (never to the verifier's last layer):
            ``"uniform"`` on ``(-noise_std, noise_std)``, or ``"gaussian"`` with standard deviation
            ``noise_std``; drawn from the row's plan key, so the same on every run and after resume.
        preprocess: called on every batch of rows before it leaves the loader (the EAGLE-3 shift).
    """

    uses_passes = True  # rows are packed afresh every pass over the data
    uses_sample_keys = True  # noise draws from the row's plan key
    batches_per_message = 1  # a row of hidden states is worth a message of its own between processes

    def __init__(
        self,
        dataset: Any,
        first: int,
        stop: int,
        store: HiddenStatesStore,
        *,
        total_seq_len: int,
        layers: int,
        hidden_size: int,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        over_long: OverLong = "truncate",
        length_quantum: int | None = None,
        on_missing: str = "raise",
        noise: str = "uniform",
        noise_std: float = 0.0,
        preprocess: Callable[[Batch], Batch] | None = None,
        name: str = "train",
    ) -> None:
        self.dataset = dataset.with_format("numpy", columns=["input_ids", "loss_mask"])
        self.first, self.stop = first, stop
        self.store = store
        self.total_seq_len = total_seq_len
        self.layers, self.hidden_size, self.dtype = layers, hidden_size, dtype
        self.on_missing, self.noise, self.noise_std = on_missing, noise, noise_std
        self.preprocess = preprocess
        self.name = name
        self._packing = {
            "total_seq_len": total_seq_len,
            "seed": seed,
            "over_long": over_long,
            "length_quantum": length_quantum,
        }
        self.packed: PackedRows | None = self._pack()
        if self.packed.truncated or self.packed.dropped:
            how = "truncated to" if self.packed.truncated else "left out, longer than"
            count = self.packed.truncated or self.packed.dropped
            log.warning("%s: %d of %d conversations %s total_seq_len=%d", name, count, stop - first, how, total_seq_len)
        self.num_rows = len(self.packed)
        identity = (dataset._fingerprint, first, stop, self.packed.fingerprint, layers, hidden_size, str(dtype))
        self.fingerprint = hashlib.blake2b(repr(identity).encode(), digest_size=16).hexdigest()
        self.details = {"rows": f"[{first}, {stop})", "total_seq_len": total_seq_len}
        self.bad_samples = BadSampleLog("hidden states of %s missing or invalid (%s): not trained on")

    def _pack(self) -> PackedRows:
        lengths = np.asarray(self.dataset.data.column("seq_len"), dtype=np.int64)[self.first : self.stop]
        return PackedRows(lengths, **self._packing)

    def __getstate__(self) -> dict[str, Any]:
        # Workers re-pack from the memory-mapped ``seq_len`` column instead of receiving every length.
        return {**self.__dict__, "packed": None}

    def __len__(self) -> int:
        return self.num_rows

    @classmethod
    def join(cls, parts: list[HiddenStateRows]) -> HiddenStateRows:
        raise ValueError("hidden-state rows are packed per source and cannot be mixed with other sources")

    def _conversation(self, row: int, skipped: list[tuple[str, str]]) -> tuple[dict[str, np.ndarray], Batch] | None:
        """Tokens and states of dataset row ``row``, or ``None`` (recorded in ``skipped``) when unusable."""
        tokens = self.dataset[row]
        try:
            states = self.store.lookup(row)
            reason = (
                "missing"
                if states is None
                else check_states(states, torch.from_numpy(tokens["input_ids"]).long(), self.layers, self.hidden_size)
            )
        except BadSample as err:
            reason = str(err)
        if reason is None:
            return tokens, states
        if self.on_missing == "raise":
            raise BadSample(
                f"hidden states of {self.store.describe(row)} (dataset row {row}): {reason} "
                "(on_missing='skip' leaves such conversations out and counts them)"
            )
        if self.on_missing == "warn":
            log.warning(
                "hidden states of %s (dataset row %d): %s; not trained on", self.store.describe(row), row, reason
            )
        skipped.append((self.store.describe(row), reason))
        return None

    def fetch(self, indices: np.ndarray, keys: np.ndarray, passes: np.ndarray) -> dict[str, Any]:
        if self.packed is None:
            self.packed = self._pack()
        rows, length = len(indices), self.total_seq_len
        batch = {
            "input_ids": torch.zeros(rows, length, dtype=torch.int64),
            "loss_mask": torch.zeros(rows, length, dtype=torch.int64),
            "position_ids": torch.zeros(rows, length, dtype=torch.int64),
            "document_ids": torch.full((rows, length), -1, dtype=torch.int64),
            "hidden_states": torch.zeros(rows, length, (self.layers - 1) * self.hidden_size, dtype=self.dtype),
            "verifier_last_hidden_states": torch.zeros(rows, length, self.hidden_size, dtype=self.dtype),
        }
        skipped: list[tuple[str, str]] = []
        for b, (row, pass_, key) in enumerate(zip(indices.tolist(), passes.tolist(), keys.tolist(), strict=True)):
            filled = document = 0
            for conversation in self.packed.row(pass_, row).tolist():
                found = self._conversation(self.first + conversation, skipped)
                if found is None:
                    continue
                tokens, states = found
                n = min(len(tokens["input_ids"]), length)
                at = slice(filled, filled + n)
                hidden = states["hidden_states"][:n]
                batch["input_ids"][b, at] = torch.from_numpy(tokens["input_ids"][:n])
                batch["loss_mask"][b, at] = torch.from_numpy(tokens["loss_mask"][:n])
                batch["position_ids"][b, at] = torch.arange(n)
                batch["document_ids"][b, at] = document
                batch["hidden_states"][b, at] = hidden[:, :-1].flatten(1)  # copy_ casts to dtype
                batch["verifier_last_hidden_states"][b, at] = hidden[:, -1]
                filled, document = filled + n, document + 1
            if self.noise_std > 0 and filled:
                self._add_noise(batch["hidden_states"][b, :filled], key)
        return {**batch, "skipped": skipped}

    def _add_noise(self, hidden: torch.Tensor, key: int) -> None:
        generator = torch.Generator().manual_seed(key & (2**63 - 1))
        if self.noise == "uniform":
            noise = torch.rand(hidden.shape, generator=generator).mul_(2).sub_(1).mul_(self.noise_std)
        else:
            noise = torch.randn(hidden.shape, generator=generator).mul_(self.noise_std)
        hidden.add_(noise.to(hidden.dtype))

    def to_batch(self, raw: dict[str, Any]) -> Batch:
        self.bad_samples.record(raw["skipped"])
        batch = {key: value for key, value in raw.items() if key not in ("skipped", "valid")}
        return self.preprocess(batch) if self.preprocess is not None else batch

    def mask_rows(self, batch: Batch, invalid: torch.Tensor) -> None:
        """Padding rows (a validation tail, a resume off the step grid) take no loss."""
        batch["loss_mask"][invalid] = 0
