"""``ConversationRows``: tokenized conversations packed by multipack into rows of ``total_seq_len``
tokens, a plan source (the plan's samples are the packed rows), with next-token labels on assistant
tokens and the per-conversation positions, offsets and masks that keep packed conversations apart.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch

from datamodules.plan.loader import IGNORE_INDEX
from datamodules.plan.multipack import NODE_KIND, OverLong, PackedRows, narrow_indices, row_layout
from datamodules.storage.node_arrays import is_mapped, node_arrays

log = logging.getLogger(__name__)

ATTENTION_MASKS = ("none", "block")
COLUMNS = ("input_ids", "loss_mask", "seq_len")  # what prepare_conversations (and speculators) write
Batch = dict[str, Any]


def column_lengths(dataset: Any, column: str) -> np.ndarray:
    """Lengths of a list column of a ``datasets.Dataset``, from Arrow's offsets (no row is read)."""
    return np.asarray(pc.list_value_length(dataset.data.column(column)), dtype=np.int64)


def checked_rows(dataset: Any, where: str) -> Any:
    """``dataset`` if it holds ``COLUMNS`` and every row's ``input_ids`` and ``loss_mask`` are as long as
    its ``seq_len`` (which the packing reads); else an error naming the first row that is not."""
    missing = [c for c in COLUMNS if c not in dataset.column_names]
    if missing:
        raise ValueError(f"{where} has no column {missing}; it has {dataset.column_names}, needs {COLUMNS}")
    seq_len = column_values(dataset, "seq_len")
    for column in ("input_ids", "loss_mask"):
        lengths = column_lengths(dataset, column)
        wrong = np.flatnonzero(lengths != seq_len)
        if len(wrong):
            raise ValueError(
                f"{where}: row {int(wrong[0])} has seq_len {int(seq_len[wrong[0]])} but "
                f"{int(lengths[wrong[0]])} {column} ({len(wrong)} such rows)"
            )
    return dataset


def column_values(dataset: Any, column: str) -> np.ndarray:
    """A numeric column of a ``datasets.Dataset`` as int64."""
    return np.asarray(dataset.data.column(column), dtype=np.int64)


