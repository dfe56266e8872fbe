"""``in_order=False``: batches handed over as workers finish them, so a slow fetch does not stall the
rank; the order is then not reproducible, but a run stopped and resumed trains every batch exactly once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import HiddenStatesDataModule
from datamodules.plan.loader import POSITION
from examples.hidden_states_server import HiddenStatesServer
from tests.speculative.speculative_data import conversations, tiny_verifier
from tests.support import RecordingModel, quiet_trainer

ROWS, ROW_LEN, MODEL = 60, 64, "tiny-llama"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("out_of_order") / "data"
    conversations(ROWS).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with HiddenStatesServer(tiny_verifier(), MODEL, [1, 2, 3], tmp_path_factory.mktemp("served")) as running:
        yield running


def slow_rows(dm: HiddenStatesDataModule, rows: list[int]):
    """Faults that make every conversation of packed training rows ``rows`` (first pass) slow."""
    source = dm._train
    wanted = [source.first + c for r in rows for c in source.packed.row(0, r).tolist()]
    slow = {tuple(tokens["input_ids"].tolist()) for tokens in source.conversations(wanted).values()}
    return lambda number, prompt: "slow" if tuple(prompt) in slow else None


def datamodule(data_dir: Path, server: HiddenStatesServer, in_order: bool, workers: int = 2) -> HiddenStatesDataModule:
    dm = HiddenStatesDataModule(
        str(data_dir),
        total_seq_len=ROW_LEN,
        on_missing="generate",
        on_generate="delete",  # every pass asks the server again
        server={"urls": [server.url], "model": MODEL},
        num_workers=workers,
        in_order=in_order,
        seed=5,
    )
    dm.setup("fit")
    return dm


def test_in_order_false_needs_worker_processes(data_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"in_order=False hands over batches .* needs num_workers > 0"):
        HiddenStatesDataModule(str(data_dir), total_seq_len=ROW_LEN, in_order=False)


@pytest.mark.parametrize("in_order", [True, False])
def test_batches_after_a_slow_fetch_overtake_it_only_out_of_order(
    data_dir: Path, server: HiddenStatesServer, in_order: bool
) -> None:
    dm = datamodule(data_dir, server, in_order=False)
    server.faults, server.slow_seconds = slow_rows(dm, [1]), 1.5
    dm = datamodule(data_dir, server, in_order=in_order)
    batches = list(dm.train_dataloader())
    positions = [b[POSITION] for b in batches] if not in_order else list(range(len(batches)))
    assert sorted(positions) == list(range(len(dm._train)))  # every packed row once
    assert (positions == sorted(positions)) == in_order  # out of order, row 1 arrives after later rows
    server.faults = None


def test_an_out_of_order_run_stopped_and_resumed_trains_every_batch_exactly_once(
    data_dir: Path, server: HiddenStatesServer, tmp_path: Path
) -> None:
    def fit(max_steps: int, resume: Path | None = None) -> list[dict]:
        dm = datamodule(data_dir, server, in_order=False)
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
        model = RecordingModel()
        quiet_trainer(max_steps=max_steps, callbacks=[checkpoint], limit_val_batches=0).fit(
            model, datamodule=dm, ckpt_path=resume
        )
        return model.records

    planner = datamodule(data_dir, server, in_order=False)
    rows = len(planner._train)
    # Row 1 blocks one worker for 3 s; the other trains rows 0, 2, 4, 5, 6, 7 meanwhile, so at the step-6
    # checkpoint rows 1 and 3 (queued behind it) are still in flight: a gap, whatever the timing.
    server.faults, server.slow_seconds = slow_rows(planner, [1]), 3.0
    before = fit(6)
    state = torch.load(tmp_path / "epoch=0-step=6.ckpt", weights_only=True)["HiddenStatesDataModule"]
    assert state["trained_out_of_order"]["spans"][0], "the checkpoint holds batches trained past a gap"
    server.faults = None
    after = fit(rows, resume=tmp_path / "epoch=0-step=6.ckpt")
    trained = Counter(d for r in before + after for d in r["rows"])
    expected = Counter(d for r in in_order_epoch(data_dir, server, rows) for d in r["rows"])
    assert len(before) + len(after) == rows
    assert trained == expected


def in_order_epoch(data_dir: Path, server: HiddenStatesServer, steps: int) -> list[dict]:
    """The records of an uninterrupted epoch of ``steps`` packed rows, trained in plan order."""
    model = RecordingModel()
    dm = datamodule(data_dir, server, in_order=True, workers=0)
    quiet_trainer(max_steps=steps, limit_val_batches=0).fit(model, datamodule=dm)
    return model.records


def test_an_out_of_order_checkpoint_resumes_only_on_the_ranks_that_saved_it(
    data_dir: Path, server: HiddenStatesServer
) -> None:
    dm = datamodule(data_dir, server, in_order=False)
    state = {"positions_consumed": 2, "trained_out_of_order": {"ranks": 2, "batch_size": 1, "spans": [[5], [6]]}}
    with pytest.raises(ValueError, match="in_order=False.* on 2 data-parallel ranks .* not on 1 ranks"):
        dm.load_state_dict(state)
