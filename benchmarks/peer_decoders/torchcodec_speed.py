"""torchcodec's decoding speed on the video benchmark's clips, measured in a process of its own:
``python -m benchmarks.peer_decoders.torchcodec_speed --seek-mode exact --timed 6 CLIP...`` prints
``RESULT {"clips/s": ...}`` (or the reason it cannot run).

torchcodec loads FFmpeg's shared libraries from the system. Where there are none (as on the machines
here), ``environment()`` points the loader at the FFmpeg PyAV bundles, linked under the names
torchcodec looks for (same FFmpeg major version); the variable must be set before the process starts,
so the measurement runs in a fresh one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

FFMPEG_LIBRARIES = ("avcodec", "avdevice", "avfilter", "avformat", "avutil", "swresample", "swscale")


def environment() -> dict[str, str]:
    """This process's environment plus ``LD_LIBRARY_PATH`` reaching PyAV's bundled FFmpeg as ``libX.so.N``."""
    import av

    bundled = Path(av.__file__).resolve().parent.parent / "av.libs"
    linked = Path(tempfile.mkdtemp(prefix="torchcodec-ffmpeg-"))
    for library in FFMPEG_LIBRARIES:
        for found in bundled.glob(f"lib{library}-*.so.*"):
            major = re.search(r"\.so\.(\d+)", found.name).group(1)
            (linked / f"lib{library}.so.{major}").symlink_to(found)
    paths = [str(linked), str(bundled), os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, "LD_LIBRARY_PATH": ":".join(p for p in paths if p)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("clips", nargs="+")
    parser.add_argument("--seek-mode", choices=("exact", "approximate"), default="exact")
    parser.add_argument("--timed", type=float, default=6.0)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--frames", type=int, default=8)
    args = parser.parse_args()
    import torch
    from torchcodec.decoders import VideoDecoder

    from benchmarks.video import clip_speed
    from datamodules.vision.frame_sampling import frame_sampler
    from datamodules.vision.images import ResizeImage

    torch.set_num_threads(1)
    sampler, resize = frame_sampler("fixed_count", args.frames), ResizeImage(args.image_size, "crop")

    def decode(path: str) -> list:
        decoder = VideoDecoder(path, seek_mode=args.seek_mode, num_ffmpeg_threads=1)
        meta = decoder.metadata
        duration = meta.end_stream_seconds - meta.begin_stream_seconds
        timestamps = sampler.timestamps(duration, meta.average_fps, 0) + meta.begin_stream_seconds
        frames = decoder.get_frames_played_at(timestamps.tolist()).data
        return [resize.resize(frame).numpy() for frame in frames]

    print("RESULT " + json.dumps({"clips/s": clip_speed(decode, args.clips, args.timed)}))


if __name__ == "__main__":
    main()
