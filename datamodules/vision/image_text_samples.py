"""``ImageTextSamples``: the rows of one image-text split as a plan source, decoded and tokenized in
``fetch`` (in the DataLoader's workers), turned into tensors per the batch contract in ``to_batch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from datamodules.plan.bad_samples import BadSample, BadSampleLog
from datamodules.plan.held_out import RowSplit
from datamodules.plan.randomness import seeded
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles
from datamodules.vision.bad_samples import sample_or_replacement
from datamodules.vision.images import ImagePixels, image_reference, read_image
from datamodules.vision.joined_samples import JoinedSamples
from datamodules.vision.planned_files import PlannedFiles
from datamodules.vision.prompt_labels import PromptAnswerLabels, text_value
from datamodules.vision.vlm_processor import ProcessorInputs
from datamodules.vision.webdataset_rows import fetch_each, in_a_bucket


@dataclass
class ImageTextFields:
    """Where a row keeps its parts: the image (bytes, a path, or ``datasets``' undecoded ``Image``),
    the answer text, and the prompt (a column, or one ``prompt`` for every row, or none)."""

    image: str
    text: str
    prompt: str | None = None
    fixed_prompt: str = ""


class ImageTextSamples(PlannedFiles):
    """Image-text samples of ``dataset`` rows chosen by ``split``, for the sample plan.

    ``fetch`` (a worker's job) reads each row, decodes its image and tokenizes its text; a bad
    sample raises naming its row and file, or (``on_bad_sample="skip"``) is replaced by a stand-in
    drawn from its own index (``bad_samples``). ``to_batch`` (the main process) counts the skipped
    samples; uint8 pixels are normalized by ``on_device``, once the batch is on the accelerator.
    """

    batches_per_message = 1  # a decoded batch is worth a message of its own between processes
    uses_sample_keys = True  # a user's random transform draws from the sample's plan key

    def __init__(
        self,
        dataset: Any,
        split: RowSplit,
        fields: ImageTextFields,
        pixels: ImagePixels | ProcessorInputs,
        labels: PromptAnswerLabels,
        on_bad_sample: str,
        name: str,
        details: dict[str, Any],
        files: RemoteFiles = LOCAL_FILES,
    ) -> None:
        self.files = files
        self.dataset = dataset
        self.split = split
        self.fields = fields
        self.pixels = pixels
        self.labels = labels
        self.on_bad_sample = on_bad_sample
        self.name = name
        self.details = details
        self.fingerprint = f"image-text:{sorted(details.items())}"
        self.vocabulary = details["tokenizer"]
        self.bad_samples = BadSampleLog()
        self.file_column = fields.image
        self._start_planning()

    def __len__(self) -> int:
        return len(self.split)

    @property
    def fetch_many(self) -> Callable[[list[tuple[np.ndarray, dict]]], list[dict[str, Any]]]:
        """Tar shards in a bucket read in-process: the next micro-batch read ahead (``fetch_each``).
        Not with a user transform: it draws from the global generators, which a thread would share
        with the training loop; not for local rows (``hasattr`` is false)."""
        if not in_a_bucket(self.dataset) or getattr(self.pixels, "user_transform", False):
            raise AttributeError("fetch_many")
        return fetch_each(self.fetch)

    def file_location(self, value: Any) -> str | None:
        """An image's path or URL (``None`` for bytes in the row)."""
        try:
            data, path = image_reference(value)
        except BadSample:
            return None  # read as a bad sample, not planned
        return path if data is None else None

    @property
    def shape_key(self) -> tuple[Any, ...]:
        """What every sample's arrays' shapes depend on: joined sources must agree on it."""
        return (self.labels.max_text_len, self.labels.num_image_tokens, self.pixel_shape, self.pixels.normalization)

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return self.pixels.pixel_shape if isinstance(self.pixels, ProcessorInputs) else self.pixels.shape

    @classmethod
    def join(cls, parts: list[ImageTextSamples]) -> JoinedSamples:
        return JoinedSamples(parts)

    def describe(self, index: int) -> str:
        row = int(self.split.rows(np.array([index]))[0])
        if hasattr(self.dataset, "describe"):  # tar shards: the sample's shard and key, without a read
            return f"{self.name} sample {self.dataset.describe(row)}"
        value = self.dataset[row][self.fields.image]
        path = value.get("path") if isinstance(value, dict) else value if isinstance(value, str) else None
        return f"{self.name} row {row}" + (f" (image {path})" if path else "")

    def _image(self, value: Any, key: int) -> np.ndarray:
        data, path = image_reference(value)
        if isinstance(self.pixels, ProcessorInputs):
            return self.pixels.pixels(read_image(data, path, files=self.files))
        image = read_image(data, path, self.pixels.draft_size, self.files)
        if not self.pixels.user_transform:
            return self.pixels(image)
        with seeded(key):
            return self.pixels(image)

    def _read(self, index: int, key: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        row = self.dataset[int(self.split.rows(np.array([index]))[0])]
        fields = self.fields
        answer = text_value(row[fields.text], fields.text)
        prompt = fields.fixed_prompt if fields.prompt is None else text_value(row[fields.prompt], fields.prompt)
        text, bad = self.labels.encode([prompt], [answer])
        if bad:
            raise BadSample(bad[0])
        return self._image(row[fields.image], key), {name: value[0] for name, value in text.items()}

    def fetch(self, indices: np.ndarray, keys: np.ndarray, positions: np.ndarray | None = None) -> dict[str, Any]:
        skipped: list[tuple[str, str]] = []
        if positions is None:
            positions = np.zeros(len(indices), dtype=np.int64)
        counts: dict[str, Any] = {}
        try:
            with self.count_cache(counts):
                self.prefetch(indices, positions)
                reads = zip(*(np.asarray(a).tolist() for a in (indices, keys, positions)), strict=True)
                samples = [self._sample(i, key, position, skipped) for i, key, position in reads]
        except BadSample as err:  # raised in the main process by to_batch, as one message
            return {"error": str(err)}
        kinds = {image.dtype for image, _ in samples}
        if len(kinds) > 1:
            return {"error": f"the image transform returned arrays of several dtypes {sorted(map(str, kinds))}"}
        raw = {key: np.stack([text[key] for _, text in samples]) for key in samples[0][1]} | counts
        # An array, not a tensor: through the worker queue a pickled array measured 1.5x faster here
        # than a tensor moved to shared memory (a new segment per batch).
        return {**raw, "pixels": np.stack([image for image, _ in samples]), "skipped": skipped}

    def _sample(self, index: int, key: int, position: int, skipped: list) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        with self.reading(position):
            return sample_or_replacement(
                index, len(self), partial(self._read, key=key), self.describe, self.on_bad_sample, skipped
            )

    def to_batch(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        if "error" in raw:
            raise BadSample(raw["error"])
        self.bad_samples.record(raw["skipped"])
        self.add_cache_counts(raw)
        return {
            "pixel_values": torch.from_numpy(raw["pixels"]),
            "input_ids": torch.from_numpy(raw["input_ids"].astype(np.int64)),
            "labels": torch.from_numpy(raw["labels"].astype(np.int64)),
            "attention_mask": torch.from_numpy(raw["attention_mask"].astype(np.int64)),
            "image_positions": torch.from_numpy(raw["image_positions"].astype(np.int64)),
        }

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**batch, "pixel_values": self.pixels.normalize(batch["pixel_values"])}
