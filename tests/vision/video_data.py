"""Clips encoded in the test with PyAV (H.264 in MP4 unless asked): frame rates, lengths, keyframe
spacing, variable frame rate, and broken files."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np


def frame_picture(i: int, size: tuple[int, int]) -> np.ndarray:
    """Frame ``i``: a moving bar over a colour that changes with ``i``, so frames differ visibly."""
    w, h = size
    picture = np.zeros((h, w, 3), dtype=np.uint8)
    picture[:] = ((i * 37) % 256, (i * 11) % 256, 255 - (i * 23) % 256)
    x = (i * 5) % max(w - 8, 1)
    picture[:, x : x + 8] = 255
    return picture


def encode_clip(
    path: Path,
    seconds: float,
    fps: int = 30,
    size: tuple[int, int] = (64, 48),
    keyframe_every: int | None = None,
    frame_times: list[float] | None = None,
    faststart: bool = False,
    audio_seconds: float | None = None,
    bframes: bool = False,
) -> Path:
    """An MP4 (or MKV, by suffix) of ``seconds`` at ``fps`` (or frames at ``frame_times``: a variable
    frame rate), a keyframe every ``keyframe_every`` frames (default: x264's choice), B-frames as
    x264 places them with ``bframes``, and an AAC track of ``audio_seconds`` beside it if given."""
    times = frame_times if frame_times is not None else [i / fps for i in range(round(seconds * fps))]
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.time_base = Fraction(1, 1000 if frame_times is not None else fps)
        stream.codec_context.time_base = stream.time_base
        codec_options = {"preset": "ultrafast", "bframes": "0"} if keyframe_every is None else {}
        if keyframe_every is not None:
            codec_options = {"g": str(keyframe_every), "keyint_min": str(keyframe_every), "sc_threshold": "0"}
        if bframes:
            codec_options = {k: v for k, v in codec_options.items() if k not in ("preset", "bframes")}
        stream.codec_context.options = codec_options
        audio = container.add_stream("aac", rate=16000) if audio_seconds else None
        for i in range(round((audio_seconds or 0) * 16000 / 1024)):
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            samples.sample_rate, samples.pts = 16000, i * 1024
            container.mux(audio.encode(samples))
        if audio is not None:
            container.mux(audio.encode(None))
        for i, t in enumerate(times):
            frame = av.VideoFrame.from_ndarray(frame_picture(i, size), format="rgb24")
            frame.pts = round(t / stream.time_base)
            frame.time_base = stream.time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def decode_everything(path: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    """Every frame's time (seconds, from the stream's start) and RGB pixels: the reference."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        start = float((stream.start_time or 0) * stream.time_base)
        frames = [
            (float(f.pts * stream.time_base) - start, f.to_ndarray(format="rgb24")) for f in container.decode(stream)
        ]
    return np.array([t for t, _ in frames]), [p for _, p in frames]


def nearest_reference(path: Path, timestamps: np.ndarray) -> list[np.ndarray]:
    """The reference's frame nearest each timestamp (the earlier on a tie)."""
    times, pictures = decode_everything(path)
    return [pictures[int(np.argmin(np.abs(times - t)))] for t in timestamps]


def video_caption(i: int) -> str:
    """A caption unique to clip ``i`` (so a sample is known by its tokens)."""
    rng = np.random.default_rng(1000 + i)
    words = "a bar moves over red green blue light dark slowly quickly left right".split()
    return f"clip {i} shows " + " ".join(rng.choice(words, size=2 + i % 3))


def clip_seconds(i: int) -> float:
    return 1.0 + (i % 4) * 0.5  # 1 to 2.5 s: uniform at 2 fps samples 2 to 5 frames


def video_folder(root: Path, count: int, broken: dict[int, str] | None = None, fps: int = 10) -> Path:
    """``count`` clips ``clips/{i:03d}.mp4`` under ``root`` (``broken[i]`` names a kind to write
    instead: ``"empty"``, ``"corrupt"``, ``"audio"``, ``"cut"``) and ``captions.jsonl``."""
    clips = root / "clips"
    clips.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        path = clips / f"{i:03d}.mp4"
        kind = (broken or {}).get(i)
        if kind is None:
            encode_clip(path, clip_seconds(i), fps + (i % 2) * 5, size=(40, 30), keyframe_every=5)
        else:
            write_broken(path, kind)
        rows.append({"video": f"clips/{i:03d}.mp4", "text": video_caption(i)})
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def write_broken(path: Path, kind: str) -> Path:
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "corrupt":
        path.write_bytes(np.random.default_rng(0).bytes(3000))
    elif kind == "audio":
        with av.open(str(path), "w") as container:
            stream = container.add_stream("aac", rate=16000)
            for i in range(10):
                frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
                frame.sample_rate, frame.pts = 16000, i * 1024
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
    elif kind == "cut":  # its index (written first) promises 4 s; half the bytes remain
        whole = encode_clip(path, 4, 10, size=(40, 30), keyframe_every=5, faststart=True).read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    else:
        raise ValueError(kind)
    return path
