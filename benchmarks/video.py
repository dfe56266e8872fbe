"""Clips/s and frames/s of our decoder (exact and keyframe accuracy) against decoding the whole
stream and against torchcodec, and of ``VideoDataModule``'s train loader against the decoder alone,
on the same clips in one run.

Clips: ``--seconds`` (60) at 30 fps, H.264 with libx264's defaults (B-frames on), encoded here, with a
keyframe every 2 s and every 10 s. 8 frames per clip (``fixed_count``: the middle of 8 equal
segments). Decoders, one process, no loader: ours exact (``read_frames``: seek to the keyframe before
a target when that skips frames, else decode forward, non-reference frames no target needs dropped
by ``skip_frame="NONREF"``), ours at ``frame_accuracy="keyframe"`` (keyframes only), the whole stream
(decode every frame from the start through the last target, keep the nearest: what a
decode-everything loader does) and torchcodec in its ``exact`` and ``approximate`` seek modes
(``get_frames_played_at``, in a process of its own: ``benchmarks/peer_decoders/torchcodec_speed.py``); all convert
and resize the 8 frames alike. Frames decoded per clip are counted once, untimed: the whole stream
over ours exact is the ceiling of exact decoding's speed-up. The loader: ``train_dataloader()`` at
``num_workers`` 0 and 2 (captions tokenized, uint8 frames as they go to the device, where
``on_after_batch_transfer`` normalizes them), against ours alone in one process and in 2 processes at
once. Alternating rounds, medians; torch on one thread per process: ``python -m benchmarks.video``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from itertools import takewhile
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

from benchmarks.common import (
    add_run_arguments,
    data_directory,
    in_processes_at_once,
    report,
    result_of,
    results_directory,
)
from benchmarks.loader_throughput import endless, throughput
from benchmarks.peer_decoders.torchcodec_speed import environment
from datamodules.vision.frame_sampling import frame_sampler
from datamodules.vision.images import ResizeImage
from datamodules.vision.video_decoding import FrameReader, open_clip, probe, read_frames
from examples.default_images import train_caption_tokenizer

FRAMES = 8
EXACT, KEYFRAME, WHOLE = "exact (ours, read_frames)", "keyframe (ours, frame_accuracy='keyframe')", "whole stream"
TORCHCODEC = ("exact", "approximate")


def frame(i: int, width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """A moving gradient with a bar and mild noise: content an encoder cannot make free."""
    x = np.arange(width, dtype=np.float32)[None, :, None]
    y = np.arange(height, dtype=np.float32)[:, None, None]
    base = (x + 2 * i) / width * 160 + y / height * 60 + np.array([30, 80, 140], dtype=np.float32)
    picture = base + rng.normal(0, 3, (height, width, 3)).astype(np.float32)
    bar = (i * 7) % width
    picture[:, bar : bar + 16] = 250
    return np.clip(picture, 0, 255).astype(np.uint8)


def encode(path: Path, seconds: int, keyframe_seconds: int, size: tuple[int, int], seed: int) -> Path:
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        stream.time_base = stream.codec_context.time_base = Fraction(1, 30)
        g = str(30 * keyframe_seconds)
        stream.codec_context.options = {"g": g, "keyint_min": g, "sc_threshold": "0"}  # libx264's defaults else
        for i in range(seconds * 30):
            video_frame = av.VideoFrame.from_ndarray(frame(i, *size, rng), format="rgb24")
            video_frame.pts = i
            container.mux(stream.encode(video_frame))
        container.mux(stream.encode(None))
    return path


def write_clips(directory: Path, count: int, seconds: int, size: tuple[int, int], rows: int) -> dict[int, Path]:
    """``count`` clips per keyframe spacing (2 s, 10 s) as ``clips/gop{k}_{i}.mp4`` and, per spacing, a
    captions file of ``rows`` rows cycling over them (a long epoch from few clips)."""
    (directory / "clips").mkdir(parents=True, exist_ok=True)
    out = {}
    for keyframe_seconds in (2, 10):
        names = [f"clips/gop{keyframe_seconds}_{i}.mp4" for i in range(count)]
        for i, name in enumerate(names):
            encode(directory / name, seconds, keyframe_seconds, size, seed=i)
        captions = directory / f"captions_gop{keyframe_seconds}.jsonl"
        lines = [
            json.dumps({"video": names[r % count], "text": f"clip {r} of a bar moving right"}) for r in range(rows)
        ]
        captions.write_text("\n".join(lines) + "\n")
        out[keyframe_seconds] = captions
    return out


def whole_stream(path: str, timestamps_for: Callable[[Any], np.ndarray], convert: Callable[[Any], np.ndarray]) -> Any:
    """Every frame decoded from the start through the last target; each target keeps its nearest."""
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        targets = timestamps_for(probe(container, path))
        container.seek(0)
        kept: list[Any] = []
        before = None
        pending = list(targets)
        for decoded in container.decode(stream):
            t = float(decoded.pts * stream.time_base)
            while pending and t >= pending[0]:
                nearest = before if before is not None and pending[0] - before[0] <= t - pending[0] else (t, decoded)
                kept.append(convert(nearest[1]))
                pending.pop(0)
            if not pending:
                break
            before = (t, decoded)
        return targets, kept


def decoders(image_size: int) -> dict[str, Callable[[str], Any]]:
    sampler = frame_sampler("fixed_count", FRAMES)
    resize = ResizeImage(image_size, "crop")

    def convert(video_frame: Any) -> np.ndarray:
        picture = torch.from_numpy(video_frame.to_ndarray(format="rgb24", threads=1)).permute(2, 0, 1)
        return resize.resize(picture).numpy()

    def timestamps(info: Any) -> np.ndarray:
        return sampler.timestamps(info.duration, info.frame_rate, 0)

    return {
        EXACT: lambda path: read_frames(path, timestamps, convert),
        KEYFRAME: lambda path: read_frames(path, timestamps, convert, accuracy="keyframe"),
        WHOLE: lambda path: whole_stream(path, timestamps, convert),
    }


def frames_decoded(path: str, accuracy: str | None) -> int:
    """Frames the decoder outputs for one clip: ours at ``accuracy``, or (``None``) the whole stream."""
    timestamps = frame_sampler("fixed_count", FRAMES).timestamps
    container = open_clip(path)
    try:
        info = probe(container, path)
        targets = timestamps(info.duration, info.frame_rate, 0)
        if accuracy is None:
            container.seek(0)
            last = targets[-1] + info.start
            return sum(1 for _ in takewhile(lambda f: f.time <= last + 1 / info.frame_rate, container.decode(video=0)))
        reader = FrameReader(container, path, info, lambda frame: None, accuracy=accuracy)
        reader.read(targets)
        container = reader.container
        return reader.decoded
    finally:
        container.close()


def torchcodec_speed(mode: str, paths: list[str], image_size: int, timed: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.peer_decoders.torchcodec_speed", "--seek-mode", mode]
    command += ["--timed", str(timed), "--image-size", str(image_size), *paths]
    return result_of(command, timeout=120 + 4 * timed, env=environment())


def clip_speed(decode: Callable[[str], Any], paths: list[str], seconds: float) -> float:
    decode(paths[0])
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        decode(paths[count % len(paths)])
        count += 1
    return count / (time.perf_counter() - started)


def decoder_in_process(name: str, image_size: int, paths: list[str], seconds: float, ready: Callable[[], Any]) -> float:
    decode = decoders(image_size)[name]
    decode(paths[0])
    ready()
    return clip_speed(decode, paths, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clips", type=int, default=3, help="clips per keyframe spacing")
    parser.add_argument("--seconds", type=int, default=60, help="clip length")
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--timed", type=float, default=6.0, help="timed seconds per contender per round")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.clips, args.seconds, args.width, args.height, args.image_size = 1, 12, 160, 90, 32
        args.rounds, args.timed, args.batch_size = 1, 0.5, 2
    torch.set_num_threads(1)
    from datamodules import VideoDataModule

    with data_directory(args.data_dir) as directory:
        manifests = write_clips(directory, args.clips, args.seconds, (args.width, args.height), rows=400)
        captions = [f"clip {r} of a bar moving right" for r in range(400)]
        tokenizer = train_caption_tokenizer(captions, directory / "tokenizer", vocab_size=300)
        speeds: dict[str, list[float]] = {}
        loaders: dict[str, Iterator[Any]] = {}
        clips: dict[int, list[str]] = {}
        for gop, manifest in manifests.items():
            clips[gop] = [str(directory / f"clips/gop{gop}_{i}.mp4") for i in range(args.clips)]
            for workers in (0, 2):
                dm = VideoDataModule(
                    str(directory), str(tokenizer), max_text_len=24, batch_size=args.batch_size,
                    manifest=manifest.name, frame_sampling="fixed_count", max_frames=FRAMES,
                    image_size=args.image_size, num_workers=workers,
                )  # fmt: skip
                dm.prepare_data()
                dm.setup("fit")
                loaders[f"keyframe every {gop} s | VideoDataModule, num_workers={workers}"] = endless(
                    dm.train_dataloader
                )
        named = decoders(args.image_size)
        errors: dict[str, str] = {}
        for _ in range(args.rounds):  # alternating, so drift hits all alike
            for gop, paths in clips.items():
                at = f"keyframe every {gop} s | "
                for name, decode in named.items():
                    speeds.setdefault(at + name, []).append(clip_speed(decode, paths, args.timed))
                for mode in TORCHCODEC if not args.quick else ():  # a smoke run leaves the peer out
                    measured = torchcodec_speed(mode, paths, args.image_size, args.timed)
                    if "error" in measured:
                        errors[f"torchcodec ({mode})"] = measured["error"]
                    else:
                        speeds.setdefault(f"{at}torchcodec, seek_mode={mode!r}", []).append(measured["clips/s"])
                if args.quick:  # a smoke run: two fresh interpreters cost more than the rest of it
                    together = 2 * speeds[at + EXACT][-1]
                else:
                    together = in_processes_at_once(decoder_in_process, (EXACT, args.image_size, paths, args.timed), 2)
                speeds.setdefault(f"{at}{EXACT}, 2 processes at once", []).append(together)
            for name, batches in loaders.items():
                speeds.setdefault(name, []).append(throughput(batches, args.batch_size, 4, args.timed)["tokens/s"])
        decoded = {
            (gop, name): statistics.mean(frames_decoded(path, accuracy) for path in paths)
            for gop, paths in clips.items()
            for name, accuracy in ((EXACT, "exact"), (KEYFRAME, "keyframe"), (WHOLE, None))
        }
    median = {name: statistics.median(v) for name, v in speeds.items()}
    rows, checks = [], {}
    for gop in clips:
        at = f"keyframe every {gop} s | "
        exact, keyframe, whole = (median[at + name] for name in (EXACT, KEYFRAME, WHOLE))
        alone, together = exact, median[f"{at}{EXACT}, 2 processes at once"]
        for name, speed in median.items():
            if name.startswith(at):
                cores = 2 if name.endswith(("num_workers=2", "at once")) else 1
                floor = alone if cores == 1 else together / 2
                row = {
                    "keyframes": f"every {gop} s",
                    "contender": name[len(at) :],
                    "clips/s": speed,
                    "frames/s": speed * FRAMES,
                    "per core": speed / cores,
                    "of the whole stream": speed / cores / whole,
                    "of ours alone on as many cores": speed / cores / floor,
                }
                if (gop, name[len(at) :]) in decoded:
                    row["frames decoded per clip"] = decoded[gop, name[len(at) :]]
                rows.append(row)
        ceiling = decoded[gop, WHOLE] / decoded[gop, EXACT]
        w0, w2 = median[at + "VideoDataModule, num_workers=0"], median[at + "VideoDataModule, num_workers=2"]
        goal = {2: 4.0, 10: 1.6}.get(gop, 1.6)
        checks[
            f"keyframe every {gop} s: exact >= {goal}x the whole stream ({exact / whole:.2f}x; ceiling about "
            f"{ceiling:.2f}x: the whole stream decodes {decoded[gop, WHOLE]:.0f} frames, exact needs "
            f"{decoded[gop, EXACT]:.0f}, every reference frame between a keyframe and its target)"
        ] = exact >= goal * whole
        if gop == 10:
            checks[f"keyframe every {gop} s: keyframe accuracy >= 5x the whole stream ({keyframe / whole:.2f}x)"] = (
                keyframe >= 5 * whole
            )
        checks[
            f"keyframe every {gop} s: loader at 2 workers >= 0.8 of the decoder alone on 2 processes, per process "
            f"({w2 / together:.2f}; workers 0: {w0 / alone:.2f} of it in one)"
        ] = w2 >= 0.8 * together
    columns = ["keyframes", "contender", "clips/s", "frames/s", "per core", "of the whole stream"]
    columns += ["of ours alone on as many cores", "frames decoded per clip"]
    config = {"clips_per_spacing": args.clips, "seconds": args.seconds, "size": f"{args.width}x{args.height}"}
    config.update({f"{name} did not run": error for name, error in errors.items()})
    report(
        "video",
        {
            f"{FRAMES} frames from {args.seconds} s 30 fps {args.width}x{args.height} H.264 clips to "
            f"{args.image_size}x{args.image_size}, medians of {args.rounds} rounds": (columns, rows)
        },
        config,
        checks,
        results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
