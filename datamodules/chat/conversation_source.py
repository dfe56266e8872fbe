"""``ConversationSource``: chat conversations as a source of packed rows, for ``ConversationDataModule``
and for mixtures (``MixtureDataModule`` of several ``ConversationSource``)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.chat.conversation_rows import ATTENTION_MASKS, COLUMNS, ConversationRows, checked_rows
from datamodules.chat.prepare_conversations import MANIFEST, prepare_conversations, template_text
from datamodules.plan.arguments import check_held_out, require_existing, require_int
from datamodules.plan.bad_samples import check_policy
from datamodules.plan.held_out import held_out_rows
from datamodules.plan.hf_loading import is_saved_dataset, load_split
from datamodules.plan.loader import SourceSpec
from datamodules.plan.parallelism import Job

OVER_LONG = ("truncate", "drop")


def _stamps(name: str) -> list[str]:
    """A local file's or folder's files by name, size and modification time; anything else by name."""
    path = Path(name).expanduser()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    return [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files] or [name]


@dataclass
class ConversationSource(SourceSpec):
    """Conversations, tokenized with a chat template into assistant-masked rows, packed by multipack.

    Args:
        data: ShareGPT (``conversations: [{from, value}]``) or OpenAI (``messages: [{role, content}]``)
            conversations: JSON / JSON-lines / parquet files, a ``save_to_disk`` folder or a hub name; or a
            folder already prepared (``input_ids``, ``loss_mask``, ``seq_len``: by
            ``prepare_conversations`` or by speculators' ``prepare-data``), read as it is. Contents are text
            or lists of content parts, and a conversation with a turn whose content is ``null`` or missing
            is left out and counted: see ``prepare_conversations``.
        tokenizer: a ``transformers`` tokenizer with a chat template (not needed for a prepared folder).
        chat_template: a Jinja chat template (or a file holding one) replacing the tokenizer's.
        system_prompt: a system turn opening every conversation that has none.
        split: the split of a hub dataset or saved ``DatasetDict`` (default: ``train``, or a folder's
            one dataset).
        val_split, test_split: splits of the same hub dataset or ``DatasetDict`` held out; or
        val_fraction, test_fraction: conversations held out, drawn by a fixed keyed shuffle.
        max_length: the longest conversation kept whole. Default: a row.
        over_long: a conversation longer than ``max_length`` is ``"truncate"``-d (default) or
            ``"drop"``-ped, and counted.
        train_on_prompt: labels on every token of a conversation, not only the assistant's.
        attention_mask: ``"none"`` (default) or ``"block"`` (see ``ConversationRows``).
        length_quantum: see ``PackedRows``.
        cache_dir: where conversations are prepared, one folder per set of inputs and settings; shared
            by the ranks of a node (``prepare_data`` writes it once per node).
        num_proc: tokenizer processes.
    """

    data: str | list[str]
    tokenizer: str | None = None
    chat_template: str | None = None
    system_prompt: str | None = None
    split: str | None = None
    val_split: str | None = None
    val_fraction: float = 0.0
    test_split: str | None = None
    test_fraction: float = 0.0
    max_length: int | None = None
    over_long: str = "truncate"
    train_on_prompt: bool = False
    attention_mask: str = "none"
    length_quantum: int | None = None
    cache_dir: str = ".cache/datamodules/conversations"
    num_proc: int = 1

    def __post_init__(self) -> None:
        self.inputs = [self.data] if isinstance(self.data, str) else list(self.data)
        for name in self.inputs:
            require_existing("data", name, only_if_local=True)
        check_held_out(("val_split", self.val_split, "val_fraction", self.val_fraction))
        check_held_out(("test_split", self.test_split, "test_fraction", self.test_fraction), self.val_fraction)
        if self.max_length is not None:
            require_int("max_length", self.max_length, 1)
        require_int("num_proc", self.num_proc, 1)
        check_policy(self.over_long, OVER_LONG, "over_long")
        check_policy(self.attention_mask, ATTENTION_MASKS, "attention_mask")
        self.prepared = len(self.inputs) == 1 and self._is_prepared(self.inputs[0], self.split)
        if not self.prepared and self.tokenizer is None:
            raise ValueError(
                f"data {self.data!r} holds conversations to render: give a tokenizer with a chat template "
                f"(or a folder prepared with {', '.join(COLUMNS)})"
            )
        if self.tokenizer is not None:
            require_existing("tokenizer", self.tokenizer, only_if_local=True)
        self.template = template_text(self.chat_template)

    @staticmethod
    def _is_prepared(name: str, split: str | None) -> bool:
        """Whether ``name`` is a ``save_to_disk`` folder of rows already prepared (memory-mapped: cheap)."""
        return is_saved_dataset(name) and set(COLUMNS) <= set(load_split(name, split).column_names)

    def cache_path(self, split: str | None) -> Path:
        """The prepared folder of ``split``: named for the data, keyed by everything behind its rows."""
        identity = [self.inputs, split, _stamps(str(self.tokenizer)), self.template, self.system_prompt]
        key = hashlib.blake2b(json.dumps(identity).encode(), digest_size=8).hexdigest()
        readable = re.sub(r"[^\w.-]+", "_", f"{Path(self.inputs[0]).name or self.inputs[0]}-{split or 'train'}")
        return Path(self.cache_dir) / f"{readable}-{key}"

    def _splits(self) -> list[str | None]:
        return [self.split] + [s for s in (self.val_split, self.test_split) if s is not None]

    def prepare(self) -> None:
        if self.prepared:
            return
        for split in self._splits():
            prepare_conversations(
                self.inputs,
                str(self.tokenizer),
                str(self.cache_path(split)),
                num_proc=self.num_proc,
                chat_template=self.template,
                overwrite=True,  # the folder is the cache's: new inputs under the same key replace it
                split=split,
                system_prompt=self.system_prompt,
            )

    def _dataset(self, split: str | None) -> Any:
        if self.prepared:
            return checked_rows(load_split(self.inputs[0], split), self.inputs[0])
        path = self.cache_path(split)
        if not (path / MANIFEST).is_file():
            raise FileNotFoundError(
                f"no prepared conversations of {self.data!r} at {path}: prepare_data() has not run for these "
                "inputs (Trainer.fit runs it), or cache_dir is not shared by this node's ranks"
            )
        return checked_rows(load_split(str(path), None), str(path))

    def build(
        self, seq_len: int, pack_sequences: bool = True, job: Job | None = None
    ) -> tuple[ConversationRows, dict[str, ConversationRows]]:
        """``(train, held)`` packed rows of ``seq_len`` tokens (``pack_sequences`` is always on here)."""
        options = {
            "total_seq_len": seq_len,
            "max_length": self.max_length,
            "over_long": self.over_long,
            "length_quantum": self.length_quantum,
            "train_on_prompt": self.train_on_prompt,
            "attention_mask": self.attention_mask,
        }

        def rows(dataset: Any, picked: np.ndarray, name: str) -> ConversationRows:
            return ConversationRows(dataset, np.sort(picked), name=name, **options)

        dataset = self._dataset(self.split)
        train, held = held_out_rows(
            len(dataset), {"validation": self.val_fraction, "test": self.test_fraction}, "conversations"
        )
        splits = {role: rows(dataset, s.rows(np.arange(len(s))), role) for role, s in held.items()}
        for role, name in (("validation", self.val_split), ("test", self.test_split)):
            if name is not None:
                own = self._dataset(name)
                splits[role] = rows(own, np.arange(len(own)), name)
        return rows(dataset, train.rows(np.arange(len(train))), "train"), splits
