"""Conversations to training rows: ``python -m datamodules.chat.prepare_conversations``.

Reads ShareGPT (``conversations: [{from, value}]``) or OpenAI (``messages: [{role, content}]``)
conversations from JSON / JSON-lines / parquet files, a ``save_to_disk`` folder or a hub name, renders
each with the tokenizer's chat template and writes what speculators' ``prepare-data`` writes and our
``generate`` and ``HiddenStatesDataModule`` read: a ``save_to_disk`` folder of ``input_ids``,
``loss_mask`` (1 exactly on assistant-turn tokens) and ``seq_len``. Output is written under a temporary
name and renamed when complete; a re-run on the same inputs and settings returns at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute

from datamodules.plan.arguments import option, options_as_flags, program_name, require_int
from datamodules.plan.chat_tokens import (  # noqa: F401  (re-exported: the chat family's names)
    FORMATS,
    ROLES,
    TEXT_PARTS,
    ConversationError,
    ConversationTokenizer,
    content_of,
    messages_of,
    template_text,
)
from datamodules.plan.hf_loading import load_split, one_line

log = logging.getLogger(__name__)

MANIFEST = "prepare_conversations.json"
FORMAT_VERSION = 2  # 2: content parts as text, conversations with a turn without content left out


# Why a conversation is left out: its code in the ``dropped`` column, and the count that tells it.
NO_ASSISTANT, NO_CONTENT = 1, 2
DROPPED = {NO_ASSISTANT: "dropped_no_assistant", NO_CONTENT: "dropped_no_content"}
FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
        "truncated": datasets.Value("bool"),
        "dropped": datasets.Value("int8"),
    }
)


def _tokenize(
    batch: dict[str, list],
    indices: list[int],
    tokenizer: ConversationTokenizer,
    max_len: int | None,
    system_prompt: str | None,
    name: str,
) -> dict[str, list]:
    """The rows of a batch of conversations, one per conversation; one left out (no content, or no assistant
    token after truncation) has no tokens and its ``DROPPED`` code. A malformed row is an error naming it."""
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    conversations = []
    for index, row in zip(indices, rows, strict=True):
        try:
            conversations.append(messages_of(row, system_prompt, tokenizer.content_lists))
        except ConversationError as err:
            raise ConversationError(f"{name} row {index}: {err}") from None
    tokenized = iter(tokenizer([c for c in conversations if c is not None]))
    out: dict[str, list] = {key: [] for key in FEATURES}
    for messages in conversations:
        ids, mask = next(tokenized) if messages is not None else ([], [])
        truncated = max_len is not None and len(ids) > max_len
        if truncated:
            ids, mask = ids[:max_len], mask[:max_len]
        dropped = NO_CONTENT if messages is None else 0 if any(mask) else NO_ASSISTANT
        out["dropped"].append(dropped)
        out["truncated"].append(truncated and not dropped)
        out["input_ids"].append([] if dropped else ids)
        out["loss_mask"].append([] if dropped else mask)
        out["seq_len"].append(0 if dropped else len(ids))
    return out


def _fingerprint(inputs: Sequence[str], tokenizer: str, template: str, max_len: int | None, **more: Any) -> str:
    stamps = []
    for name in inputs:
        path = Path(name)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        stamps += [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" if p.exists() else str(p) for p in files]
    identity = {"version": FORMAT_VERSION, "inputs": stamps, "tokenizer": tokenizer, "template": template}
    identity["max_len"] = max_len
    identity.update({k: v for k, v in more.items() if v is not None})  # set options only: old keys stay valid
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()


BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _load(inputs: Sequence[str], split: str | None = None) -> list[Any]:
    """The conversations: one ``save_to_disk`` folder or hub name (its ``split``; ``None``: a folder's
    one dataset, a hub dataset's ``train``), or JSON / JSON-lines / parquet files, each loaded on its
    own (files in the two formats have different columns)."""
    if len(inputs) == 1 and not Path(inputs[0]).is_file() and Path(inputs[0]).suffix not in BUILDERS:
        return [load_split(inputs[0], split, error=ConversationError)]
    if split is not None:
        raise ConversationError(
            f"{option('split', split)} names a split of a hub dataset or saved DatasetDict, not of files"
        )
    for name in inputs:
        if not Path(name).is_file():
            raise ConversationError(f"no such input file {name!r}")
        if Path(name).suffix not in BUILDERS:
            raise ConversationError(f"input {name!r} is not one of {sorted(BUILDERS)}")
    return [_load_file(name) for name in inputs]


def _load_file(name: str) -> Any:
    builder = BUILDERS[Path(name).suffix]
    try:
        return load_split(builder, "train", data_files=[name], error=ConversationError)
    except ConversationError:
        malformed = _malformed_json(Path(name)) if builder == "json" else None
        if malformed is None:
            raise
        raise ConversationError(f"{name} {malformed}") from None


def _malformed_json(path: Path) -> str | None:
    """Where a JSON-lines file (or a JSON file) stops being JSON, ``"line N is not JSON: why"``; ``None``
    when it parses (``datasets``' own error does not tell the line)."""
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                if number > 1:
                    return f"line {number} is not JSON: {err.msg} (column {err.colno})"
                break  # the first line alone is not JSON: a JSON document over several lines
        else:
            return None
    try:
        json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        return f"line {err.lineno} is not JSON: {err.msg} (column {err.colno})"
    return None


def _report(counts: dict[str, int], target: Path, first_without_content: str | None = None) -> None:
    """The counts of a prepared folder: a warning when conversations were left out, where a plain script
    sees it (as bad samples are), else a line at INFO."""
    log.info(
        "%s: %d conversations (%d tokens), %d of them truncated",
        target,
        counts["conversations"],
        counts["tokens"],
        counts["truncated"],
    )
    no_assistant, no_content = counts["dropped_no_assistant"], counts["dropped_no_content"]
    if no_assistant or no_content:
        log.warning(
            "%s: %d conversations left out: %d without an assistant token (none, or none within max_len), %d with a "
            "turn whose content is null or missing%s",
            target,
            no_assistant + no_content,
            no_assistant,
            no_content,
            f" (the first: {first_without_content})" if first_without_content else "",
        )


def prepare_conversations(
    inputs: str | Sequence[str],
    tokenizer: str,
    output: str,
    max_len: int | None = None,
    num_proc: int = 1,
    chat_template: str | None = None,
    overwrite: bool = False,
    split: str | None = None,
    system_prompt: str | None = None,
) -> dict[str, int]:
    """Render, tokenize and mask ``inputs`` into the ``save_to_disk`` folder ``output``.

    Args:
        inputs: JSON / JSON-lines / parquet files, or one ``save_to_disk`` folder or hub name.
        tokenizer: a ``transformers`` tokenizer (hub name or local path) with a chat template.
        output: the folder written (``input_ids``, ``loss_mask``, ``seq_len``).
        max_len: conversations are truncated to this many tokens; default: kept whole.
        num_proc: tokenizer processes (``datasets.map``).
        chat_template: a Jinja chat template replacing the tokenizer's, or a file holding one.
        overwrite: replace an ``output`` prepared from other inputs or settings instead of refusing.
        split: the split of a hub dataset or saved ``DatasetDict`` (default: a folder's one dataset).
        system_prompt: a system turn opening every conversation that has none.

    Contents: text, or a list of content parts (see ``content_of``). A conversation is left out, counted
    and warned about when it has no assistant token (none, or none left by ``max_len``) or a turn whose
    content is ``null`` or missing; a malformed row is an error naming the file and the row.

    Returns ``{"conversations": kept, "dropped_no_assistant": ..., "dropped_no_content": ..., "truncated": ...,
    "tokens": ...}``.
    """
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    if max_len is not None:
        require_int("max_len", max_len, 1, ConversationError)
    require_int("num_proc", num_proc, 1, ConversationError)
    conversation_tokenizer = ConversationTokenizer(tokenizer, chat_template)
    template = conversation_tokenizer.tokenizer.chat_template
    fingerprint = _fingerprint(inputs, tokenizer, template, max_len, split=split, system_prompt=system_prompt)
    target = Path(output)
    manifest = target / MANIFEST
    if manifest.is_file():
        done = json.loads(manifest.read_text())
        if done.get("fingerprint") == fingerprint:
            _report(done["counts"], target)
            return done["counts"]
        if not overwrite:
            raise ConversationError(f"{target} holds conversations prepared from other inputs or settings; "
                                    f"pass {option('overwrite', True)} to replace them")  # fmt: skip
    elif target.exists() and any(target.iterdir()) and not overwrite:
        raise ConversationError(
            f"{target} exists and was not written by prepare_conversations; pass {option('overwrite', True)}"
        )
    parts, sources = [], _load(inputs, split)
    for name, source in zip(inputs, sources, strict=True):
        columns = source.column_names
        if not {"messages", "conversations"} & set(columns):
            raise ConversationError(f"{name} has no 'messages' or 'conversations' column; it has {columns}")
        try:
            parts.append(
                source.map(
                    _tokenize,
                    with_indices=True,
                    batched=True,
                    batch_size=256,
                    num_proc=num_proc if num_proc > 1 else None,
                    remove_columns=columns,
                    features=FEATURES,
                    fn_kwargs={
                        "tokenizer": conversation_tokenizer,
                        "max_len": max_len,
                        "system_prompt": system_prompt,
                        "name": name,
                    },
                    desc=f"rendering {Path(name).name}",
                )
            )
        except ConversationError:
            raise
        except Exception as err:  # a worker's error arrives wrapped: tell its first line
            raise ConversationError(f"cannot prepare {name}: {one_line(err)}") from None
    # Read from Arrow: iterating a column goes row by row through the formatter.
    dropped = [np.asarray(part.data.column("dropped"), dtype=np.int8) for part in parts]
    rows = datasets.concatenate_datasets(
        [
            part if not codes.any() else part.select(np.flatnonzero(codes == 0))
            for part, codes in zip(parts, dropped, strict=True)
        ]
    )
    counts = {
        "conversations": len(rows),
        **{key: sum(int((codes == code).sum()) for codes in dropped) for code, key in DROPPED.items()},
        "truncated": int(pyarrow.compute.sum(rows.data.column("truncated")).as_py() or 0),
        "tokens": int(pyarrow.compute.sum(rows.data.column("seq_len")).as_py() or 0),
    }
    if not counts["conversations"]:
        raise ConversationError(
            f"no conversation of {', '.join(inputs)} is left to train on: {counts['dropped_no_assistant']} without "
            f"an assistant token, {counts['dropped_no_content']} with a turn whose content is "
            "null or missing"
        )
    first_without_content = next(
        (f"{name} row {int(np.flatnonzero(codes == NO_CONTENT)[0])}"
         for name, codes in zip(inputs, dropped, strict=True) if (codes == NO_CONTENT).any()),
        None,
    )  # fmt: skip
    kept = rows.remove_columns(["truncated", "dropped"])
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    kept.save_to_disk(str(partial))
    (partial / MANIFEST).write_text(json.dumps({"fingerprint": fingerprint, "counts": counts}, indent=1))
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    _report(counts, target, first_without_content)
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=program_name("datamodules.chat.prepare_conversations"), description=__doc__.split("\n")[0]
    )
    parser.add_argument("inputs", nargs="+", help="JSON/JSONL/parquet files, or a save_to_disk folder or hub name")
    parser.add_argument("--tokenizer", required=True, help="a transformers tokenizer with a chat template")
    parser.add_argument("--output", required=True, help="the save_to_disk folder to write")
    parser.add_argument("--max-len", type=int, help="truncate conversations to this many tokens")
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--chat-template", help="a Jinja chat template to use instead, or a file holding one")
    parser.add_argument("--overwrite", action="store_true", help="replace an output prepared from other inputs")
    parser.add_argument("--split", help="the split of a hub dataset or saved DatasetDict")
    parser.add_argument("--system-prompt", help="a system turn for conversations that have none")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        with options_as_flags():
            prepare_conversations(
                args.inputs,
                args.tokenizer,
                args.output,
                args.max_len,
                args.num_proc,
                args.chat_template,
                args.overwrite,
                args.split,
                args.system_prompt,
            )
    except (ConversationError, OSError) as err:
        raise SystemExit(f"prepare_conversations: {one_line(err)}") from None


if __name__ == "__main__":
    main()