class ConversationRows:
    """The conversations at dataset rows ``rows``, packed by multipack (``PackedRows``: best-fit
    decreasing, afresh every pass) into rows of ``total_seq_len`` tokens.

    A batch of ``B`` rows of ``T = total_seq_len`` tokens holds:

    - ``input_ids`` ``[B, T]``: the conversations one after another, then padding (id 0);
    - ``labels`` ``[B, T]``: at position ``t``, the token at ``t + 1`` when it belongs to the same
      conversation and is an assistant token (``loss_mask`` 1; any token with ``train_on_prompt``),
      else ``-100``: already shifted, never across a conversation's end;
    - ``position_ids`` ``[B, T]``: restarting at 0 in every conversation (and in the padding);
    - ``document_ids`` ``[B, T]``: the conversation's place in its row, ``-1`` on padding;
    - ``cu_seqlens`` ``[B * (D + 1) + 1]`` int32: the offsets of the conversations (and of each row's
      padding) in the ``B * T`` tokens flattened, as flash-attention's varlen kernels take them,
      padded to a fixed length with the total; ``num_sequences`` (int) of them are real and
      ``max_seqlen`` (int) is the longest; ``D`` is the most conversations a row can hold;
    - with ``attention_mask="block"``, ``attention_mask`` ``[B, 1, T, T]`` bool: causal within each
      conversation (and within the padding), for a model that takes neither positions nor offsets.

    Args:
        dataset: a ``datasets.Dataset`` with ``input_ids``, ``loss_mask`` and ``seq_len``.
        rows: the dataset rows of this split.
        total_seq_len: tokens per packed row.
        max_length: the longest conversation kept whole (``over_long`` past it); default a row.
        seed: the data-order seed (the packing of every pass follows it).
        over_long: a longer conversation is ``"truncate"``-d or ``"drop"``-ped, and counted.
        length_quantum: see ``PackedRows``.
        train_on_prompt: labels on every next token of a conversation, not only the assistant's.
        attention_mask: ``"none"`` (default) or ``"block"``.
        name: the split, for messages.
    """

    uses_passes = True  # rows are packed afresh every pass over the data

    def __init__(
        self,
        dataset: Any,
        rows: np.ndarray,
        *,
        total_seq_len: int,
        max_length: int | None = None,
        seed: int = 0,
        over_long: OverLong = "truncate",
        length_quantum: int | None = None,
        train_on_prompt: bool = False,
        attention_mask: str = "none",
        name: str = "train",
    ) -> None:
        self.dataset = dataset.with_format("arrow", columns=["input_ids", "loss_mask"])
        rows = np.asarray(rows, dtype=np.int64)
        self.total_seq_len = total_seq_len
        self.train_on_prompt, self.attention_mask = train_on_prompt, attention_mask
        self.name = name
        self._packing = {
            "total_seq_len": total_seq_len,
            "seed": seed,
            "over_long": over_long,
            "length_quantum": length_quantum,
            "max_length": max_length,
        }
        # The rows, their lengths and every pass's packing are computed once on the node and mapped
        # by each of its ranks and workers (``node_arrays``), under a name for the data and options.
        identity = (dataset._fingerprint, hashlib.blake2b(rows.tobytes()).hexdigest(), sorted(self._packing.items()))
        self.shared_as = hashlib.blake2b(repr(identity).encode(), digest_size=16).hexdigest()
        self.rows, self.packed = self._pack(rows)
        if self.packed.truncated or self.packed.dropped:
            how = "truncated to" if self.packed.truncated else "left out, longer than"
            count = self.packed.truncated or self.packed.dropped
            log.warning(
                "%s: %d of %d conversations %s %d tokens", name, count, len(self.rows), how, self.packed.max_length
            )
        self.num_rows = len(self.packed)
        self.most_per_row = self.packed.most_per_row
        identity = (dataset._fingerprint, rows.tobytes(), self.packed.fingerprint, train_on_prompt)
        self.fingerprint = hashlib.blake2b(repr(identity).encode(), digest_size=16).hexdigest()
        self.details = {"conversations": len(self.rows), "total_seq_len": total_seq_len}

    def _pack(self, rows: np.ndarray | None) -> tuple[np.ndarray, PackedRows]:
        """The dataset rows and their packing, mapped from the node's arrays (made from ``rows`` where
        the node has none; a worker that received no rows finds them there)."""

        def make() -> dict[str, np.ndarray]:
            if rows is None:
                raise RuntimeError(f"{self.name}: the node's packed rows ({self.shared_as}) left its cache")
            lengths = column_values(self.dataset, "seq_len")[rows].astype(np.int32)
            return {"rows": narrow_indices(rows), "lengths": lengths}

        table = node_arrays(NODE_KIND, f"{self.shared_as}/rows", make)
        return table["rows"], PackedRows(table["lengths"], **self._packing, shared_as=self.shared_as)

    def mapped(self) -> PackedRows:
        """The packing, mapped again in a worker (which receives none)."""
        if self.packed is None:
            self.rows, self.packed = self._pack(self.rows)
        return self.packed

    def __getstate__(self) -> dict[str, Any]:
        # A worker maps the node's arrays itself instead of receiving every row and length (or, where
        # the node's cache could not be written, receives the rows and computes the rest).
        return {**self.__dict__, "rows": None if is_mapped(self.rows) else self.rows, "packed": None}

    def __len__(self) -> int:
        return self.num_rows

    @classmethod
    def join(cls, parts: list[ConversationRows]) -> JoinedRows:
        return JoinedRows(parts)

    def conversations(self, rows: list[int]) -> dict[int, dict[str, np.ndarray]]:
        """``input_ids`` and ``loss_mask`` of dataset rows ``rows``: one Arrow read for them all, the
        arrays views of its buffers (a per-row read through ``datasets`` costs ten times more)."""
        table = self.dataset[rows]
        columns = {}
        for name in ("input_ids", "loss_mask"):
            lists = table.column(name).combine_chunks()
            columns[name] = (lists.offsets.to_numpy(), lists.values.to_numpy())
        return {
            row: {name: values[offsets[i] : offsets[i + 1]] for name, (offsets, values) in columns.items()}
            for i, row in enumerate(rows)
        }

    def packed_rows(self, indices: np.ndarray, passes: np.ndarray) -> tuple[list[list[int]], dict[int, Batch]]:
        """The dataset rows of each packed row ``indices[i]`` of pass ``passes[i]``, and their tokens
        (cut to ``max_length``)."""
        packed = self.mapped()
        span = [
            self.rows[packed.row(pass_, row)].tolist()
            for row, pass_ in zip(indices.tolist(), passes.tolist(), strict=True)
        ]
        tokens = self.conversations([row for conversations in span for row in conversations])
        limit = packed.max_length
        return span, {row: {k: v[:limit] for k, v in ids.items()} for row, ids in tokens.items()}

    def fetch(self, indices: np.ndarray, passes: np.ndarray) -> Batch:
        return self.assemble(*self.packed_rows(indices, passes), self.most_per_row)

    def assemble(self, span: list[list[Any]], tokens: dict[Any, Batch], most: int) -> Batch:
        """The raw rows (numpy) of ``span``'s conversations; ``most``: conversations a row can hold."""
        count, length = len(span), self.total_seq_len
        raw = {
            "input_ids": np.zeros((count, length), dtype=np.int64),
            "loss_mask": np.zeros((count, length), dtype=np.uint8),
        }
        for b, conversations in enumerate(span):
            filled = 0
            for row in conversations:
                ids = tokens[row]
                n = len(ids["input_ids"])
                raw["input_ids"][b, filled : filled + n] = ids["input_ids"]
                raw["loss_mask"][b, filled : filled + n] = ids["loss_mask"]
                filled += n
        lengths = [[len(tokens[row]["input_ids"]) for row in conversations] for conversations in span]
        raw.update(row_layout(lengths, length, most))
        return raw

    def to_batch(self, raw: Batch) -> Batch:
        ids = torch.from_numpy(raw["input_ids"])
        documents = torch.from_numpy(raw["document_ids"])
        labels = torch.full_like(ids, IGNORE_INDEX)
        # Position t learns the token at t + 1 when both are in one conversation and it takes loss.
        same = (documents[:, 1:] == documents[:, :-1]) & (documents[:, 1:] >= 0)
        if not self.train_on_prompt:
            same &= torch.from_numpy(raw["loss_mask"][:, 1:]).bool()
        labels[:, :-1] = torch.where(same, ids[:, 1:], IGNORE_INDEX)
        batch = {
            "input_ids": ids,
            "labels": labels,
            "position_ids": torch.from_numpy(raw["position_ids"]),
            "document_ids": documents,
            "cu_seqlens": torch.from_numpy(raw["cu_seqlens"]),
            "num_sequences": int(raw["num_sequences"]),
            "max_seqlen": int(raw["max_seqlen"]),
        }
        if self.attention_mask == "block":
            causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
            # Padding is one block of its own (document -1), like its own sequence in ``cu_seqlens``.
            batch["attention_mask"] = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
        return batch


