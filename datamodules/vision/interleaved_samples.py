"""``InterleavedSamples``: interleaved documents (several images inside their text) as a plan source,
one document a row: decoded and tokenized in ``fetch`` (in the DataLoader's workers), turned into
tensors in ``to_batch``."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from datamodules.plan.bad_samples import BadSample, BadSampleLog
from datamodules.plan.held_out import RowSplit
from datamodules.storage.locations import is_url
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles, url_key
from datamodules.vision.bad_samples import sample_or_replacement
from datamodules.vision.conversation_text import chat_parts
from datamodules.vision.images import ImagePixels, image_reference, image_size, read_image
from datamodules.vision.interleaved_text import DOCUMENT_PARTS, InterleavedText
from datamodules.vision.joined_samples import JoinedDocuments
from datamodules.vision.planned_files import PlannedFiles
from datamodules.vision.vlm_processor import ProcessorInputs


class InterleavedSamples(PlannedFiles):
    """Interleaved documents of ``dataset`` rows chosen by ``split``, for the sample plan.

    ``fetch`` reads each row's parts in order (``layout``: ``"obelics"`` or ``"mmc4"``), decodes its
    images (at most ``max_images`` a document; more is a ``BadSample``) and tokenizes its text with
    every image's placeholders in place (``InterleavedText``). A bad document (an image that does not
    decode, an image index out of range, a malformed row) raises naming it, or (``on_bad_sample=
    "skip"``) is replaced by a stand-in drawn from its own index, counted.
    """

    batches_per_message = 1
    uses_sample_keys = True

    def __init__(
        self,
        dataset: Any,
        split: RowSplit,
        layout: str,
        texts_field: str,
        images_field: str,
        pixels: ImagePixels | ProcessorInputs,
        text: InterleavedText,
        max_images: int,
        on_bad_sample: str,
        name: str,
        details: dict[str, Any],
        files: RemoteFiles = LOCAL_FILES,
    ) -> None:
        self.dataset, self.split, self.layout = dataset, split, layout
        self.parts_of = chat_parts if layout == "chat" else DOCUMENT_PARTS[layout]
        self.texts_field, self.images_field, self.file_column = texts_field, images_field, images_field
        self.pixels, self.text, self.max_images = pixels, text, max_images
        self.on_bad_sample, self.name, self.details = on_bad_sample, name, details
        self.files = files
        self.fingerprint = f"interleaved:{sorted(details.items())}"
        self.vocabulary = details["tokenizer"]
        self.bad_samples = BadSampleLog()
        self._start_planning()

    def __len__(self) -> int:
        return len(self.split)

    @classmethod
    def join(cls, parts: list[InterleavedSamples]) -> JoinedDocuments:
        if not all(isinstance(p, InterleavedSamples) for p in parts):
            kinds = sorted({type(p).__name__ for p in parts})
            raise ValueError(f"interleaved documents and conversations mix with each other only; got {kinds}")
        return JoinedDocuments(parts)

    @property
    def shape_key(self) -> tuple[Any, ...]:
        """What a batch's arrays depend on: mixed sources must agree on it."""
        extras = tuple(sorted(getattr(self.pixels, "extra_shapes", {}).items()))
        return (self.text.max_text_len, self.vocabulary, self.pixel_shape, self.pixels.normalization, extras)

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return self.pixels.pixel_shape if isinstance(self.pixels, ProcessorInputs) else self.pixels.shape

    def describe(self, index: int) -> str:
        row = int(self.split.rows(np.array([index]))[0])
        if hasattr(self.dataset, "describe"):  # tar shards: the sample's shard and key
            return f"{self.name} sample {self.dataset.describe(row)}"
        return f"{self.name} row {row}"

    def _row(self, index: int) -> tuple[list[str | None], list[Any]]:
        row = self.dataset[int(self.split.rows(np.array([index]))[0])]
        return self.parts_of(row[self.texts_field], row[self.images_field])

    def file_keys(self, indices: np.ndarray, passes: np.ndarray | None = None) -> np.ndarray:
        """The ``url_key`` of each document's images read by URL (``[documents, max_images]``); for
        tar shards in a bucket, the ``range_key`` of each document's sample."""
        if hasattr(self.dataset, "file_keys"):
            return super().file_keys(indices, passes)
        keys = np.zeros((len(indices), self.max_images), dtype=np.uint64)
        for r, index in enumerate(np.asarray(indices).tolist()):
            try:
                _, images = self._row(index)
            except BadSample:
                continue  # a bad row reads a stand-in: not planned
            for i, value in enumerate(images[: self.max_images]):
                try:
                    data, path = image_reference(value)
                except BadSample:
                    continue
                keys[r, i] = url_key(path) if data is None and path is not None and is_url(path) else 0
        return keys

    @property
    def dynamic(self) -> bool:
        """Whether an image's placeholders and pixel rows depend on its size (the processor's rule)."""
        return isinstance(self.pixels, ProcessorInputs) and self.pixels.dynamic

    def image_counts(self, images: list[Any]) -> list[int]:
        """Placeholders of each of a document's images: the fixed count, or by their sizes (read from
        their headers) where the processor's count depends on them."""
        if not self.dynamic:
            return [self.text.num_image_tokens] * len(images)
        return self.pixels.token_counts([image_size(*image_reference(v), self.files) for v in images])

    def _read(self, index: int, key: int) -> tuple[list[np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
        """A document's images' pixels, their per-image processor outputs, and its token arrays."""
        parts, images = self._row(index)
        if len(images) > self.max_images:
            raise BadSample(f"it holds {len(images)} images, more than max_images={self.max_images}")
        if isinstance(self.pixels, ProcessorInputs):  # the processor's pixels, all of the document's at once
            decoded = [read_image(*image_reference(v), files=self.files) for v in images]
            # By the decoded sizes: no header read again.
            counts = self.pixels.token_counts([i.size for i in decoded]) if self.dynamic else self.image_counts(images)
            arrays, kept = self.text.encode(parts, counts)
            return *self.pixels.processed(decoded[:kept]), arrays
        arrays, kept = self.text.encode(parts, self.image_counts(images))
        # A JPEG decoded at a reduced DCT scale where the size allows.
        draft = self.pixels.draft_size
        return [self.pixels(read_image(*image_reference(v), draft, self.files)) for v in images[:kept]], {}, arrays

    def images_raw(self, documents: list[tuple[list[np.ndarray], dict[str, np.ndarray]]]) -> dict[str, Any]:
        """The raw batch's images of ``documents`` (each its pixels and per-image outputs), in order:
        ``pixels`` stacked (rows of patches: one after another), and the processor's per-image
        outputs (``image_grid_thw``) under their names."""
        pixels = [p for images, _ in documents for p in images]
        raw: dict[str, Any] = {}
        if not pixels:
            raw["pixels"] = np.zeros((0, *self.pixel_shape), dtype=np.uint8)
        else:
            raw["pixels"] = np.concatenate(pixels) if self.dynamic else np.stack(pixels)
        for name, shape in getattr(self.pixels, "extra_shapes", {}).items():
            found = [extras[name] for _, extras in documents if name in extras]
            raw[name] = np.concatenate(found) if found else np.zeros((0, *shape), dtype=np.int64)
        return raw

    def fetch(self, indices: np.ndarray, keys: np.ndarray, positions: np.ndarray | None = None) -> dict[str, Any]:
        if positions is None:
            positions = np.zeros(len(indices), dtype=np.int64)
        skipped: list[tuple[str, str]] = []
        counts: dict[str, Any] = {}
        try:
            with self.count_cache(counts):
                reads = zip(*(np.asarray(a).tolist() for a in (indices, keys, positions)), strict=True)
                documents = [self._document(i, key, position, skipped) for i, key, position in reads]
        except BadSample as err:  # raised in the main process by to_batch, as one message
            return {"error": str(err)}
        raw = {key: np.stack([arrays[key] for _, _, arrays in documents]) for key in documents[0][2]}
        raw.update(self.images_raw([(images, extras) for images, extras, _ in documents]))
        raw["image_counts"] = np.array([len(images) for images, _, _ in documents], dtype=np.int64)
        return {**raw, **counts, "skipped": skipped}

    def _document(self, index: int, key: int, position: int, skipped: list) -> tuple[list[np.ndarray], dict, dict]:
        with self.reading(position):
            return sample_or_replacement(
                index, len(self), partial(self._read, key=key), self.describe, self.on_bad_sample, skipped
            )

    def to_batch(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``input_ids``, ``labels``, ``attention_mask`` ``[B, max_text_len]``; ``pixel_values``
        ``[N, 3, H, W]``, the batch's images in order (row by row, each row's in document order, as
        its placeholder runs come); ``image_sample_index`` ``[N]``: the row of each image."""
        if "error" in raw:
            raise BadSample(raw["error"])
        self.bad_samples.record(raw["skipped"])
        self.add_cache_counts(raw)
        return {
            "input_ids": torch.from_numpy(raw["input_ids"].astype(np.int64)),
            "labels": torch.from_numpy(raw["labels"].astype(np.int64)),
            "attention_mask": torch.from_numpy(raw["attention_mask"].astype(np.int64)),
            **self.images_batch(raw),
        }

    def images_batch(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``pixel_values``, ``image_sample_index`` (the row of each image) and the processor's
        per-image outputs of a raw batch."""
        counts = torch.from_numpy(raw["image_counts"])
        extras = {name: torch.from_numpy(raw[name]) for name in getattr(self.pixels, "extra_shapes", {})}
        return {
            "pixel_values": torch.from_numpy(raw["pixels"]),
            "image_sample_index": torch.repeat_interleave(torch.arange(len(counts)), counts),
            **extras,
        }

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**batch, "pixel_values": self.pixels.normalize(batch["pixel_values"])}
