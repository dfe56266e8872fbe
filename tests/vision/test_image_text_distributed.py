"""ImageTextDataModule under real multi-process DDP on CPU (gloo): coverage, validation once, elastic resume.

Runs go through ``tests/scripts/train_record.py`` (Lightning's ``ddp`` re-launches ``sys.argv``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from datamodules import ImageTextSource
from tests.distributed_support import Run, resumed_on_two_ranks
from tests.vision.distributed_vision import source_digests, train_vision
from tests.vision.image_data import image_folder, tokenizer_for

ROWS, TEXT_LEN, BATCH = 40, 24, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("images")
    return image_folder(root / "images", ROWS, prompts=False), tokenizer_for(root)


def train(data: tuple[Path, str], root: Path, devices: int, **kw: object) -> Run:
    return train_vision("image-folder", data, root, TEXT_LEN, BATCH, devices, **kw)


def source_rows(data: tuple[Path, str], val_fraction: float) -> tuple[Counter, Counter]:
    folder, tokenizer = data
    return source_digests(
        ImageTextSource(
            "imagefolder",
            tokenizer,
            num_image_tokens=2,
            image_size=8,
            val_fraction=val_fraction,
            load_kwargs={"data_dir": str(folder)},
        ),
        TEXT_LEN,
    )


def test_two_ddp_ranks_train_every_row_once_per_epoch_and_evaluate_every_held_out_row_once(
    data: tuple[Path, str], tmp_path: Path
) -> None:
    run = train(data, tmp_path, devices=2, val_fraction=0.2, max_epochs=1, workers=2)
    train_rows, val_rows = source_rows(data, 0.2)
    rank0, rank1 = run.rows(0), run.rows(1)
    assert len(rank0) == len(rank1) == 16  # 32 training rows: 4 steps of 2 ranks x 4
    assert Counter(rank0 + rank1) == train_rows
    assert Counter(run.validated(0) + run.validated(1)) == val_rows
    assert run.info(0)["dp_size"] == 2 and run.info(0)["sampler_is_datamodule_sampler"]


def test_elastic_resume_of_a_1_rank_checkpoint_on_2_ranks_trains_every_row_once_without_padding(
    data: tuple[Path, str], tmp_path: Path
) -> None:
    # 40 rows, 10 one-rank steps per epoch; stopped after 3 (12 rows), resumed on 2 ranks to the epoch end.
    stopped = train(data, tmp_path / "one", devices=1, max_steps=5, every_n_steps=3)
    resumed = train(data, tmp_path / "two", devices=2, max_epochs=1, resume=stopped.checkpoint(3))
    # 12 positions, then 4 steps of 8 (the epoch end, 40, rounded up to whole 2-rank steps): 44 positions, no
    # padding row; the first 40 hold every row once, the last 4 open the next pass.
    trained = resumed_on_two_ranks(stopped, resumed, BATCH, stop_step=3)
    assert len(trained) == ROWS + 4
    assert Counter(trained[p] for p in range(ROWS)) == source_rows(data, 0.0)[0]
