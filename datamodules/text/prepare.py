"""Tokenize text into token shards plus ``metadata.json``: ``python -m datamodules.text.prepare``.

Inputs are text files (one document per file), JSONL/JSON, parquet, a dataset saved with
``save_to_disk``, or a HuggingFace hub name. Re-running on unchanged input does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import numpy as np
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from datamodules.text.shard_metadata import (
    DOCUMENT_STARTS_FILE,
    METADATA_FILE,
    ShardInfo,
    ShardMetadata,
    smallest_token_dtype,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_BUILDERS = {".txt": "text", ".md": "text", ".py": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_documents(inputs: Sequence[str], split: str = "train") -> datasets.Dataset:
    """One dataset of documents from local files, a ``save_to_disk`` folder or a hub name."""
    first = Path(inputs[0])
    if first.is_dir() and any((first / f).exists() for f in ("state.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(first))
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    if not first.exists():
        return datasets.load_dataset(inputs[0], split=split)
    files = [str(p) for p in map(Path, inputs) if p.is_file()]
    missing = [p for p in inputs if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"input files not found: {missing[:5]}")
    suffixes = {Path(f).suffix for f in files}
    builders = {_BUILDERS.get(s, "text") for s in suffixes}
    if len(builders) != 1:
        raise ValueError(f"mix of input kinds {sorted(suffixes)}; prepare one kind at a time")
    builder = builders.pop()
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=files, split="train", **kwargs)


def input_fingerprint(inputs: Sequence[str], tokenizer: str, text_field: str, shard_tokens: int) -> str:
    """Identity of a prepare run: inputs (path, size, mtime), tokenizer and options."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([FORMAT_VERSION, tokenizer, text_field, shard_tokens]).encode())
    for name in (*inputs, tokenizer):
        path = Path(name)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            stat = file.stat() if file.exists() else None
            h.update(f"{file}:{stat and stat.st_size}:{stat and stat.st_mtime_ns}".encode())
    return h.hexdigest()


class _Tokenize:
    """Picklable map function: token ids of each document with EOS appended."""

    def __init__(self, tokenizer_name: str, text_field: str) -> None:
        self.tokenizer_name = tokenizer_name
        self.text_field = text_field
        self._tokenizer = None

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        eos = self._tokenizer.eos_token_id
        ids = [doc + [eos] for doc in self._tokenizer(batch[self.text_field], add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids, "length": [len(d) for d in ids], "max_id": [max(d) for d in ids]}


def prepare(
    inputs: Sequence[str],
    output: str | Path,
    tokenizer: str,
    text_field: str = "text",
    num_proc: int | None = None,
    shard_tokens: int = 100_000_000,
    split: str = "train",
) -> ShardMetadata:
    """Tokenize ``inputs`` into ``output``; returns the (possibly already present) metadata."""
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    output = Path(output)
    fingerprint = input_fingerprint(inputs, tokenizer, text_field, shard_tokens)
    if (output / METADATA_FILE).exists():
        existing = ShardMetadata.read(output)
        if existing.source_fingerprint == fingerprint:
            log.info("%s is up to date (%d tokens); nothing to do", output, existing.num_tokens)
            return existing
    loaded = AutoTokenizer.from_pretrained(tokenizer)
    if loaded.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer!r} has no EOS token; documents need one to be separated")
    docs = load_documents(inputs, split)
    if text_field not in docs.column_names:
        raise ValueError(f"input has no column {text_field!r}; columns are {docs.column_names}")
    tokenized = docs.map(
        _Tokenize(tokenizer, text_field),
        batched=True,
        num_proc=num_proc or min(os.cpu_count() or 1, 8),
        remove_columns=docs.column_names,
        desc="tokenizing",
    )
    lengths = np.asarray(tokenized["length"], dtype=np.int64)
    if lengths.size == 0:
        raise ValueError(f"no documents in {list(inputs)}")
    max_id = int(max(tokenized["max_id"]))
    dtype = smallest_token_dtype(max_id)
    documents = (
        doc for rows in tokenized.select_columns(["input_ids"]).iter(batch_size=1024) for doc in rows["input_ids"]
    )
    metadata = write_shards(documents, lengths, output, np.dtype(dtype), shard_tokens)
    metadata.tokenizer, metadata.eos_id, metadata.max_token_id = tokenizer, int(loaded.eos_token_id), max_id
    metadata.source_fingerprint = fingerprint
    metadata.write(output)
    log.info("wrote %d tokens in %d documents to %s", metadata.num_tokens, metadata.num_documents, output)
    return metadata


def write_shards(
    documents: Iterator[np.ndarray], lengths: np.ndarray, output: Path, dtype: np.dtype, shard_tokens: int
) -> ShardMetadata:
    """Write ``documents`` (token arrays, EOS included, of the given ``lengths``) as ``.npy`` shards.

    Returns the metadata (not yet written): dtype, per-shard counts and the content hash. Document
    starts go to ``document_starts.npy``.
    """
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for stale in [*output.glob("shard_*.npy"), output / METADATA_FILE]:
        stale.unlink(missing_ok=True)
    total = int(lengths.sum())
    document_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    np.save(output / DOCUMENT_STARTS_FILE, document_starts)
    shards, digest = [], hashlib.blake2b(digest_size=16)
    pending = np.empty(0, dtype=dtype)
    with tqdm(total=total, unit="tok", desc="writing shards") as bar:
        for i, start in enumerate(range(0, total, shard_tokens)):
            size = min(shard_tokens, total - start)
            name = f"shard_{i:05d}.npy"
            out = np.lib.format.open_memmap(output / name, mode="w+", dtype=dtype, shape=(size,))
            filled = 0
            while filled < size:
                if pending.size == 0:
                    pending = np.asarray(next(documents), dtype=dtype)
                take = min(size - filled, pending.size)
                out[filled : filled + take] = pending[:take]
                digest.update(pending[:take].tobytes())
                pending, filled = pending[take:], filled + take
                bar.update(take)
            out.flush()
            del out
            docs = int(np.searchsorted(document_starts, start + size) - np.searchsorted(document_starts, start))
            shards.append(ShardInfo(name, size, docs))
    return ShardMetadata(
        dtype=dtype.name,
        shards=shards,
        num_tokens=total,
        num_documents=int(lengths.size),
        content_hash=digest.hexdigest(),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m datamodules.text.prepare", description=__doc__)
    parser.add_argument("inputs", nargs="+", help="text/JSONL/parquet files, a save_to_disk folder or a hub name")
    parser.add_argument("--output", required=True, help="directory for shards and metadata.json")
    parser.add_argument("--tokenizer", required=True, help="tokenizer name or local path (AutoTokenizer)")
    parser.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: CPU count)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    parser.add_argument("--split", default="train", help="split of a hub or saved dataset (default: train)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    prepare(args.inputs, args.output, args.tokenizer, args.text_field, args.num_proc, args.shard_tokens, args.split)


if __name__ == "__main__":
    main()
