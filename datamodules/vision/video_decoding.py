"""Decoding the frames nearest to chosen timestamps of a clip with PyAV, seeking only when it saves work.

A clip is opened once; its duration comes from the container, else the video stream, else a
fallback the caller knows (a manifest's), else by counting the stream's packets. Targets are visited
in order: when the keyframe before the next target lies past the frame just decoded (keyframes taken
as evenly spaced from the first two),
the decoder seeks (to the keyframe before the target) instead of decoding every frame in between;
otherwise it decodes forward. The keyframe interval is measured per clip from the stream's first
packets, so a clip with a keyframe every 2 s seeks and one with a single keyframe decodes through.

Each target gets the decoded frame whose presentation time is nearest (the earlier on a tie): the
frame a decode-everything reference picks. Frame times are the stream's timestamps, so a variable
frame rate needs nothing special.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from datamodules.plan.bad_samples import BadSample
from datamodules.plan.remote_files import LOCAL_FILES, RemoteFiles
from datamodules.plan.storage import is_url

_PROBE_PACKETS = 2000  # packets read at most to find the second keyframe


@dataclass(frozen=True)
class ClipInfo:
    """What the frame policy and the decoder need to know of a clip (seconds)."""

    duration: float
    frame_rate: float
    start: float
    keyframe_interval: float  # inf: one keyframe in the probed packets
    first_keyframe: float = 0.0

    def keyframe_before(self, t: float) -> float:
        """Where the keyframe at or before ``t`` is expected, keyframes being evenly spaced (a seek
        lands on the real one: an estimate that is off costs time, never a wrong frame)."""
        if not math.isfinite(self.keyframe_interval):
            return self.first_keyframe
        return (
            self.first_keyframe
            + math.floor((t - self.first_keyframe) / self.keyframe_interval) * self.keyframe_interval
        )


def _stream(container: Any, path: str) -> Any:
    if not container.streams.video:
        raise BadSample(f"{path} has no video stream")
    return container.streams.video[0]


def _seconds(value: Any, time_base: Any) -> float | None:
    return None if value is None or time_base is None else float(value * time_base)


def _packet_times(container: Any, stream: Any) -> Iterator[tuple[float | None, bool]]:
    for packet in container.demux(stream):
        if packet.size:
            yield _seconds(packet.pts, stream.time_base), bool(packet.is_keyframe)


def probe(container: Any, path: str, fallback_duration: float | None = None) -> ClipInfo:
    """The clip's duration, frame rate, first timestamp and keyframe spacing; a ``BadSample`` if
    it has no video stream or no length."""
    stream = _stream(container, path)
    start = _seconds(stream.start_time, stream.time_base) or 0.0
    duration = container.duration / av.time_base if container.duration else None
    duration = duration or _seconds(stream.duration, stream.time_base) or fallback_duration
    keyframes: list[float] = []
    times: list[float] = []
    packets = 0
    counted = duration is None
    for time, keyframe in _packet_times(container, stream):
        packets += 1
        if time is not None:
            times.append(time)
            if keyframe:
                keyframes.append(time)
        if not counted and (len(keyframes) > 1 or packets >= _PROBE_PACKETS):
            break
    rate = stream.average_rate or stream.guessed_rate
    frame_rate = float(rate) if rate else None
    if counted and packets:  # no length anywhere: count the frames
        if len(times) > 1:
            frame_rate = frame_rate or (len(times) - 1) / max(max(times) - min(times), 1e-9)
            duration = max(times) - start + 1.0 / frame_rate
        elif frame_rate:
            duration = packets / frame_rate
    if not duration or duration <= 0 or not packets:
        raise BadSample(f"{path} has no frames (zero length)")
    if not frame_rate or not math.isfinite(frame_rate):
        frame_rate = packets / duration
    interval = keyframes[1] - keyframes[0] if len(keyframes) > 1 else math.inf
    return ClipInfo(float(duration), float(frame_rate), start, interval, keyframes[0] if keyframes else start)


def _nearest(target: float, before: tuple[float, Any] | None, after: tuple[float, Any] | None) -> Any:
    if after is None:
        return before[1]
    if before is None:
        return after[1]
    return before[1] if target - before[0] <= after[0] - target else after[1]


class FrameReader:
    """The frames nearest to sorted timestamps of one open clip, each through ``convert``.

    Args:
        container: an open PyAV input container, already probed. path: the clip, for messages and
            to reopen it (a stream that cannot seek back, such as raw H.264, is read again).
        info: its ``probe``. convert: a decoded ``av.VideoFrame`` to an array (RGB, resized).
        files: how ``path`` is read (a URL through the storage layer).
    """

    def __init__(
        self,
        container: Any,
        path: str,
        info: ClipInfo,
        convert: Callable[[Any], np.ndarray],
        files: RemoteFiles = LOCAL_FILES,
    ) -> None:
        self.container = container
        self.path = path
        self.files = files
        self.info = info
        self.convert = convert
        self.seeks = 0
        self.decoded = 0
        self.damage = ""  # why decoding stopped early, if it did
        self.last_time = -math.inf  # the latest frame decoded

    def _frames(self, at: float | None) -> Iterator[tuple[float, Any]]:
        """Decoded frames with their times, from the keyframe before ``at`` (``None``: the start)."""
        stream = self.container.streams.video[0]
        try:
            if at is None:
                self.container.seek(0)
            else:
                self.container.seek(int(at / stream.time_base), stream=stream, backward=True, any_frame=False)
                self.seeks += 1
        except av.FFmpegError:  # not seekable: read again from the start, frames timed by count
            self.container.close()
            self.container, at = open_clip(self.path, files=self.files), None
            stream = self.container.streams.video[0]
        frames = self.container.decode(stream)
        index = 0
        while True:
            try:
                frame = next(frames)
            except StopIteration:
                return
            except av.FFmpegError as err:  # a damaged packet: the stream ends here
                self.damage = f"{type(err).__name__}: {err}"
                return
            self.decoded += 1
            if frame.pts is not None:
                time = float(frame.pts * stream.time_base)
            elif at is None:  # a stream without timestamps: the frame's place in it
                time = self.info.start + index / self.info.frame_rate
            else:
                continue
            index += 1
            self.last_time = max(self.last_time, time)
            yield time, frame

    def read(self, timestamps: np.ndarray) -> list[np.ndarray]:
        """One converted frame per timestamp (seconds from the clip's start, sorted)."""
        info = self.info
        tolerance = 1.5 / info.frame_rate  # a target this far past the last frame: the stream ended early
        out: list[np.ndarray] = []
        frames: Iterator[tuple[float, Any]] | None = None
        before: tuple[float, Any] | None = None  # the last frame decoded before the target
        after: tuple[float, Any] | None = None  # the first frame at or past it
        for t in np.asarray(timestamps, dtype=np.float64) + info.start:
            decoded_up_to = after[0] if after else before[0] if before else info.first_keyframe
            # Seek when the keyframe before the target lies past what is decoded: the frames between
            # are then skipped rather than decoded.
            skips = info.keyframe_before(t) > decoded_up_to + 1e-6
            if frames is None or skips:
                seek_to = t if skips else None
                frames, before, after = self._frames(seek_to), None, None
                after = next(frames, None)
                if after is not None and after[0] > t and seek_to is not None and seek_to > info.start:
                    # The seek landed past the target (an index without that keyframe): from the start.
                    frames = self._frames(None)
                    after = next(frames, None)
            while after is not None and after[0] < t:
                before, after = after, next(frames, None)
            if after is None and (before is None or t - before[0] > tolerance):
                last = self.last_time - info.start
                end = f"at {last:.3f} s" if math.isfinite(last) else "before its first frame"
                why = f" ({self.damage})" if self.damage else ""
                raise BadSample(
                    f"{self.path}: the stream ends {end}{why}, before {t - info.start:.3f} s of its stated "
                    f"duration {info.duration:.3f} s"
                )
            out.append(self.convert(_nearest(t, before, after)))
        return out


def open_clip(path: str, threads: int = 1, files: RemoteFiles = LOCAL_FILES) -> Any:
    """An open PyAV container of ``path`` (a URL is opened through ``files``: its cached copy, or its
    bytes in memory), or a ``BadSample`` saying why it cannot be read."""
    source: Any = path
    if is_url(path):
        try:
            source = files.open(path)
        except FileNotFoundError as err:
            raise BadSample(str(err)) from None
        if not source.read(1):
            raise BadSample(f"{path} is an empty file (0 bytes)")
        source.seek(0)
    elif os.path.isfile(path) and os.path.getsize(path) == 0:
        raise BadSample(f"{path} is an empty file (0 bytes)")
    try:
        container = av.open(source, metadata_errors="ignore")
    except (av.FFmpegError, OSError, UnicodeDecodeError) as err:
        raise BadSample(f"{path} cannot be opened as a video ({type(err).__name__}: {err})") from None
    if container.streams.video:
        context = container.streams.video[0].codec_context
        context.thread_count = threads
    return container


def read_frames(
    path: str,
    timestamps_for: Callable[[ClipInfo], np.ndarray],
    convert: Callable[[Any], np.ndarray],
    fallback_duration: float | None = None,
    files: RemoteFiles = LOCAL_FILES,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(timestamps, frames)`` of a clip: ``timestamps_for(probe)`` chooses the seconds, each gets
    its nearest frame. Any decoding failure is a ``BadSample`` naming the file."""
    container = open_clip(path, files=files)
    try:
        info = probe(container, path, fallback_duration)
        timestamps = np.sort(np.asarray(timestamps_for(info), dtype=np.float64))
        reader = FrameReader(container, path, info, convert, files)
        try:
            return timestamps, reader.read(timestamps)
        finally:
            container = reader.container
    except av.FFmpegError as err:
        raise BadSample(f"{path} cannot be decoded ({type(err).__name__}: {err})") from None
    finally:
        container.close()
