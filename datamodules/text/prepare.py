"""Tokenize text into token shards plus ``metadata.json``: ``python -m datamodules.text.prepare``.

Inputs are files (text, JSON lines, parquet; gzip/zstd/bz2/xz compressed), directories of them, a
``save_to_disk`` folder or a hub name. Documents stream through ``--num-proc`` tokenizer processes
into shards, so memory is bounded by a batch, not the corpus. Output is written under a temporary
name and renamed when complete; a re-run on unchanged input returns at once. ``--num-parts N
--part-index i`` prepares one deterministic slice into ``output/part-0000i/`` for a job array.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from datamodules.plan.arguments import option, options_as_flags, program_name, require_int
from datamodules.plan.hf_loading import load_pretrained
from datamodules.storage.locations import is_url, storage_path
from datamodules.text.prepare_inputs import (
    BadRows,
    Corpus,
    PrepareError,
    document_batches,
    file_stamp,
    looks_like_hub_name,
    resolve_inputs,
)
from datamodules.text.shard_metadata import METADATA_FILE, ShardMetadata, smallest_token_dtype

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
PART_DIRECTORY = "part-{:05d}"


class DocumentTokenizer:
    """Token ids of a batch of documents as one flat array: optional BOS, the text, the separator.

    Args:
        tokenizer: a ``transformers`` tokenizer name or local path (``AutoTokenizer``).
        add_bos: start every document with the tokenizer's BOS token.
        separator: token ending every document: ``"eos"`` (the tokenizer's EOS), or a token string
            of the vocabulary such as ``"<|endoftext|>"``; ``None`` (a caller with no such option):
            the EOS.
    """

    def __init__(self, tokenizer: str, add_bos: bool = False, separator: str | None = None) -> None:
        # Every process tokenizes on one thread: the number of processes is the one knob of parallelism.
        self.tokenizer = load_pretrained("tokenizer", tokenizer, error=PrepareError)
        self.name = tokenizer
        self.vocab_size = len(self.tokenizer)
        if add_bos and self.tokenizer.bos_token_id is None:
            raise PrepareError(f"tokenizer {tokenizer!r} has no BOS token; drop {option('add_bos', True)}")
        self.bos_id = int(self.tokenizer.bos_token_id) if add_bos else None
        if separator in (None, "eos"):
            if self.tokenizer.eos_token_id is None:
                chosen = "use a tokenizer that has one" if separator is None else option("separator", "TOKEN")
                raise PrepareError(f"tokenizer {tokenizer!r} has no EOS token to end documents: {chosen}")
            self.separator_id = int(self.tokenizer.eos_token_id)
        else:
            ids = self.tokenizer.convert_tokens_to_ids([separator])
            if ids[0] is None or ids[0] == self.tokenizer.unk_token_id:
                raise PrepareError(f"{option('separator')} {separator!r} is not a token of tokenizer {tokenizer!r}")
            self.separator_id = int(ids[0])
        self.dtype = np.dtype(smallest_token_dtype(self.vocab_size - 1))
        self.content_hash = tokenizer_hash(self.tokenizer)
        # The Rust backend's batched encode without offsets is the fastest path a fast tokenizer has.
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self.tokenizer.is_fast else None
        self._encode_fast = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        if self._encode_fast is not None:
            return [encoding.ids for encoding in self._encode_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, lengths)``: every document's tokens one after another, and each one's length."""
        ids = self.encode(texts)
        content = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=sum(map(len, ids)))
        extra = (self.bos_id is not None) + 1
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + extra
        ends = np.cumsum(lengths)
        tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=self.dtype)
        is_text = np.ones(len(tokens), dtype=bool)
        if self.bos_id is not None:
            tokens[ends - lengths], is_text[ends - lengths] = self.bos_id, False
        tokens[ends - 1], is_text[ends - 1] = self.separator_id, False
        tokens[is_text] = content
        return tokens, lengths


_worker_tokenizer: DocumentTokenizer | None = None


