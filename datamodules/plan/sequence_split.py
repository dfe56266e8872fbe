"""Context-parallel ranks: each rank of a group takes its share of every row of the group's batch.

Under context (or Ulysses sequence) parallelism the ranks of a group train on one batch, each on a
part of every row's tokens. ``SequenceSplit`` cuts a batch of rows of ``S`` tokens for rank ``r`` of
``C``:

- ``"head_tail"`` (ring attention under a causal mask): the row in ``2C`` equal chunks, rank ``r``
  taking chunks ``r`` and ``2C - 1 - r``, so every rank attends to as many earlier tokens as another
  (Megatron's context parallelism and torch's ``context_parallel`` head-tail balancer do the same);
  ``S`` must be a multiple of ``2C``.
- ``"contiguous"`` (Ulysses: an all-to-all gives each rank the whole sequence for some heads): the row
  in ``C`` equal chunks, rank ``r`` taking chunk ``r``, as speculators' ``split_batch_for_sp`` does;
  ``S`` must be a multiple of ``C``.

The per-token tensors (``SPLIT_KEYS``) are cut along the sequence; ``labels`` are already shifted
(the target of position ``t`` sits at ``t``), so a rank's labels are its own tokens' targets, never its
neighbour's. ``position_ids`` are added first where a batch has none (``0..S-1``), so a rank knows its
tokens' places. What describes the whole row stays whole on every rank: ``document_ids``,
``cu_seqlens``, ``num_sequences``, ``max_seqlen`` (a model masks attention over the gathered keys
with them). Two keys are added: ``sequence_index`` ``[S / C]`` int64, the row positions this rank holds
in order (the same for every row: a ring-attention model orders its causal mask by them, and
``torch.argsort`` of the ranks' indices put side by side restores the row), and ``full_seq_len``
(``S``, a 0-d tensor, as speculators adds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

LAYOUTS = ("head_tail", "contiguous")
SPLIT_KEYS = frozenset(
    {
        "input_ids",
        "labels",
        "position_ids",
        "loss_mask",
        "attention_mask",
        "hidden_states",
        "verifier_last_hidden_states",
    }
)


@dataclass(frozen=True)
class SequenceSplit:
    """Rank ``rank`` of ``size``'s share of each row, cut as ``layout`` says (see the module)."""

    rank: int
    size: int
    layout: str = "head_tail"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"sequence_split={self.layout!r}: one of {', '.join(map(repr, LAYOUTS))}")

    @property
    def chunks(self) -> int:
        """Equal chunks a row is cut into."""
        return 2 * self.size if self.layout == "head_tail" else self.size

    def check(self, length: int, option: str = "seq_len") -> None:
        """Refuses rows of ``length`` tokens that do not cut into equal chunks."""
        if length % self.chunks:
            raise ValueError(
                f"{option}={length} does not split among {self.size} context-parallel ranks with "
                f"sequence_split={self.layout!r}: that takes a multiple of {self.chunks}"
            )

    def indices(self, length: int) -> torch.Tensor:
        """The row positions this rank holds, in the order it holds them."""
        self.check(length)
        chunk = length // self.chunks
        first = torch.arange(self.rank * chunk, (self.rank + 1) * chunk)
        if self.layout == "contiguous":
            return first
        return torch.cat([first, torch.arange(length - (self.rank + 1) * chunk, length - self.rank * chunk)])

    def __call__(self, batch: Any) -> Any:
        if not isinstance(batch, dict) or "input_ids" not in batch:
            return batch  # a stop marker alone: nothing to split
        rows, length = batch["input_ids"].shape
        index = self.indices(length)
        out = dict(batch)
        if "position_ids" not in out:
            out["position_ids"] = torch.arange(length).expand(rows, length)
        for key in SPLIT_KEYS.intersection(out):
            tensor = out[key]
            # A block mask [B, 1, S, S] keeps every key: the rank's queries attend the gathered row.
            dim = 2 if key == "attention_mask" and tensor.dim() == 4 else 1
            out[key] = tensor.index_select(dim, index)
        out["sequence_index"] = index
        out["full_seq_len"] = torch.tensor(length)
        return out
