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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute

from datamodules.plan.arguments import option, options_as_flags, program_name, require_int
from datamodules.plan.hf_loading import load_pretrained, load_split, one_line

log = logging.getLogger(__name__)

FORMATS = {"messages": ("role", "content"), "conversations": ("from", "value")}  # turns: role and text keys
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Content parts whose ``text`` is text (OpenAI's chat and responses APIs); any other part (an image, audio) is not.
TEXT_PARTS = ("text", "input_text", "output_text")
MANIFEST = "prepare_conversations.json"
FORMAT_VERSION = 2  # 2: content parts as text, conversations with a turn without content left out


class ConversationError(ValueError):
    """A conversation, input or setting that cannot be prepared, named in one line."""


def template_text(chat_template: str | None) -> str | None:
    """The Jinja text of ``chat_template``, given as a template (it holds a Jinja tag) or as a file holding
    one; a value that is neither is refused as a missing file (it is almost always a mistyped path)."""
    if chat_template is None or "{%" in chat_template or "{{" in chat_template:
        return chat_template
    try:
        return Path(chat_template).expanduser().read_text()
    except OSError:  # missing, a folder, a name too long for a path
        # A path is shown whole (its end names the file); a long text that is no template, cut.
        shown = chat_template if len(chat_template) <= 300 and "\n" not in chat_template else f"{chat_template[:80]}..."
        raise ConversationError(
            f"{option('chat_template')} {shown!r} is no file, nor a Jinja template (no {{% or {{{{ in it)"
        ) from None


def content_of(content: Any, lists: bool) -> str | list[dict[str, Any]]:
    """A turn's content as the chat template takes it: text as it is; a list of content parts (OpenAI's
    ``[{"type": "text", "text": ...}]``, or plain strings) passed on as text parts when the template renders
    lists (``lists``, as a processor passes them), else their texts joined by a newline, as vLLM's chat API
    does for a template that takes text only (so the rows equal what that server renders); a part that is
    not text (an image, audio) only to a template that renders lists."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversationError(f"content must be text or a list of content parts, got {content!r}")
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, dict):
            raise ConversationError(f"a content part must be text or an object, got {part!r}")
        if part.get("type") in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise ConversationError(f"a {part['type']!r} content part has no text: {part}")
            part = {"type": "text", "text": part["text"]}
        elif not lists:
            kind = part.get("type") or sorted(k for k, v in part.items() if v is not None)
            raise ConversationError(
                f"a content part of type {kind!r} is not text, and the chat template renders text contents only "
                f"(text parts are joined; accepted types: {list(TEXT_PARTS)})"
            )
        parts.append(part)
    return parts if lists else "\n".join(part["text"] for part in parts)


def messages_of(
    row: dict[str, Any], system_prompt: str | None = None, content_lists: bool = False
) -> list[dict[str, Any]] | None:
    """A row's turns as ``[{role, content}]``, from either format; roles mapped to user/assistant/system;
    ``system_prompt`` opens a conversation that has no system turn. Contents: see ``content_of``
    (``content_lists``: the template renders lists). ``None`` when a turn has no content (``null`` or
    missing): such a conversation is left out and counted, as one without an assistant turn is."""
    column = next((c for c in FORMATS if row.get(c) is not None), None)
    if column is None:
        given = sorted(k for k, v in row.items() if v is not None)
        raise ConversationError(f"the row has neither 'messages' nor 'conversations': it has {given}")
    turns, (role_key, text_key) = row[column], FORMATS[column]
    if not isinstance(turns, list):
        raise ConversationError(f"{column!r} must be a list of turns, got {turns!r}")
    messages = []
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ConversationError(f"turn {number} is not an object: {turn!r}")
        if turn.get(role_key) is None:
            given = sorted(k for k, v in turn.items() if v is not None)
            hint = "; ShareGPT turns ({from, value}) go in 'conversations'" if "from" in given else ""
            raise ConversationError(f"turn {number} has no {role_key!r}: it has {given}{hint}")
        role = ROLES.get(turn[role_key])
        if role is None:
            raise ConversationError(f"turn {number}: unknown role {turn[role_key]!r}; accepted: {sorted(ROLES)}")
        if turn.get(text_key) is None:
            return None
        messages.append({"role": role, "content": content_of(turn[text_key], content_lists)})
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


class ConversationTokenizer:
    """Token ids and assistant mask of conversations, by the tokenizer's chat template.

    With ``{% generation %}`` markers in the template, the mask is ``transformers``' own
    (``return_assistant_tokens_mask``). Without, each assistant turn's span is where the rendering of
    the conversation through that turn extends the rendering of the turns before it plus the
    generation prompt; tokens starting inside a span are the turn's (character offsets of the fast
    tokenizer), which is what speculators obtains from vLLM's render endpoint.

    Those prefix renderings cost one template run per turn boundary. A template that writes each
    message's content verbatim, once, around a scaffold that depends on the roles only (most do) needs
    them once per sequence of roles: rendered with placeholder contents (``_Scaffold``), every prefix's
    length is the scaffold's plus the lengths of the contents it holds. Each conversation's own full
    rendering is checked against that (its length, and each content where the scaffold puts it); one
    that does not match is rendered prefix by prefix.
    """

    def __init__(self, tokenizer: str, chat_template: str | None = None) -> None:
        self.name = tokenizer
        self.tokenizer = load_pretrained("tokenizer", tokenizer, ConversationError)
        if chat_template is not None:
            self.tokenizer.chat_template = template_text(chat_template)
        if not self.tokenizer.chat_template:
            raise ConversationError(
                f"tokenizer {tokenizer!r} has no chat template; give one with {option('chat_template')} "
                "(a Jinja template or a file holding one)"
            )
        self.marked = "{% generation %}" in self.tokenizer.chat_template
        # The generation prompt's length: what it adds after a turn.
        probe = [{"role": "user", "content": "x"}]
        self._prompt = len(self.render(probe, True)) - len(self.render(probe))
        self._scaffolds: dict[tuple[str, ...], _Scaffold | None] = {}
        self.content_lists = self._renders_content_lists()

    def render(self, messages: list[dict[str, Any]], prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    def _renders_content_lists(self) -> bool:
        """Whether the template renders a content given as a list of text parts as its text (each part's text
        once, no Python or JSON rendering of the list), as multimodal templates do; one that fails on it
        (or on the probe's system turn) takes contents as text."""
        marks = [f"\ue000{i}\ue001" for i in range(3)]  # private-use characters: no template writes them
        probe = [
            {"role": role, "content": [{"type": "text", "text": mark}]}
            for role, mark in zip(("system", "user", "assistant"), marks, strict=True)
        ]
        try:
            text = self.render(probe)
        except Exception:
            return False
        return all(text.count(mark) == 1 for mark in marks) and "'type'" not in text and '"type"' not in text

    def __call__(self, conversations: list[list[dict[str, Any]]]) -> list[tuple[list[int], list[int]]]:
        """``(input_ids, loss_mask)`` of each conversation."""
        if not conversations:  # a batch whose every conversation was left out
            return []
        if self.marked:
            out = self.tokenizer.apply_chat_template(
                conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return list(zip(out["input_ids"], out["assistant_masks"], strict=True))
        texts = self.tokenizer.apply_chat_template(conversations, tokenize=False)
        spans = [self._spans(messages, text) for messages, text in zip(conversations, texts, strict=True)]
        encodings = self.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        rows = []
        for encoding, text, turns in zip(encodings, texts, spans, strict=True):
            mask = [0] * len(encoding.ids)
            for a, b in turns:
                first, stop = _first_token_from(encoding, a, len(text)), _first_token_from(encoding, b, len(text))
                mask[first:stop] = [1] * (stop - first)
            rows.append((encoding.ids, mask))
        return rows

    def _spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """The character spans of ``messages``' assistant turns in their rendering ``text``."""
        roles = tuple(m["role"] for m in messages)
        if not roles:
            return []
        if roles not in self._scaffolds:
            try:
                self._scaffolds[roles] = _Scaffold.of(self, roles)
            except Exception:  # a template that refuses placeholders: the conversation itself decides
                self._scaffolds[roles] = None
        scaffold = self._scaffolds[roles]
        # The scaffold places text contents; one of content parts is rendered prefix by prefix.
        if scaffold is not None and all(isinstance(m["content"], str) for m in messages):
            spans = scaffold.spans([m["content"] for m in messages], text, self._prompt)
            if spans is not None:
                return spans
        spans = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                # A conversation opening with an assistant turn has no turns before it to render.
                start = len(self.render(messages[:i], True)) if i else self._prompt
                spans.append((start, len(self.render(messages[: i + 1]))))
        return spans


def _first_token_from(encoding: Any, char: int, length: int) -> int:
    """The first token of ``encoding`` that starts at or after character ``char``: a token starting in a
    span belongs to it (``transformers``' offsets rule for masks, as the character offsets of a fast
    tokenizer give it)."""
    for at in range(char, length):
        token = encoding.char_to_token(at)
        if token is not None:
            return token if encoding.token_to_chars(token)[0] >= char else token + 1
    return len(encoding.ids)


@dataclass
class _Scaffold:
    """A chat template's rendering of one sequence of roles with every content empty: where each content
    goes in the full rendering, its length, and each assistant turn's span ends ``(turn, start, end)``
    (``start`` ``None`` for an opening turn, whose span starts after the generation prompt)."""

    content_starts: list[int]
    length: int
    turns: list[tuple[int, int | None, int]]

    @classmethod
    def of(cls, tokenizer: ConversationTokenizer, roles: tuple[str, ...]) -> _Scaffold | None:
        """``None`` when the template does not write each (placeholder) content once, verbatim, in order."""
        marks = [f"\ue000{i:06d}\ue001" for i in range(len(roles))]  # private-use characters, equal widths
        width = len(marks[0]) if marks else 0
        messages = [{"role": role, "content": mark} for role, mark in zip(roles, marks, strict=True)]
        text = tokenizer.render(messages)
        starts = [text.find(mark) for mark in marks]
        if any(text.count(mark) != 1 for mark in marks) or starts != sorted(starts):
            return None
        turns = []
        for i, role in enumerate(roles):
            if role == "assistant":
                start = len(tokenizer.render(messages[:i], True)) - i * width if i else None
                turns.append((i, start, len(tokenizer.render(messages[: i + 1])) - (i + 1) * width))
        return cls([at - i * width for i, at in enumerate(starts)], len(text) - len(marks) * width, turns)

    def spans(self, contents: list[str], text: str, prompt: int) -> list[tuple[int, int]] | None:
        """The assistant spans of a conversation with ``contents`` rendered as ``text``; ``None`` when
        ``text`` is not this scaffold around those contents."""
        before = [0]  # the length of the contents before each message
        for content in contents:
            before.append(before[-1] + len(content))
        if len(text) != self.length + before[-1]:
            return None
        places = zip(contents, self.content_starts, before[:-1], strict=True)
        if not all(text.startswith(content, at + offset) for content, at, offset in places):
            return None
        return [(prompt if a is None else a + before[i], b + before[i + 1]) for i, a, b in self.turns]


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