def _init_worker(tokenizer: DocumentTokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _tokenize_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_tokenizer(texts)


def tokenized(
    batches: Iterable[list[str]], tokenizer: DocumentTokenizer, num_proc: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``tokenizer`` over ``batches`` in order, in ``num_proc`` processes, a few batches in flight."""
    if num_proc == 1:
        yield from map(tokenizer, batches)
        return
    # fork hands every worker the loaded tokenizer; the window keeps memory at a few batches. An
    # executor (unlike multiprocessing.Pool) notices a worker that died and fails instead of hanging.
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(num_proc, mp_context=context, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending: deque = deque()
        try:
            for batch in batches:
                pending.append(pool.submit(_tokenize_in_worker, batch))
                if len(pending) >= 2 * num_proc:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise PrepareError(
                "a tokenizer process died (killed, or out of memory?); nothing was written. "
                f"Run again, with a smaller {option('num_proc')} if memory is short"
            ) from None


def tokenizer_hash(tokenizer: Any) -> str:
    """A digest of what a loaded tokenizer's ids mean: its vocabulary (added tokens too) and its special
    tokens, not where it was loaded from, so a copy of it elsewhere hashes the same."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = [tokenizer.special_tokens_map, tokenizer.all_special_tokens, tokenizer.all_special_ids]
    return hashlib.blake2b(json.dumps([vocabulary, special], default=str).encode(), digest_size=16).hexdigest()


def tokenizer_identity(tokenizer: str) -> list[str]:
    """What identifies a tokenizer without loading it: its local files by size and time, or its hub name."""
    path = Path(tokenizer).expanduser()
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        return [file_stamp(p, str(p.relative_to(path)) if path.is_dir() else p.name) for p in files]
    if not looks_like_hub_name(tokenizer):
        raise PrepareError(f"tokenizer path {tokenizer!r} does not exist")
    return [f"hub:{tokenizer}"]


def _fingerprint(value: Any) -> str:
    return hashlib.blake2b(json.dumps(value).encode(), digest_size=16).hexdigest()


def _replace_hint() -> str:
    return f"pass {option('overwrite', True)} to replace them, or choose another {option('output')}"


def _check_output(output: Path, fingerprint: str, names: str, overwrite: bool) -> ShardMetadata | None:
    """The finished output of this very run, if there is one; refuses to replace another corpus."""
    if (output / METADATA_FILE).exists():
        existing = ShardMetadata.read(output)
        if existing.source_fingerprint == fingerprint:
            return existing
        if existing.extra.get("inputs_fingerprint") == names:
            log.info("the inputs of %s changed since it was prepared; preparing it again", output)
        elif not overwrite:
            raise PrepareError(
                f"{output} already holds shards of other inputs or options (tokenizer {existing.tokenizer!r}, "
                f"{existing.num_documents} documents); {_replace_hint()}"
            )
    elif not overwrite and output.is_dir():
        # Hidden entries are runs' temporary folders, not someone's data.
        held = sorted(p.name for p in output.iterdir() if not p.name.startswith("."))
        if held:
            parts = any(name.startswith("part-") for name in held)
            what = "prepared parts" if parts else f"files that are not a finished prepare output ({held[:3]})"
            raise PrepareError(f"{output} already holds {what}; {_replace_hint()}")
    return None


def _partial_directory(output: Path) -> Path:
    """A temporary sibling of ``output``, removed or renamed into place when the run ends."""
    host = socket.gethostname()
    for stale in output.parent.glob(f".{output.name}.partial-{host}-*"):
        pid = int(stale.name.rsplit("-", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("removing %s, left by an interrupted run", stale)
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            pass
    return output.parent / f".{output.name}.partial-{host}-{os.getpid()}"


def _upload(partial: Path, output: Path) -> None:
    """Upload the finished ``partial`` to the remote folder ``output``, ``metadata.json`` last: a reader
    finds no metadata, so no part, until every shard is there. What was there before goes first."""
    fs, root = output.fs, output.path.rstrip("/")
    if fs.exists(root):
        fs.rm(root, recursive=True)
    files = sorted(p for p in partial.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name == METADATA_FILE)  # stable: the metadata moves to the end
    from tqdm.auto import tqdm

    for path in tqdm(files, desc=f"uploading to {output}", unit="file", disable=len(files) < 2):
        fs.put_file(str(path), f"{root}/{path.relative_to(partial).as_posix()}")


def _publish(partial: Path, output: Path) -> None:
    """Rename the finished ``partial`` to ``output``, replacing what was there (with --overwrite)."""
    if is_url(str(output)):
        _upload(partial, output)
        return
    if output.exists():
        replaced = output.parent / f".{output.name}.replaced-{os.getpid()}"
        output.rename(replaced)
        partial.rename(output)
        shutil.rmtree(replaced)
    else:
        partial.rename(output)


def prepare(
    inputs: Sequence[str] | Corpus,
    output: str | Path,
    tokenizer: str,
    text_field: str = "text",
    num_proc: int | None = None,
    shard_tokens: int = 100_000_000,
    split: str = "train",
    *,
    glob: str | None = None,
    add_bos: bool = False,
    separator: str | None = "eos",
    on_bad_row: str = "raise",
    keep_empty_documents: bool = False,
    overwrite: bool = False,
    num_parts: int = 1,
    part_index: int = 0,
    storage_options: dict[str, Any] | None = None,
) -> ShardMetadata:
    """Tokenize ``inputs`` (paths or hub names, or a ``Corpus``) into ``output`` (or its part
    directory); returns the metadata written.

    A finished output of the same inputs and options is returned untouched; one of other inputs or
    options is refused unless ``overwrite``. ``output`` may be a URL (``s3://bucket/corpus``, with
    ``storage_options``): the output is written in a local temporary folder, then uploaded with its
    ``metadata.json`` last, so a reader never takes half an upload for a part. Inputs may be URLs
    too, read with the same ``storage_options``. ``separator`` is a ``DocumentTokenizer``'s: ``None``
    (a caller that offers no choice of it, such as ``HFTextDataModule``) is the EOS, as ``"eos"`` is.
    """
    num_proc = num_proc or min(os.cpu_count() or 1, 8)
    for name, value in (("num_proc", num_proc), ("shard_tokens", shard_tokens), ("num_parts", num_parts)):
        require_int(name, value, 1, error=PrepareError)
    if not 0 <= part_index < num_parts:
        raise PrepareError(f"{option('part_index')} must be in [0, {num_parts}), got {part_index}")
    bad_rows = BadRows(on_bad_row, keep_empty=keep_empty_documents)
    corpus = (
        inputs
        if isinstance(inputs, Corpus)
        else resolve_inputs(list(inputs), split=split, glob=glob, storage_options=storage_options)
    )
    if num_parts > 1:
        corpus = corpus.part(part_index, num_parts)
    try:
        root = storage_path(output, storage_options if is_url(output) else None)
    except (ImportError, ValueError) as err:
        raise PrepareError(str(err)) from None
    output = root / PART_DIRECTORY.format(part_index) if num_parts > 1 else root
    if num_parts > 1 and (root / METADATA_FILE).exists() and not overwrite:
        raise PrepareError(f"{root} already holds a corpus prepared in one part; {_replace_hint()}")
    ending = separator or "eos"  # None ends documents as "eos" does: one output, one fingerprint
    options = [FORMAT_VERSION, text_field, shard_tokens, split, add_bos, ending, on_bad_row, num_parts, part_index]
    options += ["keep_empty_documents"] if keep_empty_documents else []
    # What the output is of (inputs by name, tokenizer, options), and that plus the inputs' sizes and
    # times: the same corpus re-prepared after an edit is replaced, another corpus is refused.
    names = _fingerprint([options, tokenizer, corpus.names()])
    fingerprint = _fingerprint([options, tokenizer_identity(tokenizer), corpus.identity()])
    existing = _check_output(output, fingerprint, names, overwrite)
    if existing is not None:
        log.info("%s is up to date (%d tokens); nothing to do", output, existing.num_tokens)
        return existing

    document_tokenizer = DocumentTokenizer(tokenizer, add_bos=add_bos, separator=separator)
    if is_url(output):
        partial = Path(tempfile.mkdtemp(prefix=f"prepare-{output.name}-"))
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = _partial_directory(output)
    try:
        metadata = _write(corpus, text_field, bad_rows, document_tokenizer, num_proc, partial, shard_tokens)
        metadata.source_fingerprint = fingerprint
        metadata.extra = {"part_index": part_index, "num_parts": num_parts, "add_bos": add_bos, "separator": ending}
        metadata.extra.update(bad_rows_skipped=bad_rows.count, empty_documents_skipped=bad_rows.empty)
        metadata.extra.update(inputs_fingerprint=names)
        metadata.write(partial)
        _publish(partial, output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if bad_rows.count:
        log.warning("skipped %d rows without text, e.g. %s", bad_rows.count, "; ".join(bad_rows.examples[:3]))
    empty = f" (skipped {bad_rows.empty} empty documents)" if bad_rows.empty else ""
    log.info("wrote %d tokens in %d documents to %s%s", metadata.num_tokens, metadata.num_documents, output, empty)
    return metadata


def tokenize_to_memory(
    corpus: Corpus, tokenizer: str, text_field: str = "text", add_bos: bool = False, on_bad_row: str = "raise"
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``(tokens, document_starts, vocabulary)`` of a small corpus (an evaluation set), in this process."""
    document_tokenizer = DocumentTokenizer(tokenizer, add_bos=add_bos)
    bad_rows = BadRows(on_bad_row)
    parts = list(tokenized(document_batches(corpus, text_field, bad_rows), document_tokenizer, num_proc=1))
    if not parts:
        raise PrepareError(f"no documents in the inputs: {corpus.describe()}")
    if bad_rows.count or bad_rows.empty:
        log.warning(
            "evaluation set %s: skipped %d rows without text and %d empty documents",
            corpus.describe(),
            bad_rows.count,
            bad_rows.empty,
        )
    tokens = np.concatenate([t for t, _ in parts])
    lengths = np.concatenate([n for _, n in parts])
    log.info("tokenized the evaluation set %s: %d tokens in %d documents", corpus.describe(), len(tokens), len(lengths))
    return tokens, np.cumsum(lengths) - lengths, evaluation_vocabulary(tokenizer, document_tokenizer)


def evaluation_vocabulary(tokenizer: str, document_tokenizer: DocumentTokenizer) -> dict[str, Any]:
    """What an evaluation set held in memory says of its tokens, for the checks against training's."""
    return {
        "tokenizer": tokenizer,
        "eos_id": document_tokenizer.separator_id,
        "tokenizer_hash": document_tokenizer.content_hash,
    }


def _write(
    corpus: Corpus,
    text_field: str,
    bad_rows: BadRows,
    tokenizer: DocumentTokenizer,
    num_proc: int,
    directory: Path,
    shard_tokens: int,
) -> ShardMetadata:
    from tqdm.auto import tqdm

    from datamodules.text.shard_writer import ShardWriter

    writer = ShardWriter(directory, tokenizer.dtype, shard_tokens)
    max_id = -1
    started = time.perf_counter()
    with tqdm(unit="doc", desc="tokenizing", unit_scale=True) as bar:
        for tokens, lengths in tokenized(document_batches(corpus, text_field, bad_rows), tokenizer, num_proc):
            writer.add(tokens, lengths)
            max_id = max(max_id, int(tokens.max()))
            bar.update(len(lengths))
            bar.set_postfix(tokens=writer.num_tokens, refresh=False)
    metadata = writer.close()
    if metadata.num_documents == 0:
        empty = f" ({bad_rows.empty} empty documents skipped)" if bad_rows.empty else ""
        raise PrepareError(f"no documents in the inputs: {corpus.describe()}{empty}")
    log.info("tokenized at %.0f tokens/s", metadata.num_tokens / max(time.perf_counter() - started, 1e-9))
    metadata.tokenizer, metadata.eos_id, metadata.max_token_id = tokenizer.name, tokenizer.separator_id, max_id
    metadata.bos_id, metadata.tokenizer_hash = tokenizer.bos_id, tokenizer.content_hash
    return metadata


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=program_name("datamodules.text.prepare"), description=__doc__)
    parser.add_argument("inputs", nargs="+", help="files, directories, a save_to_disk folder or a hub name")
    parser.add_argument("--output", required=True, help="directory for shards and metadata.json")
    parser.add_argument("--tokenizer", required=True, help="tokenizer name or local path (AutoTokenizer)")
    parser.add_argument("--text-field", default="text", help="column or JSON key holding the text (default: text)")
    parser.add_argument("--glob", help="files of an input directory to read (default: all), e.g. '**/*.jsonl.gz'")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: CPU count, max 8)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    parser.add_argument("--split", default="train", help="split of a hub or saved dataset (default: train)")
    parser.add_argument("--add-bos", action="store_true", help="start every document with the BOS token")
    parser.add_argument("--separator", default="eos", help="token ending every document (default: eos)")
    parser.add_argument("--on-bad-row", choices=("raise", "skip"), default="raise", help="rows without text")
    parser.add_argument(
        "--keep-empty-documents", action="store_true", help="keep empty texts as separator-only documents"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an output of other inputs or options")
    parser.add_argument("--num-parts", type=int, default=1, help="split the inputs into this many parts ...")
    parser.add_argument("--part-index", type=int, default=0, help="... and prepare this one into output/part-0000i")
    parser.add_argument(
        "--storage-options", type=json.loads, default=None, help="for URL inputs or --output: fsspec options as JSON"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        with options_as_flags():
            prepare(
                args.inputs,
                args.output,
                args.tokenizer,
                args.text_field,
                args.num_proc,
                args.shard_tokens,
                args.split,
                glob=args.glob,
                add_bos=args.add_bos,
                separator=args.separator,
                on_bad_row=args.on_bad_row,
                keep_empty_documents=args.keep_empty_documents,
                overwrite=args.overwrite,
                num_parts=args.num_parts,
                part_index=args.part_index,
                storage_options=args.storage_options,
            )
    except PrepareError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


if __name__ == "__main__":
    main()
