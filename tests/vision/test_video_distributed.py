"""VideoDataModule under real multi-process DDP on CPU (gloo): coverage, validation once, elastic resume.

Runs go through ``tests/scripts/train_record.py`` (Lightning's ``ddp`` re-launches ``sys.argv``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from datamodules import VideoSource
from examples.default_images import train_caption_tokenizer
from tests.distributed_support import Run, resumed_on_two_ranks
from tests.vision.distributed_vision import source_digests, train_vision
from tests.vision.video_data import video_caption, video_folder

CLIPS, TEXT_LEN, BATCH = 40, 20, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("videos")
    tokenizer = train_caption_tokenizer([video_caption(i) for i in range(200)], root / "tokenizer", vocab_size=300)
    return video_folder(root / "videos", CLIPS), str(tokenizer)


def train(data: tuple[Path, str], root: Path, devices: int, **kw: object) -> Run:
    return train_vision("video-folder", data, root, TEXT_LEN, BATCH, devices, **kw)


def source_rows(data: tuple[Path, str], val_fraction: float) -> tuple[Counter, Counter]:
    folder, tokenizer = data
    return source_digests(
        VideoSource(str(folder), tokenizer, image_size=8, max_frames=4, val_fraction=val_fraction), TEXT_LEN
    )


def test_two_ddp_ranks_train_every_clip_once_per_epoch_and_evaluate_every_held_out_clip_once(
    data: tuple[Path, str], tmp_path: Path
) -> None:
    run = train(data, tmp_path, devices=2, val_fraction=0.2, max_epochs=1, workers=2)
    train_rows, val_rows = source_rows(data, 0.2)
    rank0, rank1 = run.rows(0), run.rows(1)
    assert len(rank0) == len(rank1) == 16  # 32 training clips: 4 steps of 2 ranks x 4
    assert Counter(rank0 + rank1) == train_rows
    assert Counter(run.validated(0) + run.validated(1)) == val_rows
    assert run.info(0)["dp_size"] == 2 and run.info(0)["sampler_is_datamodule_sampler"]


def test_elastic_resume_of_a_1_rank_checkpoint_on_2_ranks_trains_every_clip_once_without_padding(
    data: tuple[Path, str], tmp_path: Path
) -> None:
    stopped = train(data, tmp_path / "one", devices=1, max_steps=5, every_n_steps=3)
    resumed = train(data, tmp_path / "two", devices=2, max_epochs=1, resume=stopped.checkpoint(3))
    # 12 positions, then 4 steps of 8 (the epoch end, 40, rounded up to whole 2-rank steps): 44 positions, no
    # padding row; the first 40 hold every clip once, the last 4 open the next pass.
    trained = resumed_on_two_ranks(stopped, resumed, BATCH, stop_step=3)
    assert len(trained) == CLIPS + 4
    assert Counter(trained[p] for p in range(CLIPS)) == source_rows(data, 0.0)[0]
