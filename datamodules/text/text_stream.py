"""A text dataset streamed: tokenized as it is read and packed on the fly into training windows.

Every pass orders the dataset's units (parquet row groups, ``save_to_disk`` row ranges, or stream
shards) by a seeded permutation, and reader ``r`` of ``R`` reads units ``r, r + R, ...`` of that
order, so each document is read by exactly one reader per pass. Inside a unit, every block of
``shuffle_rows`` rows is read in a seeded order. A reader's documents, each ended by EOS, form one
token stream cut into ``seq_len + 1``-token windows exactly as token shards are (window ``i``
starts at token ``i * seq_len``), so batches follow the same contract as the token-shard windows.

A reader's state is its cursor (pass, unit, block, next row) and the tokens it has read but not yet
batched: resuming re-reads one block, however far into the stream the cursor is.

On another number of readers (``redeal``), what the old readers had not finished is dealt out
again: every unit of the passes they had begun that was not read to its end becomes a work item
``(pass, unit, block, row)``, read from where it stood, and the items are dealt round robin (by pass,
then unit) to the new readers, which read them first, then go on with the next pass in the usual
way; each old reader's unbatched tokens go to new reader ``old % new``, ahead of its items. Every
document is read once across the change; only the order differs from a run on the new readers.

Held-out documents (``held_out``: validation and test fractions) are chosen by a keyed hash of their
text, so the choice does not depend on units, readers or the seed: the readers skip them, and
``held_out_documents`` reads them out of every unit for evaluation.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from datamodules.plan.permutation import mix64, permute, round_keys
from datamodules.plan.stream import ReaderState, Stream, as_tensor
from datamodules.text.document_units import DocumentUnits, check_texts
from datamodules.text.prepare import DocumentTokenizer, evaluation_vocabulary, tokenizer_identity
from datamodules.text.token_windows import windows_to_batch

log = logging.getLogger(__name__)

_UNIT_ORDER = 0x554E4954  # keyed-permutation stream ids: the unit order of a pass,
_ROW_ORDER = 0x524F5753  # and the row order of a block
_TOKENIZE_ROWS = 256  # documents tokenized in one call
_CURSOR = ("pass", "unit", "block", "row")


class TextStream(Stream):
    """Windows of ``seq_len + 1`` tokens, ``batch_size`` a batch, from a dataset's units.

    Args:
        units: the dataset's documents as units (``document_units``).
        tokenizer: a ``transformers`` tokenizer name or path; EOS ends every document.
        seq_len, batch_size: window length (plus one label token) and windows per batch.
        pack_sequences: also return document boundaries (``position_ids``, ``document_ids``).
        seed: the seed of the unit and row orders.
        add_bos: start every document with the tokenizer's BOS token.
        shuffle_rows: rows read in one seeded order (the shuffle's reach inside a unit).
        on_bad_row: a row without text stops the stream (``"raise"``) or is skipped (``"skip"``).
            Empty texts are always skipped; a reader logs what it skipped at the end of each pass.
        held_out: the fractions of documents held out for validation and for test (``held_out_role``),
            which the readers never train on.
    """

    def __init__(
        self,
        units: DocumentUnits,
        tokenizer: str,
        seq_len: int,
        batch_size: int,
        pack_sequences: bool = False,
        seed: int = 0,
        add_bos: bool = False,
        shuffle_rows: int = 10_000,
        on_bad_row: str = "raise",
        held_out: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.units, self.tokenizer = units, tokenizer
        self.seq_len, self.batch_size, self.pack_sequences = seq_len, batch_size, pack_sequences
        self.seed, self.add_bos, self.shuffle_rows, self.on_bad_row = seed, add_bos, shuffle_rows, on_bad_row
        self._identity = {
            "data": units.identity(),
            "tokenizer": tokenizer_identity(tokenizer),
            "seq_len": seq_len,
            "pack_sequences": pack_sequences,
            "seed": seed,
            "add_bos": add_bos,
            "shuffle_rows": shuffle_rows,
            **({"on_bad_row": on_bad_row} if on_bad_row != "raise" else {}),
            **({"held_out": list(held_out)} if any(held_out) else {}),
        }
        self.held_out = held_out
        self.unit_parts: int | None = None  # each unit cut into this many row ranges (fixed once read)

    raw_layout = "token windows"  # a batch's raw arrays are ``TokenWindows.fetch``'s: they mix in a plan

    def identity(self) -> dict[str, Any]:
        return self._identity

    @functools.cached_property
    def vocabulary(self) -> dict[str, Any]:
        """What the ids mean (the tokenizer and its EOS), as token shards record it, for a mixture's check."""
        return evaluation_vocabulary(self.tokenizer, DocumentTokenizer(self.tokenizer, add_bos=self.add_bos))

    def describe(self) -> str:
        return self.units.describe()

    @property
    def sample_tokens(self) -> int:
        return self.seq_len

    def to_batch(self, raw: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return windows_to_batch(raw)

    def cut_units(self, parts: int) -> int:
        """Cuts every unit into ``parts`` row ranges (once: the readers' cursors count in those units)."""
        if self.unit_parts is None:
            if parts > 1:
                self.units.split(parts)
            self.unit_parts = parts
        elif parts != self.unit_parts:
            raise RuntimeError(f"the stream's units are cut in {self.unit_parts}, not {parts}")
        return len(self.units)

    def _cut_for(self, num_readers: int) -> int:
        """Units, cut into row ranges when there are fewer than readers (and they can be cut)."""
        if self.unit_parts is None:
            few = self.units.splittable and len(self.units) < num_readers
            self.cut_units(math.ceil(num_readers / len(self.units)) if few else 1)
        return len(self.units)

    def idle_readers(self, num_readers: int) -> list[int]:
        return list(range(self._cut_for(num_readers), num_readers))

    def units_of(self, reader: int, num_readers: int, pass_: int) -> np.ndarray:
        """The units reader ``reader`` of ``num_readers`` reads in pass ``pass_``, in order."""
        n = self._cut_for(num_readers)
        order = permute(np.arange(n), n, round_keys(self.seed, _UNIT_ORDER, np.full(n, pass_)))
        return order[reader::num_readers]

    def _row_order(self, pass_: int, unit: int, block: int, rows: int) -> np.ndarray:
        key = int(mix64(np.array([(unit << 32) | block], dtype=np.uint64))[0]) ^ _ROW_ORDER
        return permute(np.arange(rows), rows, round_keys(self.seed ^ key, pass_, np.zeros(rows)))

    def _unit_documents(
        self, pass_: int, unit: int, first_block: int, first_row: int, skipped: list[int]
    ) -> Iterator[tuple[int, int, str]]:
        """``(block, next row, text)`` of each document of ``unit`` in pass ``pass_``'s order, from
        ``(first_block, first_row)`` on; rows skipped are counted in ``skipped[0]``; held-out documents
        are passed over."""
        held = any(self.held_out)
        blocks = self.units.blocks(unit, first_block, self.shuffle_rows)
        for block, (table, start, values) in enumerate(blocks, start=first_block):
            if self.on_bad_row == "raise":
                check_texts(table, start, values, self.units.text_field)
            order = self._row_order(pass_, unit, block, len(values))
            for row in range(first_row, len(values)):
                text = values[order[row]]
                if not (isinstance(text, str) and text):
                    skipped[0] += 1
                elif not held or held_out_role(text, *self.held_out) is None:
                    yield block, row + 1, text
            first_row = 0

    def _documents_from(
        self, reader: int, num_readers: int, cursor: tuple[int, int, int, int], skipped: list[int]
    ) -> Iterator[tuple[tuple[int, int, int, int], str]]:
        """``(cursor after it, text)`` of each document reader ``reader`` reads in the cursor's
        pass, from the cursor ``(pass, unit slot, block, row)`` on; rows skipped are counted in ``skipped[0]``."""
        pass_, first_slot, first_block, first_row = cursor
        units = self.units_of(reader, num_readers, pass_).tolist()
        for slot in range(first_slot, len(units)):
            for block, row, text in self._unit_documents(pass_, units[slot], first_block, first_row, skipped):
                yield (pass_, slot, block, row), text
            first_block = first_row = 0

    def documents(self, reader: int, num_readers: int, pass_: int) -> Iterator[str]:
        """The documents reader ``reader`` reads in pass ``pass_``, in its order (for checks)."""
        return (text for _, text in self._documents_from(reader, num_readers, (pass_, 0, 0, 0), [0]))

    def _documents(
        self, reader: int, num_readers: int, cursor: tuple[int, int, int, int], work: np.ndarray
    ) -> Iterator[tuple[tuple[int, ...], str]]:
        """``(where, text)`` of every document reader ``reader`` reads: its work items, then the passes
        from ``cursor`` on, endlessly; ``where`` is ``(item, block, row)`` in the items, else the cursor."""
        skipped = [0]
        for item, (pass_, unit, block, row) in enumerate(work.tolist()):
            for at_block, at_row, text in self._unit_documents(pass_, unit, block, row, skipped):
                yield (item, at_block, at_row), text
        while True:
            pass_start = cursor[1:] == (0, 0, 0)
            for where, text in self._documents_from(reader, num_readers, cursor, skipped):
                pass_start = False
                yield where, text
            if pass_start:
                units = self.units_of(reader, num_readers, cursor[0]).tolist()
                raise ValueError(f"reader {reader} of {num_readers}: its units {units} hold no documents")
            log.debug("stream reader %d finished pass %d", reader, cursor[0])
            if skipped[0]:
                log.info(
                    "stream reader %d skipped %d empty texts or rows without text in pass %d",
                    reader,
                    skipped[0],
                    cursor[0],
                )
            cursor, skipped[0] = (cursor[0] + 1, 0, 0, 0), 0

    def held_out_documents(self, role: str) -> list[str]:
        """The documents held out for ``role`` (``"validation"`` or ``"test"``), from every unit in
        order: a read of the whole dataset, with a progress bar."""
        from tqdm.auto import tqdm

        texts = []
        for unit in tqdm(range(len(self.units)), desc=f"held-out {role} documents", unit="unit"):
            for _, _, values in self.units.blocks(unit, 0, self.shuffle_rows):
                texts += [t for t in values if isinstance(t, str) and t and held_out_role(t, *self.held_out) == role]
        return texts

    def read(self, reader: int, num_readers: int, state: ReaderState | None) -> Iterator[tuple[Any, ReaderState]]:
        work = _work(state)
        if not len(work) and reader in self.idle_readers(num_readers):
            return
        encode = DocumentTokenizer(self.tokenizer, add_bos=self.add_bos)
        start = _cursor(state)
        tokens = np.empty(0, np.int32) if state is None else state["tokens"].numpy()
        starts = np.empty(0, bool) if state is None else state["starts"].numpy()
        pieces, flags, have = [tokens], [starts], len(tokens)
        need = self.batch_size * self.seq_len + 1  # a batch's windows, overlapping by one token
        documents = self._documents(reader, num_readers, start, work)
        while chunk := list(itertools.islice(documents, _TOKENIZE_ROWS)):
            ids, lengths = encode([text for _, text in chunk])
            for (where, _), doc in zip(chunk, np.split(ids.astype(np.int32), np.cumsum(lengths)[:-1]), strict=True):
                flag = np.zeros(len(doc), bool)
                flag[0] = True
                pieces.append(doc)
                flags.append(flag)
                have += len(doc)
                if have < need:
                    continue
                tokens, starts = np.concatenate(pieces), np.concatenate(flags)
                while len(tokens) >= need:
                    raw = self._windows(tokens[:need], starts[:need])
                    tokens, starts = tokens[need - 1 :], starts[need - 1 :]
                    yield raw, {**_position(where, work, start), **_buffers(tokens, starts)}
                pieces, flags, have = [tokens], [starts], len(tokens)

    def redeal(self, states: dict[int, ReaderState], old: int, new: int) -> dict[int, ReaderState]:
        """The states of ``new`` readers that finish what ``old`` readers (in ``states``) had not: see
        the module. Refuses more new readers than units (some would have nothing to read)."""
        units = self._cut_for(old)
        if new > units:
            raise ValueError(f"the stream has {units} units (files, row groups or row ranges) for {new} readers")
        cursors = {r: _cursor(states.get(r)) for r in range(min(old, units))}
        last = max(cursor[0] for cursor in cursors.values())
        items = [item for r in cursors for item in _work(states.get(r)).tolist()]
        for r, (pass_, slot, block, row) in cursors.items():
            for p in range(pass_, last + 1):
                for s, unit in enumerate(self.units_of(r, old, p).tolist()):
                    if p > pass_ or s > slot:
                        items.append([p, unit, 0, 0])
                    elif s == slot:
                        items.append([p, unit, block, row])
        items.sort(key=lambda item: item[:2])
        dealt = {}
        for reader in range(new):
            carried = [states[r] for r in range(reader, old, new) if r in states and len(states[r]["tokens"])]
            tokens = [state["tokens"].numpy() for state in carried]
            starts = [state["starts"].numpy().copy() for state in carried]
            for flags in starts[1:]:
                flags[0] = True  # joined after another reader's tokens: no target across the seam
            dealt[reader] = {
                **dict(zip(_CURSOR, (last + 1, 0, 0, 0), strict=True)),
                "work": as_tensor(np.array(items[reader::new], dtype=np.int64).reshape(-1, 4)),
                **_buffers(
                    np.concatenate([np.empty(0, np.int32), *tokens]), np.concatenate([np.empty(0, bool), *starts])
                ),
            }
        return dealt

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        view = np.lib.stride_tricks.sliding_window_view
        raw = {"tokens": view(tokens, self.seq_len + 1)[:: self.seq_len].copy()}
        if self.pack_sequences:
            raw["document_starts"] = view(starts, self.seq_len + 1)[:: self.seq_len].copy()
        return raw


_HELD_OUT_KEY = b"datamodules held-out documents"  # fixed: the choice moves with the text, not the seed


def held_out_role(text: str, val_fraction: float, test_fraction: float) -> str | None:
    """``"validation"``, ``"test"`` or ``None`` (trained), by where a keyed hash of ``text`` falls in
    ``[0, 1)``: below ``val_fraction``, then below ``val_fraction + test_fraction``."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=_HELD_OUT_KEY).digest()
    where = int.from_bytes(digest, "little") / 2**64
    if where < val_fraction:
        return "validation"
    return "test" if where < val_fraction + test_fraction else None


def _buffers(tokens: np.ndarray, starts: np.ndarray) -> dict[str, torch.Tensor]:
    return {"tokens": as_tensor(tokens), "starts": as_tensor(starts)}


def _work(state: ReaderState | None) -> np.ndarray:
    """A reader's work items ``[k, 4]`` (pass, unit, block, row); none before any change of readers."""
    if state is None or "work" not in state:
        return np.empty((0, 4), np.int64)
    return state["work"].numpy()


def _cursor(state: ReaderState | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if state is None else tuple(int(state[k]) for k in _CURSOR)


def _position(where: tuple[int, ...], work: np.ndarray, start: tuple[int, int, int, int]) -> ReaderState:
    """The state fields of a reader past the document at ``where`` (see ``TextStream._documents``)."""
    if len(where) == 3:  # in the work items: the rest of them, the first from where it stands
        item, block, row = where
        rest = work[item:].copy()
        rest[0, 2:] = block, row
        return {**dict(zip(_CURSOR, start, strict=True)), "work": as_tensor(rest)}
    return {**dict(zip(_CURSOR, where, strict=True)), "work": _NO_WORK}


_NO_WORK = torch.empty((0, 4), dtype=torch.int64)
