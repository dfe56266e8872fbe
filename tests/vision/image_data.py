"""Image-text data built in the test: images in several modes and formats, an ``imagefolder`` with
``metadata.jsonl``, broken files, a caption tokenizer and a LLaVA processor made from a config."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from examples.default_images import draw_shape, train_caption_tokenizer

WORDS = "red green blue yellow circle square triangle on a the white black grey picture shows of".split()


def caption(i: int) -> str:
    """A caption unique to row ``i`` (so a row is known by its tokens)."""
    rng = np.random.default_rng(i)
    return f"picture {i} shows " + " ".join(rng.choice(WORDS, size=3 + i % 4))


def tokenizer_for(root: Path) -> str:
    texts = [f"describe the picture {caption(i)} USER: ASSISTANT:" for i in range(200)]
    return str(train_caption_tokenizer(texts, root / "tokenizer", vocab_size=400))


def picture(i: int, size: tuple[int, int]) -> Image.Image:
    import random

    rng = random.Random(i)
    return draw_shape(rng.choice(["circle", "square"]), rng.choice(["red", "blue"]), "grey", size, rng)


def encoded(image: Image.Image, fmt: str, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def image_folder(root: Path, count: int, bad: dict[int, bytes] | None = None, prompts: bool = True) -> Path:
    """``count`` rows of PNG and JPEG pictures (sizes vary) with captions; ``bad`` replaces the
    bytes of some rows' files (a truncated JPEG, an empty file, text named ``.png``)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        size = (40 + (i * 7) % 50, 30 + (i * 5) % 40)
        name = f"{i:04d}.{'jpg' if i % 2 else 'png'}"
        data = encoded(picture(i, size), "JPEG" if i % 2 else "PNG")
        (root / name).write_bytes((bad or {}).get(i, data))
        row = {"file_name": name, "text": caption(i)}
        if prompts:
            row["question"] = "describe the picture" + "!" * (i % 3)
        rows.append(row)
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def metadata(folder: Path) -> list[dict]:
    """The rows of ``folder``'s ``metadata.jsonl``."""
    return [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]


def truncated_jpeg() -> bytes:
    data = encoded(picture(0, (64, 48)), "JPEG")
    return data[: len(data) // 2]


BROKEN = {
    "truncated JPEG": truncated_jpeg,
    "zero-byte file": lambda: b"",
    "text named .png": lambda: b"hello, not a png\n",
}
