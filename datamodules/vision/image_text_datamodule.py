"""``ImageTextDataModule``: image-text pairs for vision-language models, through the sample plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from datamodules.plan.arguments import require_int
from datamodules.plan.bad_samples import BadSampleLog
from datamodules.plan.datamodule import PlanDataModule
from datamodules.vision.image_text_samples import ImageTextSamples
from datamodules.vision.image_text_source import ImageTextSource


class ImageTextDataModule(PlanDataModule):
    """Trains a VLM on image-text pairs: normalized pixels, tokens and labels on the answer only.

    Batches: ``pixel_values`` ``[B, 3, H, W]`` float32 (they leave the loader as uint8, a quarter of the
    bytes through the workers and the host-to-device copy, and ``on_after_batch_transfer``, which the
    Trainer calls once the batch is on the device, normalizes them; outside a Trainer call
    ``dm.on_after_batch_transfer(batch, 0)``); ``input_ids``, ``labels`` (shifted,
    ``-100`` on prompt, image placeholders and padding), ``attention_mask``: ``[B, max_text_len]``;
    ``image_positions`` ``[B, num_image_tokens]``: where the image's embeddings go. Images are
    decoded in the DataLoader's workers. Order, exact O(1) and elastic resume are the plan's.
    Interleaved documents (``layout="obelics"`` or ``"mmc4"``): a row a document, ``pixel_values``
    ``[N, 3, H, W]`` for the batch's images in order and ``image_sample_index`` ``[N]``, labels on
    text tokens only; conversations with images (``layout="chat"``): labels on the assistant's
    tokens; either packed several a row with ``pack_sequences``.

    Args:
        path, tokenizer, processor, name, split, data_files, image_field, text_field, prompt_field,
            prompt, image_size, resize_mode, mean, std, transform, num_image_tokens, image_token,
            add_bos, val_split, val_fraction, on_bad_sample, load_kwargs, storage_options, file_cache_dir,
            file_cache_bytes, file_cache_policy, test_split, test_fraction, layout, max_images, separator,
            loss_before_first_image, max_images_per_row: see ``ImageTextSource``;
            ``storage_options`` are kept out of checkpoints.
        max_text_len: tokens per sample, image placeholders included (prompt, answer, EOS, padding);
            with ``pack_sequences``, per packed row.
        pack_sequences: interleaved documents only: several documents a row of ``max_text_len``
            tokens, counting each image's placeholders, packed by multipack afresh every pass (see
            ``InterleavedRows``); batches then carry ``position_ids``, ``document_ids``,
            ``cu_seqlens`` and ``image_counts`` (per row) instead of ``attention_mask``.
        batch_size: samples per data-parallel rank per micro-batch.
        seed, num_workers, allow_plan_change, pin_memory, prefetch_factor, broadcast_within: see
            ``PlanDataModule``.

    Example::

        dm = ImageTextDataModule("imagefolder", max_text_len=64, batch_size=32, tokenizer="gpt2",
                                 num_image_tokens=16, load_kwargs={"data_dir": "photos/"}, num_workers=4)
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        path: str,
        max_text_len: int,
        batch_size: int,
        tokenizer: str | None = None,
        processor: str | None = None,
        name: str | None = None,
        split: str = "train",
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        image_field: str = "image",
        text_field: str = "text",
        prompt_field: str | None = None,
        prompt: str = "",
        image_size: int | None = None,
        resize_mode: str | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        transform: Callable[[Any], Any] | None = None,
        num_image_tokens: int | None = None,
        image_token: str | None = None,
        add_bos: bool = False,
        val_split: str | None = None,
        val_fraction: float = 0.0,
        on_bad_sample: str = "raise",
        load_kwargs: dict[str, Any] | None = None,
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
        test_split: str | None = None,
        test_fraction: float = 0.0,
        layout: str = "pairs",
        max_images: int = 16,
        separator: str = "\n\n",
        loss_before_first_image: bool = True,
        pack_sequences: bool = False,
        max_images_per_row: int | None = None,
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
        self.source = ImageTextSource(
            path,
            tokenizer=tokenizer,
            processor=processor,
            name=name,
            split=split,
            data_files=data_files,
            image_field=image_field,
            text_field=text_field,
            prompt_field=prompt_field,
            prompt=prompt,
            image_size=image_size,
            resize_mode=resize_mode,
            mean=mean,
            std=std,
            transform=transform,
            num_image_tokens=num_image_tokens,
            image_token=image_token,
            add_bos=add_bos,
            val_split=val_split,
            val_fraction=val_fraction,
            on_bad_sample=on_bad_sample,
            load_kwargs=dict(load_kwargs or {}),
            storage_options=storage_options,
            file_cache_dir=file_cache_dir,
            file_cache_bytes=file_cache_bytes,
            file_cache_policy=file_cache_policy,
            test_split=test_split,
            test_fraction=test_fraction,
            layout=layout,
            max_images=max_images,
            separator=separator,
            loss_before_first_image=loss_before_first_image,
            max_images_per_row=max_images_per_row,
        )
        self.pack_sequences = pack_sequences
        self.save_hyperparameters(ignore=["transform", "storage_options"])  # credentials stay out of checkpoints

    def source_specs(self) -> list[ImageTextSource]:
        return [self.source]

    test_options = "give it test_split or test_fraction"

    def build_sources(self) -> list[tuple[str, ImageTextSamples, dict[str, ImageTextSamples]]]:
        return [("train", *self.source.build(self.max_text_len, self.pack_sequences, self.job))]

    @property
    def bad_samples(self) -> BadSampleLog:
        """The samples skipped in this process so far (``on_bad_sample="skip"``): ``reasons`` by
        sample, and ``replacements`` made (a sample met twice counts twice)."""
        self._require_setup()
        return self._train.bad_samples
