"""A ``transformers`` VLM processor as our pixels and prompt: its image processor, its chat template,
and how many tokens its model spends on one image, so a real VLM gets the inputs it was built for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from datamodules.plan.hf_loading import load_pretrained


class ProcessorInputs:
    """Pixels and prompt text of a ``transformers`` processor (``AutoProcessor``) by name or path.

    The processor's own image processor makes the pixels (from the RGB image ``read_image`` gives,
    fully decoded, so they equal what the processor makes of that image). Its chat template wraps
    a prompt as one user turn holding the image and the prompt text, with the generation prompt
    after it; a processor without one gets ``"<image token>\\n" + prompt``. How many placeholder
    tokens an image becomes is measured once, by the processor itself.

    A processor whose token count or pixel shape depends on the image size (dynamic resolution:
    Qwen2-VL's patches, tiles) is ``dynamic``: each image's count then comes from its size, by the
    processor's own rule (``_get_num_multimodal_tokens``, checked against its call at two sizes),
    and ``processed`` gives each image's pixels (Qwen2-VL: its rows of patches) with the processor's
    per-image outputs beside them (``image_grid_thw``). Image-text pairs need a fixed count (every
    batch one shape); interleaved documents take either.

    Args:
        name: processor name or local path.
    """

    def __init__(self, name: str) -> None:
        processor = load_pretrained("processor", name)
        for part in ("image_processor", "tokenizer"):
            if getattr(processor, part, None) is None:
                raise ValueError(f"processor {name!r} has no {part}; a vision-language processor is needed")
        self.name = name
        self.normalization = f"processor {name}"
        self.image_processor = processor.image_processor
        self.tokenizer = processor.tokenizer
        self.chat_template = getattr(processor, "chat_template", None)
        self._processor = processor
        self.image_token = getattr(processor, "image_token", None) or getattr(self.tokenizer, "image_token", None)
        if self.image_token is None:
            raise ValueError(f"processor {name!r} names no image token (processor.image_token)")
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))
        sizes = ((64, 48), (640, 480))
        seen = [self._measure(size) for size in sizes]
        self.dynamic = len(set(seen)) != 1
        self.pixel_shape: tuple[int, ...] = seen[0][0]
        self.num_image_tokens: int | None = seen[0][1]
        if self.dynamic:
            counting = getattr(processor, "_get_num_multimodal_tokens", None)
            counts = None if counting is None else self.token_counts(sizes)
            if counts != [tokens for _, tokens in seen] or len({shape for shape, _ in seen}) != 1:
                raise ValueError(
                    f"processor {name!r} gives image-size dependent shapes {seen} (pixels, image tokens) and no "
                    "rule to count an image's tokens from its size that agrees with them"
                )
            self.num_image_tokens = None  # pixels: rows of one shape, as many an image as its size asks
        # The image processor's other outputs, one row an image (``image_grid_thw``), by name: their shapes.
        out = self.image_processor([Image.new("RGB", sizes[0])], return_tensors="np")
        self.extra_shapes = {k: np.asarray(v).shape[1:] for k, v in out.items() if k != "pixel_values"}

    def _measure(self, size: tuple[int, int]) -> tuple[tuple[int, ...], int]:
        out = self._processor(text=self.image_token, images=Image.new("RGB", size), return_tensors="np")
        ids = np.asarray(out["input_ids"])
        return tuple(np.asarray(out["pixel_values"]).shape[1:]), int((ids == self.image_token_id).sum())

    def token_counts(self, sizes: list[tuple[int, int]]) -> list[int]:
        """Placeholder tokens of images of these ``(width, height)`` sizes, by the processor's rule."""
        if not self.dynamic and self.num_image_tokens is not None:
            return [self.num_image_tokens] * len(sizes)
        counted = self._processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
        return [int(n) for n in counted["num_image_tokens"]]

    def processed(self, images: list[Image.Image]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """Each image's pixels, in one call of the image processor, and its other per-image outputs
        (``image_grid_thw``: one row an image). A dynamic processor's pixels are rows of patches,
        split image by image by its own count of each image's patches."""
        if not images:
            return [], {}
        out = self.image_processor(images, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        extras = {k: np.asarray(v) for k, v in out.items() if k != "pixel_values"}
        if not self.dynamic:
            return list(pixels), extras
        patches = self._processor._get_num_multimodal_tokens(image_sizes=[(i.height, i.width) for i in images])
        return np.split(pixels, np.cumsum(patches["num_image_patches"])[:-1]), extras

    def pixels(self, image: Image.Image) -> np.ndarray:
        return self.pixels_of([image])[0]

    def pixels_of(self, images: list[Image.Image]) -> list[np.ndarray]:
        """The pixels of several images, in one call of the image processor."""
        return self.processed(images)[0]

    def normalize(self, pixels: Any) -> Any:
        return pixels  # the processor's pixels are final

    def template(self, prompt: str) -> str:
        if self.chat_template is None:
            return f"{self.image_token}\n{prompt}"
        content: list[dict[str, Any]] = [{"type": "image"}] + ([{"type": "text", "text": prompt}] if prompt else [])
        messages = [{"role": "user", "content": content}]
        return self._processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
