"""HuggingFace text datasets, tokenized once in ``prepare_data`` into token shards and served by the
token-shard windows: the plan, packing, exact and elastic resume are the token shards' own.

The cache directory is keyed by what determines the tokens (the dataset's files or name, the
tokenizer, the options), so ``setup`` on every rank only opens it, and a cache of other inputs is
never reused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.plan.arguments import check_split_options, require_existing, require_int
from datamodules.plan.bad_samples import check_policy
from datamodules.plan.datamodule import PlanDataModule
from datamodules.plan.hf_loading import check_data_files, is_saved_dataset
from datamodules.plan.loader import SourceSpec
from datamodules.plan.parallelism import Job
from datamodules.text.document_units import document_units
from datamodules.text.prepare import (
    FORMAT_VERSION,
    DocumentTokenizer,
    evaluation_vocabulary,
    prepare,
    tokenize_to_memory,
    tokenizer_identity,
)
from datamodules.text.prepare_inputs import BAD_ROW_POLICIES, DatasetCorpus
from datamodules.text.shard_metadata import METADATA_FILE
from datamodules.text.text_stream import TextStream
from datamodules.text.token_shard_source import split_windows
from datamodules.text.token_shards import TokenShards
from datamodules.text.token_windows import TokenWindows


@dataclass
class HFTextSource(SourceSpec):
    """A HuggingFace text dataset as a source: tokenized once into a cache, then token windows.

    Args:
        path: ``datasets.load_dataset``'s ``path`` (a hub name, a builder such as ``"json"``,
            ``"parquet"`` or ``"text"`` with ``data_files``, a local data folder), or a
            ``save_to_disk`` folder (read with ``load_from_disk``).
        tokenizer: a ``transformers`` tokenizer name or local path.
        name: the dataset configuration (``load_dataset``'s ``name``).
        split: the training split.
        data_files: ``load_dataset``'s ``data_files``: a path or glob, a list of them, or a mapping
            of split name to those.
        text_field: the column holding the text.
        val_split: a split of the same dataset for validation: global rank 0 alone loads and
            tokenizes it (in ``setup``) and broadcasts the tokens, so no other rank touches the
            dataset or its cache; or
        val_fraction: hold out this fraction of the training tokens (the tail) for validation; with
            ``streaming``, the documents a keyed hash of their text puts below the fraction (the same
            documents on any number of ranks, shards or workers), which the readers skip and global
            rank 0 reads out of the whole dataset in ``setup`` (a full read: for a hub-sized stream,
            give ``val_split``).
        test_split, test_fraction: the same for the test split (``Trainer.test``); a fraction is the
            very tail, after the validation tail (with ``streaming``: the next range of the hash).
        cache_dir: where the token shards go, one folder per set of inputs and options. It must
            be shared by the ranks of a node (or by all ranks, with ``prepare_data_per_node=False``).
        add_bos: start every document with the tokenizer's BOS token (EOS always ends it).
        num_proc: tokenizer processes in ``prepare_data`` (default: CPU count, at most 8).
        on_bad_row: a row whose text is missing, null or not a string stops preparation (``"raise"``)
            or is counted and skipped (``"skip"``). Empty texts are always skipped and counted.
        load_kwargs: further ``load_dataset`` arguments, e.g. ``{"sample_by": "document"}``.
        storage_options: for a ``path`` or ``data_files`` at URLs (``s3://``, ``gs://``, ...), the
            fsspec filesystem's options, passed to ``datasets``. Remote files are keyed in the cache
            by their names, as hub datasets are.
        streaming: no cache: the split is read, tokenized and packed as training goes, by a reader
            per (rank, DataLoader worker) over its units (parquet row groups, ``save_to_disk`` row
            ranges, or stream shards): ``TextStream``. In a ``MixtureDataModule``, the plan's positions
            of this source take the rank's next windows of the stream.
        shuffle_rows: with ``streaming``, rows read in one seeded order within a unit.
    """

    path: str
    tokenizer: str
    name: str | None = None
    split: str = "train"
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    text_field: str = "text"
    val_split: str | None = None
    val_fraction: float = 0.0
    cache_dir: str = ".cache/datamodules/hf_text"
    add_bos: bool = False
    num_proc: int | None = None
    on_bad_row: str = "raise"
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None
    test_split: str | None = None
    test_fraction: float = 0.0
    streaming: bool = False
    shuffle_rows: int = 10_000

    def __post_init__(self) -> None:
        check_split_options(self.split, self.val_split, self.val_fraction, self.test_split, self.test_fraction)
        require_int("shuffle_rows", self.shuffle_rows, 1)
        if self.num_proc is not None:
            require_int("num_proc", self.num_proc, 1)
        check_data_files(self.path, self.data_files)
        require_existing("path", self.path, only_if_local=True)
        require_existing("tokenizer", self.tokenizer, only_if_local=True)
        check_policy(self.on_bad_row, BAD_ROW_POLICIES, "on_bad_row")

    def _corpus(self, split: str) -> DatasetCorpus:
        files = tuple(self.data_files) if isinstance(self.data_files, list) else self.data_files
        load_kwargs = tuple(sorted(self.load_kwargs.items()))
        saved = is_saved_dataset(self.path, self.storage_options)
        return DatasetCorpus(
            self.path, split, saved, self.name, files, load_kwargs, storage_options=self.storage_options
        )

    def cache_path(self, split: str) -> Path:
        """The cache folder of ``split``: named for the dataset, keyed by everything behind its tokens."""
        identity = [FORMAT_VERSION, self.text_field, self.add_bos, tokenizer_identity(self.tokenizer)]
        identity += [self.on_bad_row] if self.on_bad_row != "raise" else []
        key = hashlib.blake2b(json.dumps([identity, self._corpus(split).identity()]).encode(), digest_size=8)
        readable = re.sub(r"[^\w.-]+", "_", f"{Path(self.path).name or self.path}-{self.name or ''}-{split}")
        return Path(self.cache_dir) / f"{readable}-{key.hexdigest()}"

    def prepare(self) -> None:
        if self.streaming:
            return  # read as training goes: nothing to tokenize ahead
        prepare(
            self._corpus(self.split),
            self.cache_path(self.split),
            self.tokenizer,
            text_field=self.text_field,
            num_proc=self.num_proc,
            add_bos=self.add_bos,
            separator=None,  # the EOS; this source has no separator option for an error to name
            on_bad_row=self.on_bad_row,
        )

    def _open(self, split: str) -> TokenShards:
        path = self.cache_path(split)
        if not (path / METADATA_FILE).exists():
            raise FileNotFoundError(
                f"no tokenized cache of {self.path!r} split {split!r} at {path}: prepare_data() has not run for "
                "these inputs (Trainer.fit runs it), or cache_dir is not shared by this node's ranks"
            )
        return TokenShards(path)

    def _evaluation_set(self, split: str) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        corpus = self._corpus(split)
        return tokenize_to_memory(corpus, self.tokenizer, self.text_field, self.add_bos, self.on_bad_row)

    def _evaluation_shards(self, split: str | None, job: Job | None) -> TokenShards | None:
        """A held-out split tokenized on global rank 0 and broadcast; ``None`` for no split."""
        if split is None:
            return None
        make = functools.partial(self._evaluation_set, split)
        tokens, starts, vocabulary = (job or Job())(make)
        return TokenShards.from_tokens(tokens, starts, f"{self.path}:{split}", vocabulary)

    def build(
        self, seq_len: int, pack_sequences: bool, job: Job | None = None
    ) -> tuple[TokenWindows, dict[str, TokenWindows]]:
        val = self._evaluation_shards(self.val_split, job)
        test = self._evaluation_shards(self.test_split, job)
        shards = self._open(self.split)
        return split_windows(shards, seq_len, pack_sequences, val, self.val_fraction, test, self.test_fraction)

    def stream(self, seq_len: int, batch_size: int, pack_sequences: bool, seed: int) -> TextStream:
        """The training split streamed: read, tokenized and packed as training goes (no cache); the
        documents ``val_fraction`` and ``test_fraction`` hold out (by a hash of their text) left out."""
        units = document_units(self._corpus(self.split), self.text_field, self.shuffle_rows)
        return TextStream(
            units,
            self.tokenizer,
            seq_len,
            batch_size,
            pack_sequences,
            seed,
            self.add_bos,
            self.shuffle_rows,
            self.on_bad_row,
            (self.val_fraction, self.test_fraction),
        )

    def build_stream(
        self, seq_len: int, batch_size: int, pack_sequences: bool, seed: int, job: Job | None = None
    ) -> tuple[TextStream, dict[str, TokenWindows]] | None:
        if not self.streaming:
            return None
        stream = self.stream(seq_len, batch_size, pack_sequences, seed)
        return stream, self.evaluation_windows(seq_len, pack_sequences, job, stream)

    def evaluation_windows(
        self, seq_len: int, pack_sequences: bool, job: Job | None, stream: TextStream
    ) -> dict[str, TokenWindows]:
        """Windows of ``val_split`` and ``test_split``, or of the documents ``stream`` holds out, each
        read and tokenized on global rank 0 and broadcast."""
        held = {"validation": (self.val_split, self.val_fraction), "test": (self.test_split, self.test_fraction)}
        shards = {
            role: self._held_out_shards(stream, role, fraction, job)
            if fraction
            else self._evaluation_shards(split, job)
            for role, (split, fraction) in held.items()
        }
        return {role: TokenWindows(s, seq_len, pack_sequences=pack_sequences) for role, s in shards.items() if s}

    def _held_out_shards(self, stream: TextStream, role: str, fraction: float, job: Job | None) -> TokenShards:
        def make() -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
            texts = stream.held_out_documents(role)
            if not texts:
                option = "val_fraction" if role == "validation" else "test_fraction"
                raise ValueError(f"{option}={fraction} holds out no document of {self.path!r}: use a larger fraction")
            encode = DocumentTokenizer(self.tokenizer, add_bos=self.add_bos)
            tokens, lengths = encode(texts)
            return tokens, np.cumsum(lengths) - lengths, evaluation_vocabulary(self.tokenizer, encode)

        tokens, starts, vocabulary = (job or Job())(make)
        return TokenShards.from_tokens(tokens, starts, f"{self.path}:{role} held out", vocabulary)


class HFTextDataModule(PlanDataModule):
    """Trains on a HuggingFace text dataset, tokenized once in ``prepare_data`` into a token cache,
    or (``streaming=True``) read, tokenized and packed as training goes.

    Args:
        path, tokenizer, name, split, data_files, text_field, val_split, val_fraction, cache_dir,
            add_bos, num_proc, on_bad_row, load_kwargs, storage_options, test_split, test_fraction: see
            ``HFTextSource``; ``storage_options`` are
            kept out of checkpoints.
        seq_len: tokens per sequence. batch_size: sequences per rank per micro-batch.
        pack_sequences: document-aware batches (see ``TokenShardDataModule``).
        prepare_data_per_node: tokenize once per node (default; each node's ``cache_dir``), or
            once in all (``False``; ``cache_dir`` on a filesystem every node shares).
        streaming: no cache: every (rank, DataLoader worker) reads its own units of the dataset
            (parquet row groups, ``save_to_disk`` row ranges, or stream shards), tokenizes and packs
            them on the fly (``TextStream``). Resume is token-exact on the same number of ranks and
            workers; on another, what the checkpoint's readers had not finished (their partly packed
            rows included) is dealt to the new ones, every document once. Training needs
            ``max_steps`` or ``steps_per_epoch``.
        shuffle_rows: with ``streaming``, rows read in one seeded order within a unit.
        steps_per_epoch: with ``streaming``, optimizer steps per epoch (default: one endless epoch).
        seed, num_workers, allow_plan_change, pin_memory, prefetch_factor, broadcast_within,
            split_sequence_for, sequence_split: see
            ``PlanDataModule``.

    Example::

        dm = HFTextDataModule("json", tokenizer="gpt2", data_files="data/*.jsonl.gz", seq_len=2048, batch_size=8)
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        path: str,
        tokenizer: str,
        seq_len: int,
        batch_size: int,
        name: str | None = None,
        split: str = "train",
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        text_field: str = "text",
        val_split: str | None = None,
        val_fraction: float = 0.0,
        cache_dir: str = ".cache/datamodules/hf_text",
        add_bos: bool = False,
        num_proc: int | None = None,
        on_bad_row: str = "raise",
        load_kwargs: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        pack_sequences: bool = False,
        prepare_data_per_node: bool = True,
        streaming: bool = False,
        shuffle_rows: int = 10_000,
        steps_per_epoch: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        broadcast_within: str | list[str] | None = None,
        split_sequence_for: str | list[str] | None = None,
        sequence_split: str = "head_tail",
        test_split: str | None = None,
        test_fraction: float = 0.0,
    ) -> None:
        super().__init__(
            batch_size,
            seed=seed,
            num_workers=num_workers,
            allow_plan_change=allow_plan_change,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            broadcast_within=broadcast_within,
            split_sequence_for=split_sequence_for,
            sequence_split=sequence_split,
        )
        self.seq_len = require_int("seq_len", seq_len, 1)
        self.pack_sequences = pack_sequences
        self.prepare_data_per_node = prepare_data_per_node
        self.streaming = streaming
        if steps_per_epoch is not None and not streaming:
            raise ValueError(f"steps_per_epoch={steps_per_epoch} is for streaming=True; a cache's epoch is one pass")
        self.stream_steps_per_epoch = (
            None if steps_per_epoch is None else require_int("steps_per_epoch", steps_per_epoch, 1)
        )
        self.source = HFTextSource(
            path,
            tokenizer,
            name=name,
            split=split,
            data_files=data_files,
            text_field=text_field,
            val_split=val_split,
            val_fraction=val_fraction,
            cache_dir=cache_dir,
            add_bos=add_bos,
            num_proc=num_proc,
            on_bad_row=on_bad_row,
            load_kwargs=dict(load_kwargs or {}),
            storage_options=storage_options,
            test_split=test_split,
            test_fraction=test_fraction,
            streaming=streaming,
            shuffle_rows=shuffle_rows,
        )
        self.save_hyperparameters(ignore=["storage_options"])  # credentials stay out of checkpoints

    def sequence_length(self) -> int:
        return self.seq_len

    def source_specs(self) -> list[HFTextSource]:
        return [self.source]

    def build_stream(self) -> TextStream | None:
        if not self.streaming:
            return None
        return self.source.stream(self.seq_len, self.batch_size, self.pack_sequences, self.seed)

    test_options = "give it test_split or test_fraction"

    def build_sources(self) -> list[tuple[str, TokenWindows | None, dict[str, TokenWindows]]]:
        if self.streaming:
            held = self.source.evaluation_windows(self.seq_len, self.pack_sequences, self.job, self._stream.stream)
            return [("train", None, held)]
        return [("train", *self.source.build(self.seq_len, self.pack_sequences, self.job))]
