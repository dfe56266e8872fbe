"""Conversations whose messages hold images (``{"type": "image"}`` content parts, as processors'
chat templates take them): their turns, and their token ids rendered by the chat template with each
image's run of placeholders in place and labels on the assistant's tokens only."""

from __future__ import annotations

from typing import Any

from datamodules.plan.bad_samples import BadSample
from datamodules.plan.chat_tokens import ConversationError, ConversationTokenizer, messages_of
from datamodules.vision.interleaved_text import InterleavedText


def chat_parts(messages: Any, images: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """A row's turns (OpenAI ``messages``, or ShareGPT ``conversations`` turns) with their content
    parts, and its images, one for each image part, in order."""
    sharegpt = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict) and "from" in messages[0]
    try:
        turns = messages_of({"conversations" if sharegpt else "messages": messages}, content_lists=True)
    except ConversationError as err:
        raise BadSample(str(err)) from None
    if turns is None:
        raise BadSample("a turn has no content")
    if not isinstance(images, list):
        raise BadSample(f"its images are a {type(images).__name__}, not a list")
    parts = sum(1 for m in turns if isinstance(m["content"], list) for p in m["content"] if p.get("type") == "image")
    if parts != len(images):
        raise BadSample(f"its messages hold {parts} image parts for {len(images)} images")
    if not any(m["role"] == "assistant" for m in turns):
        raise BadSample("it has no assistant turn to learn")
    return turns, images


class ConversationText(InterleavedText):
    """``InterleavedText`` for conversations: rendered by ``chat_template`` (a processor's; ``None``:
    the tokenizer's own) with ``ConversationTokenizer``, which also gives the assistant's tokens;
    labels are on those only (never on a placeholder, the prompt or padding). The template's own
    tokens end each turn: no EOS is added.

    Args:
        tokenizer, name, max_text_len, num_image_tokens, image_token: see ``InterleavedText``.
        chat_template: the Jinja template, rendering image parts (the image token for each).
    """

    def __init__(
        self,
        tokenizer: Any,
        name: str,
        max_text_len: int,
        num_image_tokens: int | None,
        image_token: str,
        chat_template: str | None = None,
    ) -> None:
        super().__init__(tokenizer, name, max_text_len, num_image_tokens, image_token)
        try:
            self.chat = ConversationTokenizer(tokenizer, chat_template)
        except ConversationError as err:
            raise ValueError(str(err)) from None
        if not self.chat.content_lists:
            raise ValueError(
                f"the chat template of {name!r} does not render content parts (lists of {{'type': ...}}), so it "
                "cannot place images: give a processor or a tokenizer whose template does"
            )

    def render(self, parts: Any) -> str:
        return self.chat.render(parts)

    def _token_lists(self, documents: list[Any]) -> list[tuple[list[int], list[bool]] | BadSample]:
        try:
            rows = self.chat(documents)
        except Exception:  # one conversation the template refuses: each on its own, to name it
            return [self._one(messages) for messages in documents]
        return [(list(ids), [bool(m) for m in mask]) for ids, mask in rows]

    def _one(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]] | BadSample:
        try:
            ((ids, mask),) = self.chat([messages])
        except Exception as err:  # the template's own error (Jinja raises its own types)
            return BadSample(f"the chat template fails on it: {err}")
        return list(ids), [bool(m) for m in mask]
