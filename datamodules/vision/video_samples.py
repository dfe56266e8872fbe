"""``VideoSamples``: the clips of one split as a plan source, decoded and tokenized in ``fetch`` (in
the DataLoader's workers), turned into tensors per the batch contract in ``to_batch``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from datamodules.plan.bad_samples import BadSample, BadSampleLog
from datamodules.plan.held_out import RowSplit
from datamodules.plan.loader import IGNORE_INDEX
from datamodules.storage.locations import join_location
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles
from datamodules.vision.frame_sampling import FrameSampler
from datamodules.vision.images import ImagePixels, ResizeImage
from datamodules.vision.joined_samples import JoinedSamples
from datamodules.vision.planned_files import PlannedFiles
from datamodules.vision.prompt_labels import PromptAnswerLabels, text_value
from datamodules.vision.video_decoding import ClipBytes, decoded_in_this_process, read_frames
from datamodules.vision.webdataset_rows import fetch_each, in_a_bucket

BROKEN_CLIP_POLICIES = ("mask", "raise")


class VideoSamples(PlannedFiles):
    """Clip-caption samples of ``dataset`` rows chosen by ``split``, for the sample plan.

    ``fetch`` (a worker's job) reads each row, samples its timestamps (``sampler``, seeded by the
    sample's plan key), decodes the nearest frames and tokenizes its text. A broken clip raises
    naming its row and file, or (``on_broken_clip="mask"``) keeps its shape with no frame and no
    loss (``frame_mask`` all False, ``labels`` all -100), counted in ``bad_samples`` and logged.
    """

    batches_per_message = 1  # a decoded batch is worth a message of its own between processes
    uses_sample_keys = True  # random frame offsets draw from the sample's plan key
    instead_of_fork = "forkserver"  # the reason below holds in every process that decoded: start workers fast

    def spawn_reasons(self) -> list[str]:
        """A process that has decoded video (validation or a run with ``num_workers=0`` before this
        loader, or the user's own code) does not fork its workers: FFmpeg's state does not survive it."""
        if decoded_in_this_process():
            return ["this process has decoded video with PyAV, whose FFmpeg threads and locks a fork copies"]
        return []

    def __init__(
        self,
        dataset: Any,
        split: RowSplit,
        data_root: str,
        sampler: FrameSampler,
        pixels: ImagePixels,
        labels: PromptAnswerLabels,
        prompt: str,
        on_broken_clip: str,
        name: str,
        details: dict[str, Any],
        files: RemoteFiles = LOCAL_FILES,
        accuracy: str = "exact",
    ) -> None:
        self.files = files
        self.accuracy = accuracy
        self.dataset = dataset
        self.split = split
        self.data_root = data_root
        self.sampler = sampler
        self.pixels = pixels
        self.resize = ResizeImage(pixels.shape[-1], details["resize_mode"])
        self.labels = labels
        self.prompt = prompt
        self.on_broken_clip = on_broken_clip
        self.name = name
        self.fingerprint = f"video:{sorted(details.items())}"
        self.vocabulary = details["tokenizer"]
        self.bad_samples = BadSampleLog("masked broken clip %s (%s): no frames, no loss")
        self._has = {c: c in dataset.column_names for c in ("prompt", "duration")}
        self.file_column = "video"
        self._start_planning()

    def __len__(self) -> int:
        return len(self.split)

    @property
    def fetch_many(self) -> Callable[[list[tuple[np.ndarray, dict]]], list[dict[str, Any]]]:
        """Tar shards in a bucket read in-process: the next micro-batch read ahead (``fetch_each``); local
        rows have none (``hasattr`` is false)."""
        if not in_a_bucket(self.dataset):
            raise AttributeError("fetch_many")
        return fetch_each(self.fetch)

    def file_location(self, value: Any) -> str | None:
        """A clip's path or URL under ``data_root`` (``None`` for a tar member's bytes in the row)."""
        return None if isinstance(value, dict) else join_location(self.data_root, value)

    @property
    def shape_key(self) -> tuple[Any, ...]:
        return (
            self.labels.max_text_len,
            self.labels.num_image_tokens,
            (self.sampler.max_frames, *self.pixels.shape),
            self.pixels.normalization,
        )

    @classmethod
    def join(cls, parts: list[VideoSamples]) -> JoinedSamples:
        return JoinedSamples(parts)

    def _frame(self, frame: Any) -> np.ndarray:
        # One thread for the colour conversion, as for decoding (``open_clip``): FFmpeg 8's swscale
        # otherwise runs a pool of slice threads, and a DataLoader worker forked while a thread of its
        # parent was converting a frame waited forever for its own pool (seen in a test run).
        picture = torch.from_numpy(frame.to_ndarray(format="rgb24", threads=1)).permute(2, 0, 1)
        return self.resize.resize(picture).numpy()

    def _clip(self, row_index: int) -> tuple[dict[str, Any], str, RemoteFiles | ClipBytes]:
        """The row, its clip's name, and what reads the clip: a path under ``data_root`` through
        ``files``, or (tar shards) the member's bytes the row holds."""
        row = self.dataset[row_index]
        video = row["video"]
        if isinstance(video, dict):
            return row, video["path"], ClipBytes(video["bytes"])
        return row, join_location(self.data_root, video), self.files

    def _read(self, index: int, key: int) -> dict[str, Any]:
        row_index = int(self.split.rows(np.array([index]))[0])
        frames_shape = (self.sampler.max_frames, *self.pixels.shape)
        pixels = np.zeros(frames_shape, dtype=np.uint8)
        times = np.zeros(self.sampler.max_frames, dtype=np.float64)  # exact: the frame chosen is the nearest to it
        mask = np.zeros(self.sampler.max_frames, dtype=bool)
        try:
            row, path, files = self._clip(row_index)
            prompt = text_value(row["prompt"], "prompt") if self._has["prompt"] else self.prompt
            text, bad = self.labels.encode([prompt], [text_value(row["text"], "text")])
            if bad:
                raise BadSample(bad[0])
            duration = row["duration"] if self._has["duration"] else None
            timestamps, frames = read_frames(
                path,
                lambda info: self.sampler.timestamps(info.duration, info.frame_rate, key),
                self._frame,
                duration,
                files,
                self.accuracy,
            )
        except BadSample as err:
            if hasattr(self.dataset, "describe"):  # tar shards: the shard and the sample's key
                where = f"{self.name} sample {self.dataset.describe(row_index)}"
            else:
                where = f"{self.name} row {row_index} ({row['video']})"  # a manifest's row is read before any failure
            if self.on_broken_clip == "raise":
                raise BadSample(f"{where}: {err} (on_broken_clip='mask' keeps such clips with no loss)") from None
            # The sample keeps its shape: an empty prompt and answer (real tokens, so attention has
            # something to attend to), no frames, no loss.
            text, _ = self.labels.encode([""], [""])
            text["labels"][:] = IGNORE_INDEX
            sample = {name: value[0] for name, value in text.items()}
            return {**sample, "pixels": pixels, "timestamps": times, "frame_mask": mask, "broken": (where, str(err))}
        n = len(frames)
        pixels[:n] = np.stack(frames)
        times[:n] = timestamps
        mask[:n] = True
        sample = {name: value[0] for name, value in text.items()}
        return {**sample, "pixels": pixels, "timestamps": times, "frame_mask": mask, "broken": None}

    def fetch(self, indices: np.ndarray, keys: np.ndarray, positions: np.ndarray | None = None) -> dict[str, Any]:
        if positions is None:
            positions = np.zeros(len(indices), dtype=np.int64)
        counts: dict[str, Any] = {}
        try:
            with self.count_cache(counts):
                self.prefetch(indices, positions)
                reads = zip(*(np.asarray(a).tolist() for a in (indices, keys, positions)), strict=True)
                samples = [self._read_at(i, key, position) for i, key, position in reads]
        except BadSample as err:  # raised in the main process by to_batch, as one message
            return {"error": str(err)}
        raw = {key: np.stack([s[key] for s in samples]) for key in samples[0] if key != "broken"} | counts
        return {**raw, "skipped": [s["broken"] for s in samples if s["broken"] is not None]}

    def _read_at(self, index: int, key: int, position: int) -> dict[str, Any]:
        with self.reading(position):
            return self._read(index, key)

    def to_batch(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        if "error" in raw:
            raise BadSample(raw["error"])
        self.bad_samples.record(raw["skipped"])
        self.add_cache_counts(raw)
        return {
            "pixel_values": torch.from_numpy(raw["pixels"]),
            "frame_mask": torch.from_numpy(raw["frame_mask"]),
            "timestamps": torch.from_numpy(raw["timestamps"]),
            "input_ids": torch.from_numpy(raw["input_ids"].astype(np.int64)),
            "labels": torch.from_numpy(raw["labels"].astype(np.int64)),
            "attention_mask": torch.from_numpy(raw["attention_mask"].astype(np.int64)),
            "video_positions": torch.from_numpy(raw["image_positions"].astype(np.int64)),
        }

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**batch, "pixel_values": self.pixels.normalize(batch["pixel_values"])}
