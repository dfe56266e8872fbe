"""Fixed-length token ids and shifted labels of (prompt, answer) samples with image placeholders, the
text half of every vision batch (image-text and video).

Prompt and answer are tokenized separately and concatenated, so the answer's tokens are known by
construction: no string search in the token sequence (BPE is not prefix-stable, and a search that
misses masks a whole sample), and image placeholders are never targets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from datamodules.plan.bad_samples import BadSample
from datamodules.plan.loader import IGNORE_INDEX


def pad_token_id(tokenizer: Any, name: str) -> int:
    """The tokenizer's pad id, else its EOS id (padding takes no loss, so any id serves)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError(f"tokenizer {name!r} has neither a pad token nor an EOS token to pad with; set pad_token")


def special_ids(tokenizer: Any, name: str, add_bos: bool, ended: str) -> tuple[int, int, list[int]]:
    """The EOS id that ends ``ended`` (``"the answer"``, ``"a document"``), the pad id, and ``[BOS]``
    where ``add_bos`` (else ``[]``); an error naming the token the tokenizer lacks."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} has no EOS token to end {ended} with; set eos_token")
    bos: list[int] = []
    if add_bos:
        if tokenizer.bos_token_id is None:
            raise ValueError(f"add_bos=True, but tokenizer {name!r} has no BOS token")
        bos = [int(tokenizer.bos_token_id)]
    return int(tokenizer.eos_token_id), pad_token_id(tokenizer, name), bos


def placeholder_token_id(tokenizer: Any, name: str, image_token: str | None) -> int:
    """The id at image (or video) placeholder positions: ``image_token``'s, else the pad id."""
    if image_token is None:
        return pad_token_id(tokenizer, name)
    token_id = tokenizer.convert_tokens_to_ids(image_token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"image_token {image_token!r} is not a token of tokenizer {name!r}")
    return int(token_id)


class PromptAnswerLabels:
    """``input_ids``, ``labels``, ``attention_mask`` and ``image_positions`` of fixed length.

    A sample is ``prompt + answer + EOS``, where the prompt holds ``num_image_tokens`` placeholders
    (ids ``image_token_id``, where the model puts the image's embeddings). ``labels[t]`` is
    ``input_ids[t + 1]`` when that is an answer token (its EOS included), else ``-100``: prompt,
    placeholders and padding take no loss. (When nothing follows the placeholders but the answer,
    the last placeholder's label is the first answer token: the image predicts the caption's first
    word.) The answer is truncated to ``max_text_len``; the prompt and its placeholders never are:
    a sample whose prompt leaves no room for one answer token is a ``BadSample``.

    Args:
        tokenizer: a loaded ``transformers`` tokenizer. name: its name, for messages.
        max_text_len: tokens per sample, placeholders included; shorter samples are padded.
        num_image_tokens: placeholder positions per image (0: none, the model attends to the
            image some other way).
        image_token_id: the id at placeholder positions.
        template: with a ``transformers`` processor, its chat template: prompt text to the text
            before the answer, which holds the image token once (it is tokenized with the
            tokenizer's special tokens, as the processor does, and the image token widened to
            ``num_image_tokens``). ``None``: ``[BOS] + placeholders + prompt tokens``.
        add_bos: without a template, start with the tokenizer's BOS token.
    """

    def __init__(
        self,
        tokenizer: Any,
        name: str,
        max_text_len: int,
        num_image_tokens: int,
        image_token_id: int,
        template: Callable[[str], str] | None = None,
        add_bos: bool = False,
    ) -> None:
        self.eos_id, self.pad_id, self.bos = special_ids(tokenizer, name, template is None and add_bos, "the answer")
        self.tokenizer = tokenizer
        self.max_text_len = max_text_len
        self.num_image_tokens = num_image_tokens
        self.image_token_id = image_token_id
        self.template = template
        shortest = len(self.prompt_ids([""])[0][0]) + 1
        if max_text_len < shortest:
            raise ValueError(
                f"max_text_len={max_text_len} is shorter than the prompt ({shortest - 1} tokens with an empty "
                f"prompt text, {num_image_tokens} of them image placeholders) plus one answer token: "
                f"use max_text_len >= {shortest}"
            )

    def prompt_ids(self, prompts: list[str]) -> list[tuple[list[int], int]]:
        """Token ids of each prompt, placeholders included, and where its placeholders start."""
        placeholders = [self.image_token_id] * self.num_image_tokens
        if self.template is None:
            encoded = self.tokenizer(prompts, add_special_tokens=False)["input_ids"] if any(prompts) else []
            return [
                (self.bos + placeholders + (encoded[i] if encoded else []), len(self.bos)) for i in range(len(prompts))
            ]
        encoded = self.tokenizer([self.template(p) for p in prompts])["input_ids"]
        out = []
        for ids in encoded:
            if ids and ids[-1] == self.eos_id:  # a tokenizer that ends every text with EOS
                ids = ids[:-1]
            at = [i for i, t in enumerate(ids) if t == self.image_token_id]
            if len(at) != 1:
                raise ValueError(
                    f"the chat template gave a prompt with {len(at)} image tokens (id {self.image_token_id}); "
                    "it must place exactly one"
                )
            out.append((ids[: at[0]] + placeholders + ids[at[0] + 1 :], at[0]))
        return out

    def encode(self, prompts: list[str], answers: list[str]) -> tuple[dict[str, np.ndarray], dict[int, str]]:
        """Arrays ``[len(answers), max_text_len]`` (``image_positions``: ``[n, num_image_tokens]``),
        and the samples that do not fit, by position in the batch, with the reason."""
        n, length = len(answers), self.max_text_len
        input_ids = np.full((n, length), self.pad_id, dtype=np.int32)
        labels = np.full((n, length), IGNORE_INDEX, dtype=np.int32)
        attention = np.zeros((n, length), dtype=bool)
        positions = np.zeros((n, self.num_image_tokens), dtype=np.int32)
        answer_ids = self.tokenizer(answers, add_special_tokens=False)["input_ids"]
        bad: dict[int, str] = {}
        steps = np.arange(self.num_image_tokens, dtype=np.int32)
        for row, ((prompt, start), answer) in enumerate(zip(self.prompt_ids(prompts), answer_ids, strict=True)):
            if len(prompt) + 1 > length:
                bad[row] = (
                    f"its prompt is {len(prompt)} tokens ({self.num_image_tokens} image placeholders), leaving no "
                    f"room for the answer in max_text_len={length}"
                )
                continue
            full = (prompt + answer + [self.eos_id])[:length]
            input_ids[row, : len(full)] = full
            attention[row, : len(full)] = True
            first = max(len(prompt), 1)  # with no prompt at all, the first answer token has no predecessor
            labels[row, first - 1 : len(full) - 1] = full[first:]
            positions[row] = start + steps
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention,
            "image_positions": positions,
        }, bad


def text_value(value: Any, field: str) -> str:
    """``value`` if it is a string, else a ``BadSample`` naming the field."""
    if isinstance(value, str):
        return value
    raise BadSample(f"its {field!r} is {'null' if value is None else 'a ' + type(value).__name__}, not a string")
