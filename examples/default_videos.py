"""The embedded default video corpus: short clips of a coloured shape moving across the frame, with
captions naming its colour, shape and direction, encoded locally with PyAV (a ``folder`` layout:
``clips/`` and ``captions.jsonl``), and a tokenizer for them. The direction is only in the order
of the frames, so a model must read several of them."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

from examples.default_images import BACKGROUNDS, COLORS, train_caption_tokenizer

PROMPT = "What happens in the clip?"
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def moving_shape_frames(
    shape: str, color: str, direction: str, size: tuple[int, int], frames: int, rng: random.Random
) -> list[np.ndarray]:
    """``frames`` RGB pictures of ``shape`` crossing the frame in ``direction``."""
    w, h = size
    side = min(w, h) // 3
    dx, dy = DIRECTIONS[direction]
    x0, y0 = rng.randint(side, w - 2 * side), rng.randint(side, h - 2 * side)
    span = (w - side) if dx else (h - side)
    out = []
    for i in range(frames):
        t = i / max(frames - 1, 1) - 0.5  # -0.5 to 0.5 of the span
        x = min(max(int(x0 + dx * t * span * 0.8), 0), w - side)
        y = min(max(int(y0 + dy * t * span * 0.8), 0), h - side)
        image = Image.new("RGB", size, BACKGROUNDS["grey"])
        draw = ImageDraw.Draw(image)
        box = (x, y, x + side, y + side)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLORS[color])
        out.append(np.asarray(image))
    return out


def write_clip(path: Path, frames: list[np.ndarray], fps: int, keyframe_every: int) -> None:
    """An H.264 MP4 of ``frames`` at ``fps``, a keyframe every ``keyframe_every`` frames."""
    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.time_base = stream.codec_context.time_base = Fraction(1, fps)
        stream.codec_context.options = {"g": str(keyframe_every), "keyint_min": str(keyframe_every)}
        for i, picture in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def write_moving_shapes(directory: Path, count: int, size: tuple[int, int] = (64, 48), seed: int = 0) -> Path:
    """``count`` clips (1.5 to 3 s at 8 fps) and ``captions.jsonl`` (``video``, ``text``)."""
    if (directory / "captions.jsonl").exists():
        return directory
    (directory / "clips").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        shape, color, direction = (
            rng.choice(["circle", "square"]),
            rng.choice(list(COLORS)),
            rng.choice(list(DIRECTIONS)),
        )
        frames = moving_shape_frames(shape, color, direction, size, rng.randint(12, 24), rng)
        write_clip(directory / "clips" / f"{i:05d}.mp4", frames, fps=8, keyframe_every=8)
        rows.append({"video": f"clips/{i:05d}.mp4", "text": f"a {color} {shape} moves {direction}"})
    (directory / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def build_default_videos(workdir: Path, count: int = 1000) -> tuple[Path, Path]:
    """The quickstart's clips and their tokenizer, under ``workdir``."""
    clips = write_moving_shapes(workdir / "moving_shapes", count)
    rows = [json.loads(line) for line in (clips / "captions.jsonl").read_text().splitlines()]
    tokenizer = train_caption_tokenizer([f"{PROMPT} {r['text']}" for r in rows], workdir / "video_tokenizer")
    return clips, tokenizer
