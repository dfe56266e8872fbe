"""Frame policies and PyAV decoding against a decode-everything reference, on clips encoded here."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from datamodules.vision.frame_sampling import frame_sampler
from datamodules.vision.images import BadSample
from datamodules.vision.video_decoding import FrameReader, open_clip, probe, read_frames
from tests.vision.video_data import decode_everything, encode_clip, frame_picture, nearest_reference


def rgb(frame: av.VideoFrame) -> np.ndarray:
    return frame.to_ndarray(format="rgb24")


def test_uniform_policy_clamps_and_spans_first_to_last_frame():
    policy = frame_sampler("uniform", max_frames=8, fps=1.0, min_frames=2)
    times = policy.timestamps(duration=5.0, frame_rate=10.0, key=0)
    np.testing.assert_allclose(times, np.linspace(0.0, 4.9, 5))  # round(5 s x 1 fps) = 5; last frame at 4.9 s
    assert len(policy.timestamps(60.0, 30.0, 0)) == 8  # clamped to max_frames
    assert len(policy.timestamps(0.4, 30.0, 0)) == 2  # clamped to min_frames
    np.testing.assert_allclose(policy.timestamps(0.04, 25.0, 0), [0.0, 0.0])  # a one-frame clip


def test_fixed_count_policy_centres_or_draws_from_the_key():
    centred = frame_sampler("fixed_count", max_frames=8, num_frames=4)
    np.testing.assert_allclose(centred.timestamps(4.1, 10.0, 0), [0.5, 1.5, 2.5, 3.5])
    jittered = frame_sampler("fixed_count", max_frames=4, random_offset=True)
    a, b = jittered.timestamps(4.1, 10.0, 7), jittered.timestamps(4.1, 10.0, 8)
    np.testing.assert_array_equal(a, jittered.timestamps(4.1, 10.0, 7))  # a pure function of the key
    assert not np.array_equal(a, b)
    assert all(i <= t < i + 1 for i, t in enumerate(a))  # one in each of the four 1 s segments


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("every_other", {}, "frame_sampling must be one of"),
        ("uniform", {"fps": 0}, "fps must be a positive"),
        ("uniform", {"min_frames": 9}, "min_frames=9 is above max_frames=8"),
        ("fixed_count", {"num_frames": 12}, "num_frames=12 is above max_frames=8"),
        ("uniform", {"num_frames": 4}, "does not take options ['num_frames']"),
    ],
)
def test_bad_policy_options_are_named(name, options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        frame_sampler(name, 8, **options)


CLIPS = {
    "30 fps, keyframe every 2 s": {"seconds": 12, "fps": 30, "keyframe_every": 60},
    "24 fps, encoder's keyframes": {"seconds": 5, "fps": 24},
    "one keyframe in 20 s": {"seconds": 20, "fps": 30, "keyframe_every": 600},
    "variable frame rate": {
        "seconds": 0,
        "frame_times": np.cumsum(np.random.default_rng(0).uniform(0.01, 0.1, 120)).round(3).tolist(),
    },
    "0.2 s": {"seconds": 0.2, "fps": 25},
}


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("policy", [{"name": "uniform", "fps": 2.0, "min_frames": 4}, {"name": "fixed_count"}])
def test_frames_equal_the_decode_everything_reference(tmp_path, clip, policy):
    path = encode_clip(tmp_path / "clip.mp4", **CLIPS[clip])
    sampler = frame_sampler(policy["name"], 8, **{k: v for k, v in policy.items() if k != "name"})
    times, frames = read_frames(str(path), lambda info: sampler.timestamps(info.duration, info.frame_rate, 0), rgb)
    reference = nearest_reference(path, times)
    assert len(frames) == len(times) > 0
    for got, want in zip(frames, reference, strict=True):
        np.testing.assert_array_equal(got, want)  # pixel-equal: the same decoded frame


VFR_TIMES = np.cumsum([0.0, *np.random.default_rng(0).uniform(0.02, 0.09, 99)]).round(3).tolist()


def uniform_frames(path: Path, max_frames: int = 8) -> tuple[np.ndarray, list[np.ndarray]]:
    policy = frame_sampler("uniform", max_frames, fps=30.0)
    return read_frames(str(path), lambda info: policy.timestamps(info.duration, info.frame_rate, 0), rgb)


@pytest.mark.parametrize("audio_seconds", [4.1, 4.3, 3.6], ids=["audio +0.1 s", "audio +0.3 s", "audio -0.4 s"])
def test_an_audio_track_longer_or_shorter_than_the_video_does_not_change_its_timing(tmp_path, audio_seconds):
    path = encode_clip(tmp_path / "clip.mp4", 4.0, 30, audio_seconds=audio_seconds, bframes=True)
    with av.open(str(path)) as container:
        assert (container.duration / 1e6 > 4.05) == (audio_seconds > 4)  # the container's length is the audio's
    times, frames = uniform_frames(path, max_frames=120)
    reference_times, _ = decode_everything(path)
    assert len(frames) == 120 and times[-1] == pytest.approx(reference_times[-1]) == pytest.approx(119 / 30)
    for got, want in zip(frames, nearest_reference(path, times), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("suffix", ["mp4", "mkv"])
def test_a_variable_frame_rate_clip_is_sampled_to_its_last_frame(tmp_path, suffix):
    path = encode_clip(tmp_path / f"vfr.{suffix}", 0, frame_times=VFR_TIMES, bframes=True, keyframe_every=30)
    times, frames = uniform_frames(path)
    reference_times, _ = decode_everything(path)
    assert times[0] == 0 and times[-1] == pytest.approx(VFR_TIMES[-1]) == pytest.approx(reference_times[-1])
    for got, want in zip(frames, nearest_reference(path, times), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_timestamp_exactly_between_two_frames_gets_the_earlier_one(tmp_path):
    times = [i / 10 for i in range(20)]  # 0.1 s apart, in a 1/1000 s time base
    path = encode_clip(tmp_path / "ties.mp4", 0, frame_times=times)
    midpoints = np.array([0.05 + i / 10 for i in range(19)])  # 0.45 is a little above 0.45 as a float
    _, frames = read_frames(str(path), lambda info: midpoints, rgb)
    _, pictures = decode_everything(path)
    for i, got in enumerate(frames):
        np.testing.assert_array_equal(got, pictures[i])


def test_seeks_only_when_keyframes_are_dense(tmp_path):
    def decode(path: Path) -> FrameReader:
        container = open_clip(str(path))
        info = probe(container, str(path))
        reader = FrameReader(container, str(path), info, rgb)
        reader.read(frame_sampler("fixed_count", 8).timestamps(info.duration, info.frame_rate, 0))
        container.close()
        return reader

    dense = decode(encode_clip(tmp_path / "dense.mp4", 60, 30, keyframe_every=60))
    assert dense.info.keyframe_interval == pytest.approx(2.0)
    assert dense.seeks == 8 and dense.decoded < 8 * 60  # at most a keyframe interval per target
    sparse = decode(encode_clip(tmp_path / "sparse.mp4", 20, 30, keyframe_every=600))
    assert sparse.seeks == 0 and sparse.decoded <= 600  # one pass, never past the last target


def test_a_stream_without_timestamps_is_timed_by_counting(tmp_path):
    path = tmp_path / "raw.h264"
    with av.open(str(path), "w", format="h264") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(50):
            frame = av.VideoFrame.from_ndarray(frame_picture(i, (64, 48)), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    seen = []
    times, frames = read_frames(str(path), lambda info: seen.append(info) or np.array([0.0, 0.99, 1.96]), rgb)
    assert seen[0].duration == pytest.approx(2.0)  # 50 frames at 25 fps, counted
    with av.open(str(path)) as container:
        everything = [rgb(f) for f in container.decode(video=0)]
    for got, index in zip(frames, [0, 25, 49], strict=True):
        np.testing.assert_array_equal(got, everything[index])


def broken_clips(root: Path) -> dict[str, tuple[Path, str]]:
    """Each broken kind, with what its message says."""
    (root / "empty.mp4").write_bytes(b"")
    (root / "noise.mp4").write_bytes(np.random.default_rng(0).bytes(5000))
    (root / "text.mp4").write_text("not a video\n")
    whole = encode_clip(root / "whole.mp4", 10, 30, keyframe_every=30, faststart=True).read_bytes()
    (root / "cut.mp4").write_bytes(whole[: len(whole) // 2])  # the index promises 10 s
    sparse = encode_clip(root / "sparse.mp4", 10, 30, keyframe_every=90, faststart=True).read_bytes()
    (root / "cut_tail.mp4").write_bytes(sparse[: len(sparse) * 95 // 100])  # cut after its last keyframe
    with av.open(str(root / "audio.mp4"), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        for i in range(10):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return {
        "zero-length": (root / "empty.mp4", "is an empty file"),
        "corrupt": (root / "noise.mp4", "cannot be opened as a video"),
        "text": (root / "text.mp4", "cannot be opened as a video"),
        "ends early": (root / "cut.mp4", "of its stated duration 10.000 s"),
        "ends in its last keyframe interval": (
            root / "cut_tail.mp4",
            "the video stream ends at 9.* the 10.000 s its header",
        ),
        "no video stream": (root / "audio.mp4", "has no video stream"),
        "missing": (root / "absent.mp4", "cannot be opened as a video"),
    }


def test_broken_clips_are_bad_samples_naming_the_file(tmp_path):
    policy = frame_sampler("uniform", 8, fps=1.0)
    for kind, (path, message) in broken_clips(tmp_path).items():
        with pytest.raises(BadSample, match=message) as caught:
            read_frames(str(path), lambda info: policy.timestamps(info.duration, info.frame_rate, 0), rgb)
        assert str(path) in str(caught.value), kind


def test_non_reference_frames_are_skipped_and_the_frames_stay_the_references(tmp_path):
    path = encode_clip(tmp_path / "b.mp4", 20, 30, bframes=True, keyframe_every=600)  # one keyframe
    container = open_clip(str(path))
    info = probe(container, str(path))
    reader = FrameReader(container, str(path), info, rgb)
    times = frame_sampler("fixed_count", 8).timestamps(info.duration, info.frame_rate, 0)
    frames = reader.read(times)
    container.close()
    reference_times, _ = decode_everything(path)
    through_last = int(np.searchsorted(reference_times, times[-1])) + 1
    assert reader.seeks == 0 and reader.decoded < 0.9 * through_last  # B-frames no later frame needs: skipped
    for got, want in zip(frames, nearest_reference(path, times), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("keyframe_every", [15, 75, 600])
def test_keyframe_accuracy_returns_the_nearest_keyframes_with_their_own_times(tmp_path, keyframe_every):
    path = encode_clip(tmp_path / "k.mp4", 10, 30, bframes=True, keyframe_every=keyframe_every)
    targets = np.array([0.2, 0.24, 1.3, 2.5, 2.6, 5.0, 7.49, 9.9])
    times, frames = read_frames(str(path), lambda info: targets, rgb, accuracy="keyframe")
    reference_times, pictures = decode_everything(path)
    keyframes = reference_times[::keyframe_every]
    expected = [int(np.argmin(np.abs(keyframes - t))) * keyframe_every for t in targets]
    np.testing.assert_allclose(times, reference_times[expected])
    for got, index in zip(frames, expected, strict=True):
        np.testing.assert_array_equal(got, pictures[index])
    with av.open(str(path)) as container:
        assert all(frame.key_frame for frame in container.decode(video=0) if frame.time in set(times))
