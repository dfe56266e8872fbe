"""Decoding the frames nearest to chosen timestamps of a clip with PyAV, seeking only when it saves work.

A clip is opened once; its timing is the video stream's own: the first frame's time (the packets
of its first keyframe interval) and the last frame's (the packets from its last keyframe on), both
demuxed without decoding, never the container's duration, which includes an audio track that may
outlast the video. Only a stream without timestamps takes the container's or a manifest's length,
else counts its packets. Targets are visited
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

import bisect
import io
import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from datamodules.plan.bad_samples import BadSample, check_policy
from datamodules.storage.locations import is_url
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles

_PROBE_PACKETS = 2000  # packets read at most to find the second keyframe
_END = 2**62  # a seek target past any stream's end: lands on its last keyframe


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


def _demuxed(container: Any, stream: Any) -> Iterator[Any]:
    """``container.demux(stream)``, closed however the caller stops: PyAV's demux generator, dropped
    unfinished, leaks its read buffer (about 0.27 KB each; ``benchmarks.soak`` saw the video loader
    grow), while this Python generator runs its ``finally`` when dropped."""
    packets = container.demux(stream)
    try:
        yield from packets
    finally:
        packets.close()


def _packet_times(container: Any, stream: Any) -> Iterator[tuple[float | None, bool]]:
    for packet in _demuxed(container, stream):
        if packet.size:
            yield _seconds(packet.pts, stream.time_base), bool(packet.is_keyframe)


def _last_packet_time(container: Any, stream: Any) -> float | None:
    """The latest presentation time among the packets from the stream's last keyframe on, demuxed
    (not decoded); ``None`` where there are none (a file cut before its last keyframe)."""
    latest = None
    try:
        container.seek(_END, stream=stream, backward=True, any_frame=False)
        for time, _ in _packet_times(container, stream):
            if time is not None and (latest is None or time > latest):
                latest = time
    except av.FFmpegError:  # no index to seek by, or a damaged tail: the caller falls back
        return None
    return latest


def probe(container: Any, path: str, fallback_duration: float | None = None) -> ClipInfo:
    """The clip's video timing: its first and last frame times (from packet timestamps, demuxed, not
    decoded), frame rate and keyframe spacing. The container's duration, which includes any audio, is
    used only for a stream without timestamps. A ``BadSample`` if there is no video stream, no
    length, or the video ends well before its own stream header says."""
    stream = _stream(container, path)
    keyframes: list[float] = []
    times: list[float] = []
    packets = 0
    for time, keyframe in _packet_times(container, stream):
        packets += 1
        if time is not None:
            times.append(time)
            if keyframe:
                keyframes.append(time)
        if len(keyframes) > 1 or packets >= _PROBE_PACKETS:
            break
    if not packets:
        raise BadSample(f"{path} has no frames (zero length)")
    rate = stream.average_rate or stream.guessed_rate
    frame_rate = float(rate) if rate and math.isfinite(float(rate)) and rate > 0 else None
    header = _seconds(stream.duration, stream.time_base)
    if times:
        start = min(times)
        frame_rate = frame_rate or _rate_of(times)
        last = _last_packet_time(container, stream)
        header_end = (_seconds(stream.start_time, stream.time_base) or 0.0) + header if header else None
        if last is None:  # the tail is missing: trust the header, and decoding finds where it really ends
            last = max(max(times), header_end - 1.0 / frame_rate if header_end else -math.inf)
        elif header_end is not None and header_end - (last + 1.0 / frame_rate) > 1.5 / frame_rate:
            raise BadSample(
                f"{path}: the video stream ends at {last - start:.3f} s, before the {header_end - start:.3f} s "
                "its header states"
            )
        duration = last - start + 1.0 / frame_rate
    else:  # no timestamps at all (a raw stream): the container's or the caller's length, else count
        start = _seconds(stream.start_time, stream.time_base) or 0.0
        duration = container.duration / av.time_base if container.duration else None
        duration = duration or header or fallback_duration
        if duration is None:
            packets += sum(1 for _ in _packet_times(container, stream))
            duration = packets / frame_rate if frame_rate else None
    if not duration or duration <= 0:
        raise BadSample(f"{path} has no frames (zero length)")
    frame_rate = frame_rate or packets / duration
    interval = keyframes[1] - keyframes[0] if len(keyframes) > 1 else math.inf
    return ClipInfo(float(duration), float(frame_rate), start, interval, keyframes[0] if keyframes else start)


def _rate_of(times: list[float]) -> float:
    """Frames per second of packets at ``times`` (at least one)."""
    span = max(times) - min(times)
    return (len(times) - 1) / span if len(times) > 1 and span > 0 else 1.0


def _nearest_pair(
    target: float, before: tuple[float, Any] | None, after: tuple[float, Any] | None, tie: float
) -> tuple[float, Any]:
    """The ``(time, frame)`` nearest ``target``; within ``tie`` seconds of the midpoint, the earlier one."""
    if after is None:
        return before
    if before is None:
        return after
    return before if (target - before[0]) - (after[0] - target) <= tie else after


FRAME_ACCURACIES = ("exact", "keyframe")
_LOOKAHEAD = 17  # packets demuxed ahead of the decoder: past any H.264/HEVC reordering (16)


class FrameReader:
    """The frames nearest to sorted timestamps of one open clip, each through ``convert``.

    ``accuracy="exact"``: each target gets the nearest frame. Packets are demuxed a little ahead of
    the decoder, so the presentation times around each packet are known; a packet that cannot be the
    nearest frame of any target is decoded with ``skip_frame="NONREF"``, so the decoder drops it if
    no other frame depends on it (a non-reference B-frame). Reference frames are always decoded, so
    the frames returned are exactly a decode-everything reference's. ``"keyframe"``: only keyframes
    are decoded (``"NONKEY"``) and each target gets the nearest keyframe.

    Args:
        container: an open PyAV input container, already probed. path: the clip, for messages and
            to reopen it (a stream that cannot seek back, such as raw H.264, is read again).
        info: its ``probe``. convert: a decoded ``av.VideoFrame`` to an array (RGB, resized).
        files: how ``path`` is read (a URL through the storage layer).
        accuracy: ``"exact"`` or ``"keyframe"``.
    """

    def __init__(
        self,
        container: Any,
        path: str,
        info: ClipInfo,
        convert: Callable[[Any], np.ndarray],
        files: RemoteFiles | ClipBytes = LOCAL_FILES,
        accuracy: str = "exact",
    ) -> None:
        check_policy(accuracy, FRAME_ACCURACIES, "frame_accuracy")
        self.container = container
        self.path = path
        self.files = files
        self.info = info
        self.convert = convert
        self.accuracy = accuracy
        self.seeks = 0
        self.decoded = 0
        self.damage = ""  # why decoding stopped early, if it did
        self.last_time = -math.inf  # the latest frame decoded
        self.times: list[float] = []  # each target's frame's own time (seconds from the clip's start)
        self._targets = np.empty(0)  # absolute seconds, sorted

    def _seek(self, at: float | None) -> tuple[Any, float | None]:
        """The video stream positioned at the keyframe before ``at`` (``None``: the start), and ``at``
        (``None`` when the clip had to be read again from the start)."""
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
        return stream, at

    def _skip(self, time: float | None, known: list[float]) -> str:
        """How to decode a packet presented at ``time``, given the times of the packets demuxed so far."""
        if self.accuracy == "keyframe":
            return "NONKEY"
        if time is None:
            return "DEFAULT"
        # The targets for which this frame is the nearest lie between the midpoints to its
        # neighbours. A neighbour not demuxed yet only widens the span: decoding more, never less.
        i = bisect.bisect_left(known, time)
        low = (known[i - 1] + time) / 2 - 1e-6 if i > 0 else -math.inf
        high = (time + known[i + 1]) / 2 + 1e-6 if i + 1 < len(known) else math.inf
        first = np.searchsorted(self._targets, low, side="left")
        return "DEFAULT" if first < len(self._targets) and self._targets[first] <= high else "NONREF"

    def _frames(self, at: float | None) -> Iterator[tuple[float, Any]]:
        """Decoded frames with their times, from the keyframe before ``at`` (``None``: the start)."""
        stream, at = self._seek(at)
        context, time_base = stream.codec_context, stream.time_base
        packets = _demuxed(self.container, stream)
        ahead: deque = deque()
        known: list[float] = []  # presentation times of the packets demuxed since the seek, sorted
        index, ended, flushed = 0, False, False
        while True:
            try:
                while not ended and len(ahead) < _LOOKAHEAD:
                    packet = next(packets, None)
                    if packet is None:
                        ended = True
                    elif packet.size:
                        ahead.append(packet)
                        if packet.pts is not None:
                            bisect.insort(known, float(packet.pts * time_base))
                if ahead:
                    packet = ahead.popleft()
                    time = None if packet.pts is None else float(packet.pts * time_base)
                    context.skip_frame = self._skip(time, known)
                    frames = context.decode(packet)
                else:
                    frames, flushed = context.decode(None), True  # the frames still in the decoder
            except av.FFmpegError as err:  # a damaged packet: the stream ends here
                self.damage = f"{type(err).__name__}: {err}"
                return
            for frame in frames:
                self.decoded += 1
                if frame.pts is not None:
                    time = float(frame.pts * time_base)
                elif at is None:  # a stream without timestamps: the frame's place in it
                    time = self.info.start + index / self.info.frame_rate
                else:
                    continue
                index += 1
                self.last_time = max(self.last_time, time)
                yield time, frame
            if flushed:
                return

    def read(self, timestamps: np.ndarray) -> list[np.ndarray]:
        """One converted frame per timestamp (seconds from the clip's start, sorted)."""
        info = self.info
        # A target this far past the last frame decoded: the stream ended early (keyframe mode: a
        # keyframe interval further; a stream that broke off ends early however close).
        tolerance = 1.5 / info.frame_rate + (info.keyframe_interval if self.accuracy == "keyframe" else 0)
        # Frame times are whole ticks of the stream's time base: a target that far from the midpoint
        # of two frames is a tie (float rounding of seconds must not decide it), and goes earlier.
        tie = float(self.container.streams.video[0].time_base or 0) * 1e-6
        self._targets = np.asarray(timestamps, dtype=np.float64) + info.start
        out: list[np.ndarray] = []
        self.times = []
        frames: Iterator[tuple[float, Any]] | None = None
        before: tuple[float, Any] | None = None  # the last frame decoded before the target
        after: tuple[float, Any] | None = None  # the first frame at or past it
        for t in self._targets:
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
            broke_off = self.damage and self.accuracy == "keyframe"
            if after is None and (before is None or t - before[0] > tolerance or broke_off):
                last = self.last_time - info.start
                end = f"at {last:.3f} s" if math.isfinite(last) else "before its first frame"
                why = f" ({self.damage})" if self.damage else ""
                raise BadSample(
                    f"{self.path}: the stream ends {end}{why}, before {t - info.start:.3f} s of its stated "
                    f"duration {info.duration:.3f} s"
                )
            chosen = _nearest_pair(t, before, after, tie)
            self.times.append(chosen[0] - info.start)
            out.append(self.convert(chosen[1]))
        if frames is not None:
            frames.close()
        return out


class ClipBytes:
    """A clip already read into memory (a tar shard's member), in place of the ``files`` that read a
    path: every open, the first and any reopen, reads these bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def open(self, location: str) -> io.BytesIO:
        return io.BytesIO(self.data)


_DECODED_IN: int | None = None  # the process that last opened a clip (``decoded_in_this_process``)


def decoded_in_this_process() -> bool:
    """Whether this process has opened a clip with PyAV. A DataLoader worker forked from it can then
    hang in FFmpeg (its converters' thread pools and locks do not survive a fork: seen as workers
    waiting forever in swscale), so its workers start otherwise (``VideoDataModule.spawn_reasons``)."""
    return _DECODED_IN == os.getpid()


def open_clip(path: str, threads: int = 1, files: RemoteFiles | ClipBytes = LOCAL_FILES) -> Any:
    """An open PyAV container of ``path`` (a URL is opened through ``files``: its cached copy, or its
    bytes in memory; with ``ClipBytes``, ``path`` only names the clip), or a ``BadSample`` saying
    why it cannot be read."""
    source: Any = path
    if is_url(path) or isinstance(files, ClipBytes):
        try:
            source = files.open(path)
        except FileNotFoundError as err:
            raise BadSample(str(err)) from None
        if not source.read(1):
            raise BadSample(f"{path} is an empty file (0 bytes)")
        source.seek(0)
    elif os.path.isfile(path) and os.path.getsize(path) == 0:
        raise BadSample(f"{path} is an empty file (0 bytes)")
    global _DECODED_IN
    _DECODED_IN = os.getpid()
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
    files: RemoteFiles | ClipBytes = LOCAL_FILES,
    accuracy: str = "exact",
) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(timestamps, frames)`` of a clip: ``timestamps_for(probe)`` chooses the seconds, each gets
    its nearest frame (``accuracy="keyframe"``: its nearest keyframe, and the timestamps returned are
    those keyframes' own times). Any decoding failure is a ``BadSample`` naming the file."""
    container = open_clip(path, files=files)
    try:
        info = probe(container, path, fallback_duration)
        timestamps = np.sort(np.asarray(timestamps_for(info), dtype=np.float64))
        reader = FrameReader(container, path, info, convert, files, accuracy)
        try:
            frames = reader.read(timestamps)
            return (np.array(reader.times) if accuracy == "keyframe" else timestamps), frames
        finally:
            container = reader.container
    except av.FFmpegError as err:
        raise BadSample(f"{path} cannot be decoded ({type(err).__name__}: {err})") from None
    finally:
        container.close()
