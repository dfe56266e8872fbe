"""``VideoDataModule``: clips and captions for video-language models, through the sample plan."""

from __future__ import annotations

from typing import Any

from datamodules.plan.arguments import require_int
from datamodules.plan.bad_samples import BadSampleLog
from datamodules.plan.datamodule import PlanDataModule
from datamodules.vision.video_samples import VideoSamples
from datamodules.vision.video_source import VideoSource


class VideoDataModule(PlanDataModule):
    """Trains a video-language model on clips: a few frames each, decoded by seeking, and text.

    Batches: ``pixel_values`` ``[B, max_frames, 3, H, W]`` float32 (they leave the loader as uint8, a quarter of the
    bytes through the workers and the host-to-device copy, and ``on_after_batch_transfer``, which the
    Trainer calls once the batch is on the device, normalizes them; outside a Trainer call
    ``dm.on_after_batch_transfer(batch, 0)``); ``frame_mask``
    ``[B, max_frames]`` (False past a clip's sampled frames, and for a masked broken clip);
    ``timestamps`` ``[B, max_frames]`` (seconds of each frame in its clip, float64); ``input_ids``,
    ``labels`` (shifted, ``-100`` on prompt, placeholders and padding), ``attention_mask``:
    ``[B, max_text_len]``; ``video_positions`` ``[B, num_video_tokens]``. Clips are decoded in the
    DataLoader's workers. Order, exact O(1) and elastic resume are the plan's.

    Args:
        data_root, tokenizer, dataset_type, manifest, val_manifest, val_fraction, layout_options,
            frame_sampling, frame_options, max_frames, frame_accuracy, image_size, resize_mode, mean, std,
            num_video_tokens, image_token, add_bos, prompt, on_broken_clip, storage_options, file_cache_dir,
            file_cache_bytes, file_cache_policy, test_manifest, test_fraction: see ``VideoSource``;
            ``storage_options`` are kept out of checkpoints.
        max_text_len: tokens per sample, placeholders included.
        batch_size: samples per data-parallel rank per micro-batch.
        seed, num_workers, allow_plan_change, pin_memory, prefetch_factor, broadcast_within: see
            ``PlanDataModule``.

    Example::

        dm = VideoDataModule("webvid/videos", tokenizer="gpt2", max_text_len=64, batch_size=8,
                             dataset_type="webvid", manifest="results_2M_train.csv",
                             frame_options={"fps": 1.0}, max_frames=8, num_workers=8)
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        data_root: str,
        tokenizer: str,
        max_text_len: int,
        batch_size: int,
        dataset_type: str = "folder",
        manifest: str | list[str] | None = None,
        val_manifest: str | list[str] | None = None,
        val_fraction: float = 0.0,
        layout_options: dict[str, Any] | None = None,
        frame_sampling: str = "uniform",
        frame_options: dict[str, Any] | None = None,
        max_frames: int = 8,
        frame_accuracy: str = "exact",
        image_size: int = 224,
        resize_mode: str = "crop",
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        num_video_tokens: int = 0,
        image_token: str | None = None,
        add_bos: bool = False,
        prompt: str = "",
        on_broken_clip: str = "mask",
        storage_options: dict[str, Any] | None = None,
        file_cache_dir: str | None = None,
        file_cache_bytes: int | None = None,
        file_cache_policy: str = "planned",
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        broadcast_within: str | list[str] | None = None,
        test_manifest: str | list[str] | None = None,
        test_fraction: float = 0.0,
    ) -> None:
        super().__init__(
            batch_size,
            seed=seed,
            num_workers=num_workers,
            allow_plan_change=allow_plan_change,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            broadcast_within=broadcast_within,
        )
        self.max_text_len = require_int("max_text_len", max_text_len, 1)
        self.source = VideoSource(
            data_root,
            tokenizer,
            dataset_type=dataset_type,
            manifest=manifest,
            val_manifest=val_manifest,
            val_fraction=val_fraction,
            layout_options=dict(layout_options or {}),
            frame_sampling=frame_sampling,
            frame_options=dict(frame_options or {}),
            max_frames=max_frames,
            frame_accuracy=frame_accuracy,
            image_size=image_size,
            resize_mode=resize_mode,
            mean=mean,
            std=std,
            num_video_tokens=num_video_tokens,
            image_token=image_token,
            add_bos=add_bos,
            prompt=prompt,
            on_broken_clip=on_broken_clip,
            storage_options=storage_options,
            file_cache_dir=file_cache_dir,
            file_cache_bytes=file_cache_bytes,
            file_cache_policy=file_cache_policy,
            test_manifest=test_manifest,
            test_fraction=test_fraction,
        )
        self.save_hyperparameters(ignore=["storage_options"])  # credentials stay out of checkpoints

    def source_specs(self) -> list[VideoSource]:
        return [self.source]

    test_options = "give it test_manifest or test_fraction"

    def build_sources(self) -> list[tuple[str, VideoSamples, dict[str, VideoSamples]]]:
        return [("train", *self.source.build(self.max_text_len, False, self.job))]

    @property
    def bad_samples(self) -> BadSampleLog:
        """The broken clips met in this process so far (``on_broken_clip="mask"``): ``reasons`` by
        sample, and ``replacements``: how many times a broken clip was masked."""
        self._require_setup()
        return self._train.bad_samples
