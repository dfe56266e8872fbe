"""Interleaved documents (text with several images in it, as OBELICS and MMC4 hold web pages): their
parts in order, and their token ids with each image's run of placeholder tokens at its place.

A document is rendered as a processor renders it: the texts in order (``separator`` between two
adjacent texts), each image as the image token's text, tokenized once; then each image token is
widened to the image's ``num_image_tokens`` placeholders, as ``transformers`` processors do. Labels
are on text tokens only (never on a placeholder, never on padding), optionally not on the text
before the first image.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from datamodules.plan.bad_samples import BadSample
from datamodules.plan.loader import IGNORE_INDEX
from datamodules.vision.prompt_labels import special_ids

LAYOUTS = ("obelics", "mmc4", "chat")  # chat: conversations with images (conversation_text)
IMAGE = None  # an image's place among a document's parts


def obelics_parts(texts: Any, images: Any) -> tuple[list[str | None], list[Any]]:
    """OBELICS rows: ``texts`` and ``images`` lists of one length, exactly one of the two set at each
    position. The parts (a text, or ``IMAGE``) and the images in order."""
    if not isinstance(texts, list) or not isinstance(images, list):
        raise BadSample(f"its texts and images are {type(texts).__name__} and {type(images).__name__}, not lists")
    if len(texts) != len(images):
        raise BadSample(f"it has {len(texts)} texts but {len(images)} images; OBELICS rows pair them by position")
    parts, found = [], []
    for at, (text, image) in enumerate(zip(texts, images, strict=True)):
        if (text is None) == (image is None):
            raise BadSample(f"its position {at} holds {'both a text and an image' if text is not None else 'neither'}")
        if text is None:
            parts.append(IMAGE)
            found.append(image)
        elif not isinstance(text, str):
            raise BadSample(f"its text at position {at} is a {type(text).__name__}, not a string")
        else:
            parts.append(text)
    return parts, found


def mmc4_parts(texts: Any, images: Any) -> tuple[list[str | None], list[Any]]:
    """MMC4 rows: a list of sentences (``texts``) and images, each a dict with the index of the sentence
    it belongs to (``matched_text_index``) and the image itself (``image``, or its ``path``/``url``);
    an image goes before its sentence, images of one sentence in the list's order."""
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadSample("its texts are not a list of strings")
    if not isinstance(images, list):
        raise BadSample(f"its images are a {type(images).__name__}, not a list")
    before: dict[int, list[Any]] = {}
    for at, entry in enumerate(images):
        index = entry.get("matched_text_index") if isinstance(entry, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(texts):
            raise BadSample(
                f"its image {at} has matched_text_index {index!r}, not a sentence index in [0, {len(texts)})"
            )
        image = next((entry[k] for k in ("image", "path", "url") if entry.get(k) is not None), None)
        if image is None:
            raise BadSample(f"its image {at} has no image, path or url")
        before.setdefault(index, []).append(image)
    parts, found = [], []
    for index, text in enumerate(texts):
        for image in before.get(index, []):
            parts.append(IMAGE)
            found.append(image)
        parts.append(text)
    return parts, found


DOCUMENT_PARTS = {"obelics": obelics_parts, "mmc4": mmc4_parts}


class InterleavedText:
    """Fixed-length ``input_ids``, ``labels`` and ``attention_mask`` of interleaved documents.

    A document longer than ``max_text_len`` (with its EOS) is cut there; an image whose placeholders
    would be cut is left out with everything after it, so a row never holds part of an image.

    Args:
        tokenizer: a loaded ``transformers`` tokenizer. name: its name, for messages.
        max_text_len: tokens a row, placeholders included; shorter documents are padded.
        num_image_tokens: placeholders an image becomes; ``None``: each image's count is given with
            the document (a processor whose count depends on the image's size).
        image_token: the image token's text (one token of ``tokenizer``, e.g. ``"<image>"``).
        separator: between two adjacent texts.
        loss_before_first_image: whether the text before a document's first image takes loss.
        add_bos: start each row with the tokenizer's BOS token.
    """

    def __init__(
        self,
        tokenizer: Any,
        name: str,
        max_text_len: int,
        num_image_tokens: int | None,
        image_token: str,
        separator: str = "\n\n",
        loss_before_first_image: bool = True,
        add_bos: bool = False,
    ) -> None:
        token_id = tokenizer.convert_tokens_to_ids(image_token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"image_token {image_token!r} is not a token of tokenizer {name!r}")
        if num_image_tokens is not None and num_image_tokens < 1:
            raise ValueError(f"num_image_tokens must be at least 1 for interleaved documents, got {num_image_tokens}")
        self.tokenizer, self.max_text_len, self.num_image_tokens = tokenizer, max_text_len, num_image_tokens
        self.image_token, self.image_token_id = image_token, int(token_id)
        self.separator, self.loss_before_first_image = separator, loss_before_first_image
        self.eos_id, self.pad_id, self.bos = special_ids(tokenizer, name, add_bos, "a document")

    def render(self, parts: list[str | None]) -> str:
        """The document's text, each image as the image token."""
        out: list[str] = []
        for at, part in enumerate(parts):
            if part is IMAGE:
                out.append(self.image_token)
                continue
            if self.image_token in part:
                raise BadSample(f"its text holds the image token {self.image_token!r}, which only images may")
            if at and parts[at - 1] is not IMAGE:
                out.append(self.separator)
            out.append(part)
        return "".join(out)

    def _counts(self, counts: list[int] | None, images: int) -> list[int]:
        """Placeholders of each of a document's ``images``: ``counts``, or the fixed count."""
        if counts is None:
            if self.num_image_tokens is None:
                raise ValueError("each image's number of placeholders is needed (num_image_tokens=None)")
            return [self.num_image_tokens] * images
        if len(counts) != images:
            raise BadSample(f"its text holds {images} image tokens for {len(counts)} images")
        return list(counts)

    def _token_lists(self, documents: list[Any]) -> list[tuple[list[int], list[bool]] | BadSample]:
        """Each document's token ids before its images are widened (BOS, the rendered text, EOS),
        and which of them may be a target; one that cannot be rendered gets its ``BadSample``. One
        tokenizer call for them all."""
        rendered: list[str | BadSample] = []
        for parts in documents:
            try:
                rendered.append(self.render(parts))
            except BadSample as err:
                rendered.append(err)
        texts = [r for r in rendered if isinstance(r, str)]
        ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        out: list[tuple[list[int], list[bool]] | BadSample] = []
        for r in rendered:
            if isinstance(r, BadSample):
                out.append(r)
            else:
                tokens = [*self.bos, *next(ids), self.eos_id]
                out.append((tokens, [True] * len(tokens)))
        return out

    def lengths(self, documents: list[Any], counts: list[list[int] | None] | None = None) -> list[int | BadSample]:
        """Tokens each document takes whole (placeholders included), ``counts`` its images'
        placeholders each (``None``: the fixed count); one that cannot be rendered, or whose
        image tokens are not its images, gets its ``BadSample``."""
        out: list[int | BadSample] = []
        for at, tokens in enumerate(self._token_lists(documents)):
            if isinstance(tokens, BadSample):
                out.append(tokens)
                continue
            images = tokens[0].count(self.image_token_id)
            try:
                widths = self._counts(None if counts is None else counts[at], images)
            except BadSample as err:
                out.append(err)
                continue
            out.append(len(tokens[0]) + sum(widths) - images)
        return out

    def encode(self, parts: Any, counts: list[int] | None = None) -> tuple[dict[str, np.ndarray], int]:
        """The row's arrays ``[max_text_len]`` and how many of the document's images it holds (the
        first ones: an image cut off leaves out the rest of the document). ``counts``: placeholders
        of each image (``None``: the fixed count)."""
        tokens = self._token_lists([parts])[0]
        if isinstance(tokens, BadSample):
            raise tokens
        rendered, targets = tokens
        widths = iter(self._counts(counts, rendered.count(self.image_token_id)))
        ids: list[int] = []
        image_of: list[int] = []  # the image each token belongs to, -1: text
        target: list[bool] = []
        image = 0
        for token, may in zip(rendered, targets, strict=True):
            if token == self.image_token_id:
                width = next(widths)
                ids += [token] * width
                image_of += [image] * width
                target += [False] * width
                image += 1
            else:
                ids.append(token)
                image_of.append(-1)
                target.append(may)
        length = self.max_text_len
        cut = min(len(ids), length)
        if cut < len(ids) and image_of[cut - 1] >= 0 and image_of[cut] == image_of[cut - 1]:
            while cut > 0 and image_of[cut - 1] == image_of[cut]:  # back to the start of the image cut through
                cut -= 1
        images = max(image_of[:cut], default=-1) + 1
        input_ids = np.full(length, self.pad_id, dtype=np.int32)
        labels = np.full(length, IGNORE_INDEX, dtype=np.int32)
        attention = np.zeros(length, dtype=bool)
        input_ids[:cut], attention[:cut] = ids[:cut], True
        text = np.array(target[:cut], dtype=bool)
        if not self.loss_before_first_image and image:
            text[: image_of.index(0)] = False  # no loss on what precedes the first image
        targets = np.flatnonzero(text[1:]) + 1  # positions whose token is a target of the one before
        labels[targets - 1] = input_ids[targets]
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}, images
