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
    tokens an image becomes is measured once, by the processor itself. Processors whose pixel shape
    or token count depends on the image size (dynamic resolution) are refused: every batch here has
    one shape.

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
        seen = {self._measure(size) for size in ((64, 48), (640, 480))}
        if len(seen) != 1:
            raise ValueError(
                f"processor {name!r} gives image-size dependent shapes {sorted(seen)} (pixels, image tokens); "
                "batches here have one shape, so a fixed-resolution image processor is needed"
            )
        (self.pixel_shape, self.num_image_tokens) = seen.pop()

    def _measure(self, size: tuple[int, int]) -> tuple[tuple[int, ...], int]:
        out = self._processor(text=self.image_token, images=Image.new("RGB", size), return_tensors="np")
        ids = np.asarray(out["input_ids"])
        return tuple(np.asarray(out["pixel_values"]).shape[1:]), int((ids == self.image_token_id).sum())

    def pixels(self, image: Image.Image) -> np.ndarray:
        return self.pixels_of([image])[0]

    def pixels_of(self, images: list[Image.Image]) -> list[np.ndarray]:
        """The pixels of several images, in one call of the image processor."""
        if not images:
            return []
        out = np.asarray(self.image_processor(images, return_tensors="np")["pixel_values"], dtype=np.float32)
        return list(out)

    def normalize(self, pixels: Any) -> Any:
        return pixels  # the processor's pixels are final

    def template(self, prompt: str) -> str:
        if self.chat_template is None:
            return f"{self.image_token}\n{prompt}"
        content: list[dict[str, Any]] = [{"type": "image"}] + ([{"type": "text", "text": prompt}] if prompt else [])
        messages = [{"role": "user", "content": content}]
        return self._processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
