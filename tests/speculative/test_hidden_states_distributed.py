"""HiddenStatesDataModule under real multi-process DDP on CPU (gloo), Lightning's default
``use_distributed_sampler=True``: every packed row once per epoch, validation once, elastic resume.

Runs go through ``tests/scripts/train_record.py`` (Lightning's ``ddp`` re-launches ``sys.argv``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch

from datamodules import HiddenStatesDataModule
from examples.hidden_states_server import HiddenStatesServer
from tests.distributed_support import Run, train_record
from tests.speculative.speculative_data import conversations, speculative_dataset, tiny_verifier
from tests.support import row_digest

ROWS, ROW_LEN = 60, 64


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return speculative_dataset(tmp_path_factory.mktemp("speculative"), ROWS)


def train(data_dir: Path, root: Path, devices: int, failing_ranks: int = 0, **kw: object) -> Run:
    args = ["--hidden-states", str(data_dir), "--seq-len", str(ROW_LEN), "--batch-size", "1", "--devices", str(devices)]
    args += ["--strategy", "ddp" if devices > 1 else "auto"]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return train_record(args, root, failing_ranks=failing_ranks)


def planned_conversations(data_dir: Path, ranks: int) -> tuple[Counter, Counter, int]:
    """Digests of the conversations in the first pass's packed rows that one epoch on ``ranks`` ranks
    trains, of every validation conversation, and the number of rows a pass."""
    dm = HiddenStatesDataModule(str(data_dir), total_seq_len=ROW_LEN)
    dm.setup("fit")
    tokens = datasets.load_from_disk(str(data_dir))["input_ids"]
    digest = [row_digest(torch.tensor(t)) for t in tokens]
    rows = len(dm._train) // ranks * ranks
    train = Counter(digest[c] for r in range(rows) for c in dm._train.packed.row(0, r).tolist())
    return train, Counter(digest[dm._train.stop :]), len(dm._train)


def test_two_ddp_ranks_train_every_packed_row_once_per_epoch_and_validate_every_held_out_row_once(
    data_dir: Path, tmp_path: Path
) -> None:
    run = train(data_dir, tmp_path, devices=2, max_epochs=1)
    expected_train, expected_val, rows = planned_conversations(data_dir, ranks=2)
    steps = rows // 2
    assert len(run.records(0)) == len(run.records(1)) == steps
    assert Counter(run.rows(0) + run.rows(1)) == expected_train
    assert Counter(run.validated(0) + run.validated(1)) == expected_val
    info = run.info(0)
    assert info["dp_size"] == 2 and info["sampler_is_datamodule_sampler"] and info["sampler_type"] == "PlanSampler"


def test_elastic_resume_of_a_2_rank_checkpoint_on_1_rank_trains_every_row_once(data_dir: Path, tmp_path: Path) -> None:
    stopped = train(data_dir, tmp_path / "two", devices=2, max_steps=5, every_n_steps=3)
    resumed = train(data_dir, tmp_path / "one", devices=1, max_epochs=1, resume=stopped.checkpoint(3))
    trained = stopped.rows(0, before_step=3) + stopped.rows(1, before_step=3) + resumed.rows(0)
    expected_train, _, rows = planned_conversations(data_dir, ranks=1)
    assert Counter(trained) == expected_train
    assert resumed.info(0)["positions_consumed"] == rows


def test_the_circuit_breaker_stops_both_ddp_ranks_with_one_error_and_leaves_none_hanging(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    conversations(ROWS).save_to_disk(str(data_dir))
    first = tuple(datasets.load_from_disk(str(data_dir))["input_ids"][0])
    # Row 0 generates (setup learns the states' shape from it); every other request fails.
    failing = lambda number, prompt: None if tuple(prompt) == first else "error"  # noqa: E731
    with HiddenStatesServer(tiny_verifier(), "tiny-llama", [1, 2, 3], tmp_path / "served", faults=failing) as server:
        run = train(
            data_dir, tmp_path / "run", devices=2, failing_ranks=2, max_steps=20, server=server.url, max_failures=3
        )
    for rank in (0, 1):
        assert "training stopped on every rank" in run.error(rank) and "(max_failures=3)" in run.error(rank)
    assert len(run.records(0)) == len(run.records(1)) <= 1  # both stopped at the same step
