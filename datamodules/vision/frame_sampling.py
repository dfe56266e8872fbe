"""Frame sampling policies: which timestamps of a clip to decode, from its duration and frame rate.

A policy is a registered class; ``frame_sampling`` in a config names it. Policies return seconds
from the clip's start, sorted; a policy that draws at random draws from the sample's plan key (one
uint64, a pure function of seed and plan position), so the frames are the same with any worker
count and after resume.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from datamodules.plan.arguments import require_int

FRAME_SAMPLERS: dict[str, type[FrameSampler]] = {}


class FrameSampler(ABC):
    """Timestamps to decode from a clip of ``duration`` seconds at ``frame_rate`` frames per second.

    Args:
        max_frames: frames per sample in the batch (the frame axis); a policy returns at most this many.
    """

    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        FRAME_SAMPLERS[cls.name] = cls

    def __init__(self, max_frames: int) -> None:
        self.max_frames = require_int("max_frames", max_frames, 1)

    @abstractmethod
    def timestamps(self, duration: float, frame_rate: float, key: int) -> np.ndarray:
        """Sorted seconds in ``[0, last frame]``; ``key`` seeds any random choice."""

    @staticmethod
    def last_frame(duration: float, frame_rate: float) -> float:
        """When the clip's last frame starts: one frame before its end (0 for a one-frame clip)."""
        return max(duration - 1.0 / frame_rate, 0.0)

    def describe(self) -> str:
        return f"{self.name}:{sorted(vars(self).items())}"


class UniformFrames(FrameSampler):
    """``n = clamp(round(duration * fps), min_frames, max_frames)`` timestamps evenly spaced from
    the first frame to the last, both included.

    Args:
        fps: frames sampled per second of clip.
        min_frames: fewest frames sampled (a short clip repeats its nearest frames).
    """

    name = "uniform"

    def __init__(self, max_frames: int, fps: float = 1.0, min_frames: int = 1) -> None:
        super().__init__(max_frames)
        if not (isinstance(fps, (int, float)) and fps > 0 and math.isfinite(fps)):
            raise ValueError(f"fps must be a positive number of frames per second, got {fps!r}")
        self.fps = float(fps)
        self.min_frames = require_int("min_frames", min_frames, 1)
        if self.min_frames > self.max_frames:
            raise ValueError(f"min_frames={min_frames} is above max_frames={max_frames}")

    def timestamps(self, duration: float, frame_rate: float, key: int) -> np.ndarray:
        n = min(max(round(duration * self.fps), self.min_frames), self.max_frames)
        return np.linspace(0.0, self.last_frame(duration, frame_rate), n)


class FixedCountFrames(FrameSampler):
    """``num_frames`` timestamps (default ``max_frames``): the clip cut into that many equal
    segments, one frame from each: its middle, or with ``random_offset`` a point drawn uniformly in
    it from the sample's plan key (temporal jitter for training)."""

    name = "fixed_count"

    def __init__(self, max_frames: int, num_frames: int | None = None, random_offset: bool = False) -> None:
        super().__init__(max_frames)
        self.num_frames = max_frames if num_frames is None else require_int("num_frames", num_frames, 1)
        if self.num_frames > self.max_frames:
            raise ValueError(f"num_frames={num_frames} is above max_frames={max_frames}")
        self.random_offset = bool(random_offset)

    def timestamps(self, duration: float, frame_rate: float, key: int) -> np.ndarray:
        n = self.num_frames
        if self.random_offset:
            offsets = np.random.default_rng(key).random(n)
        else:
            offsets = np.full(n, 0.5)
        return (np.arange(n) + offsets) / n * self.last_frame(duration, frame_rate)


def frame_sampler(name: str, max_frames: int, **options: object) -> FrameSampler:
    """The registered policy ``name`` with its ``options``, or a clear error."""
    if name not in FRAME_SAMPLERS:
        raise ValueError(f"frame_sampling must be one of {sorted(FRAME_SAMPLERS)}, got {name!r}")
    try:
        return FRAME_SAMPLERS[name](max_frames, **options)
    except TypeError as err:
        raise ValueError(f"frame_sampling {name!r} does not take options {sorted(options)}: {err}") from None
