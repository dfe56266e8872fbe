"""WebDataset shards under real multi-process DDP on CPU (gloo): every sample of 3 shards once per pass
on 2 ranks x 2 workers, held-out samples evaluated once, and the 2-rank run resumed on 1 rank."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import pytest

from datamodules import ImageTextSource
from tests.distributed_support import Run, rows_by_position, train_record
from tests.storage.test_tar_index import index_files
from tests.vision.distributed_vision import source_digests, train_vision
from tests.vision.image_data import image_folder, tokenizer_for
from tests.vision.webdataset_data import shards_of_folder

pytest.importorskip("webdataset")

SAMPLES, TEXT_LEN, BATCH = 40, 24, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("webdataset")
    folder = image_folder(root / "images", SAMPLES, prompts=False)
    return shards_of_folder(folder, root / "shards", per_shard=14), tokenizer_for(root)  # 3 shards: 14, 14, 12


def train(data: tuple[str, str], root: Path, devices: int, **kw: object) -> Run:
    return train_vision("webdataset", data, root, TEXT_LEN, BATCH, devices, cache_dir=root / "index", **kw)


def source_rows(data: tuple[str, str], root: Path, val_fraction: float) -> tuple[Counter, Counter]:
    pattern, tokenizer = data
    source = ImageTextSource(
        "webdataset",
        tokenizer,
        data_files=pattern,
        image_field="jpg;png",
        text_field="txt",
        num_image_tokens=2,
        image_size=8,
        val_fraction=val_fraction,
        load_kwargs={"cache_dir": str(root / "index")},
    )
    return source_digests(source, TEXT_LEN)


def test_two_ranks_with_two_workers_train_every_sample_once_and_a_resume_on_one_rank_continues_the_plan(
    data: tuple[str, str], tmp_path: Path
) -> None:
    # 32 training samples: 4 steps of 2 ranks x 4; a checkpoint after step 2 (16 positions).
    run = train(data, tmp_path / "two", devices=2, val_fraction=0.2, max_epochs=1, workers=2, every_n_steps=2)
    train_rows, val_rows = source_rows(data, tmp_path, 0.2)
    rank0, rank1 = run.rows(0), run.rows(1)
    assert len(rank0) == len(rank1) == 16
    assert Counter(rank0 + rank1) == train_rows and sum(train_rows.values()) == 32
    assert Counter(run.validated(0) + run.validated(1)) == val_rows and sum(val_rows.values()) == 8
    # The index cache started empty: the ranks split the shards, and wrote what one process writes.
    for rank, count in ((0, 2), (1, 1)):
        assert f"indexed {count} of the 3 tar shards the job lacked here (rank {rank} of 2)" in run.output()
    assert index_files(tmp_path / "two" / "index") == index_files(tmp_path / "index")
    # Elastic: the 2-rank checkpoint resumed on 1 rank trains the other half of the epoch, each sample once.
    resumed = train(data, tmp_path / "one", devices=1, val_fraction=0.2, max_epochs=1, resume=run.checkpoint(2))
    before = rows_by_position(run, 2, BATCH, before_step=2)
    after = rows_by_position(resumed, 1, BATCH, first_position=2 * 2 * BATCH)
    assert sorted(before) + sorted(after) == list(range(32)), "a position was skipped or trained twice"
    assert Counter({**before, **after}.values()) == train_rows


def test_a_shard_replaced_under_a_two_rank_run_stops_every_rank_naming_it_in_skip_mode_too(
    data: tuple[str, str], tmp_path: Path
) -> None:
    pattern, tokenizer = data
    shards = Path(pattern).parent
    for shard in shards.glob("*.tar"):  # a copy of its own: the module's shards stay as they are
        (tmp_path / "shards").mkdir(exist_ok=True)
        (tmp_path / "shards" / shard.name).write_bytes(shard.read_bytes())
    target, other = tmp_path / "shards" / "shard-000000.tar", tmp_path / "shards" / "shard-000001.tar"
    args = ["--webdataset", str(tmp_path / "shards" / Path(pattern).name), "--tokenizer", tokenizer]
    args += ["--seq-len", str(TEXT_LEN), "--batch-size", str(BATCH), "--devices", "2", "--strategy", "ddp"]
    args += ["--max-epochs", "3", "--workers", "2", "--cache-dir", str(tmp_path / "index"), "--on-bad-sample", "skip"]
    args += ["--replace-shard", f"2:{target}:{other}"]
    run = train_record(args, tmp_path / "run", failing_ranks=2)
    for rank in range(2):
        assert "ChangedDuringRun: " in run.error(rank) and "shard-000000.tar changed during the run" in run.error(rank)
        assert "Traceback" not in run.error(rank), "the reason is the worker's message, not its traceback"
        assert len(run.records(rank)) < 3 * 5, "the run trained on after the shard changed"


def test_two_nodes_with_caches_of_their_own_index_each_shard_once_and_both_hold_every_index(
    data: tuple[str, str], tmp_path: Path
) -> None:
    pattern, tokenizer = data
    args = ["--webdataset", pattern, "--tokenizer", tokenizer, "--seq-len", str(TEXT_LEN), "--batch-size", str(BATCH)]
    args += ["--strategy", "ddp", "--max-steps", "2", "--cache-dir", str(tmp_path / "node{node}")]
    run = train_record(args, tmp_path / "run", num_nodes=2)
    logs = run.output()
    for rank, count in ((0, 2), (1, 1)):  # each shard indexed by one rank of the job, not once per node
        assert f"indexed {count} of the 3 tar shards the job lacked here (rank {rank} of 2)" in logs
    source_rows(data, tmp_path, 0.0)  # one process's index files, in tmp_path / "index"
    assert index_files(tmp_path / "node0") == index_files(tmp_path / "node1") == index_files(tmp_path / "index")
    assert len(run.rows(0)) == len(run.rows(1)) == 2 * BATCH


def test_a_shard_refused_while_two_ranks_index_stops_both_ranks_naming_it(
    data: tuple[str, str], tmp_path: Path
) -> None:
    pattern, tokenizer = data
    shards = tmp_path / "shards"
    shards.mkdir()
    for shard in sorted(Path(pattern).parent.glob("*.tar")):
        (shards / shard.name).write_bytes(shard.read_bytes())
    middle = shards / "shard-000001.tar"  # dealt to rank 1: rank 0 indexes shards 0 and 2 fine
    middle.write_bytes(gzip.compress(middle.read_bytes()))
    args = ["--webdataset", str(shards / Path(pattern).name), "--tokenizer", tokenizer, "--seq-len", str(TEXT_LEN)]
    args += ["--batch-size", str(BATCH), "--devices", "2", "--strategy", "ddp", "--max-steps", "2"]
    run = train_record([*args, "--cache-dir", str(tmp_path / "index")], tmp_path / "run", failing_ranks=2)
    for rank in (0, 1):
        assert f"{middle} is a gzip-compressed tar" in run.error(rank)
