"""Conversations rendered by a chat template into token ids and an assistant mask: the turns of a
row in either common format (``messages``/``conversations``), their contents as the template takes
them, and ``ConversationTokenizer``. Shared by the chat family (``prepare_conversations``) and the
vision family (conversations with images)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datamodules.plan.arguments import option
from datamodules.plan.hf_loading import load_pretrained

FORMATS = {"messages": ("role", "content"), "conversations": ("from", "value")}  # turns: role and text keys
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Content parts whose ``text`` is text (OpenAI's chat and responses APIs); any other part (an image, audio) is not.
TEXT_PARTS = ("text", "input_text", "output_text")


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

    def __init__(self, tokenizer: str | Any, chat_template: str | None = None) -> None:
        """``tokenizer``: a name or path, or a loaded tokenizer (a processor's)."""
        self.name = tokenizer if isinstance(tokenizer, str) else tokenizer.name_or_path
        if isinstance(tokenizer, str):
            tokenizer = load_pretrained("tokenizer", tokenizer, ConversationError)
        self.tokenizer = tokenizer
        if chat_template is not None:
            self.tokenizer.chat_template = template_text(chat_template)
        if not self.tokenizer.chat_template:
            raise ConversationError(
                f"tokenizer {self.name!r} has no chat template; give one with {option('chat_template')} "
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