class JoinedRows:
    """Several ``ConversationRows`` as one source, their rows one after another (a mixture's)."""

    uses_passes = True

    def __init__(self, parts: list[ConversationRows]) -> None:
        kinds = {(p.total_seq_len, p.train_on_prompt, p.attention_mask) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"mixed conversation sources need one total_seq_len and labelling, got {sorted(kinds)}")
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.fingerprint = "+".join(p.fingerprint for p in parts)
        self.most_per_row = max(p.most_per_row for p in parts)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def fetch(self, indices: np.ndarray, passes: np.ndarray) -> Batch:
        part_of = np.searchsorted(self.starts, indices, side="right") - 1
        span: list[list[tuple[int, int]]] = [[] for _ in indices]
        tokens: dict[tuple[int, int], Batch] = {}
        for p in np.unique(part_of).tolist():
            mine = np.flatnonzero(part_of == p)
            rows, found = self.parts[p].packed_rows(indices[mine] - self.starts[p], passes[mine])
            tokens.update({(p, row): value for row, value in found.items()})
            for i, conversations in zip(mine.tolist(), rows, strict=True):
                span[i] = [(p, row) for row in conversations]
        return self.parts[0].assemble(span, tokens, self.most_per_row)

    def to_batch(self, raw: Batch) -> Batch:
        return self.parts[0].to_batch(raw)
