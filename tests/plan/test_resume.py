"""Exact resume through ``Trainer.fit``: a stopped-and-resumed run trains the same batches."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import MixtureComponent, MixtureDataModule, TokenShardDataModule, TokenShardSource
from datamodules.plan.loader import PlanDataLoader, PlanDataset
from datamodules.plan.sample_plan import PlannedSource, SamplePlan
from datamodules.plan.sampler import PlanSampler
from datamodules.plan.stopping import WorkerDied
from tests.support import RecordingModel, make_token_shards, quiet_trainer

SEQ_LEN, BATCH = 8, 4
STEPS_PER_EPOCH = 10
TOTAL_STEPS = 25


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_token_shards(tmp_path_factory.mktemp("shards"), SEQ_LEN * BATCH * STEPS_PER_EPOCH + 1, shard_tokens=97)


def fit(
    shards: Path,
    max_steps: int,
    num_workers: int,
    ckpt_dir: Path | None = None,
    ckpt_every: int = 0,
    resume: Path | None = None,
    seed: int = 1,
    accumulate: int = 1,
    **options: object,
) -> list[dict]:
    options = {"seq_len": SEQ_LEN, "batch_size": BATCH, "num_workers": num_workers, "seed": seed, **options}
    dm = TokenShardDataModule(shards, **options)
    model = RecordingModel()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=ckpt_every, save_top_k=-1)] if ckpt_every else []
    trainer = quiet_trainer(max_steps=max_steps, callbacks=callbacks, accumulate_grad_batches=accumulate)
    trainer.fit(model, datamodule=dm, ckpt_path=resume)
    return model.records


def checkpoint_at(ckpt_dir: Path, step: int) -> Path:
    (path,) = ckpt_dir.glob(f"*-step={step}.ckpt")
    return path


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "workers2"])
def uninterrupted(request: pytest.FixtureRequest, shards: Path) -> tuple[int, list[dict]]:
    return request.param, fit(shards, TOTAL_STEPS, request.param)


@pytest.mark.parametrize(
    "stops",
    [
        pytest.param([4], id="mid-epoch"),
        pytest.param([3, 7], id="twice-in-one-epoch"),
        pytest.param([8], id="across-epoch-boundary"),
        pytest.param([10], id="at-epoch-end"),
        pytest.param([13], id="second-epoch"),
    ],
)
def test_resumed_run_trains_identical_batches(
    tmp_path: Path, shards: Path, uninterrupted: tuple[int, list[dict]], stops: list[int]
) -> None:
    num_workers, expected = uninterrupted
    trained: list[dict] = []
    resume = None
    for stop in stops:
        # The process is "killed" two steps after the checkpoint; those steps are lost, as in a real crash.
        records = fit(shards, stop + 2, num_workers, tmp_path, ckpt_every=stop, resume=resume)
        trained += [r for r in records if r["step"] < stop]
        resume = checkpoint_at(tmp_path, stop)
    trained += fit(shards, TOTAL_STEPS, num_workers, resume=resume)
    assert [r["digest"] for r in trained] == [r["digest"] for r in expected]


def test_every_epoch_covers_every_window_once(uninterrupted: tuple[int, list[dict]]) -> None:
    _, records = uninterrupted
    windows = [start // SEQ_LEN for r in records for start in r["starts"]]
    per_epoch = STEPS_PER_EPOCH * BATCH
    for epoch in range(2):
        assert sorted(windows[epoch * per_epoch : (epoch + 1) * per_epoch]) == list(range(per_epoch))
    assert windows[:per_epoch] != windows[per_epoch : 2 * per_epoch], "each pass must be reshuffled"


def test_order_does_not_depend_on_num_workers(shards: Path) -> None:
    assert [r["digest"] for r in fit(shards, 12, 0)] == [r["digest"] for r in fit(shards, 12, 2)]


def test_data_order_follows_data_seed_not_model_seed(shards: Path) -> None:
    seed_everything(1)
    first = fit(shards, 5, 0, seed=7)
    seed_everything(2)
    assert fit(shards, 5, 0, seed=7) == first
    assert fit(shards, 5, 0, seed=8) != first


def test_resume_with_changed_seed_is_refused_and_names_the_change(tmp_path: Path, shards: Path) -> None:
    fit(shards, 3, 0, tmp_path, ckpt_every=3)
    with pytest.raises(ValueError, match=r"seed: 1 -> 2.*allow_plan_change=True"):
        fit(shards, 6, 0, resume=checkpoint_at(tmp_path, 3), seed=2)


def test_resume_with_changed_data_is_refused_and_names_the_change(tmp_path: Path, shards: Path) -> None:
    fit(shards, 3, 0, tmp_path, ckpt_every=3)
    other = make_token_shards(tmp_path / "other", SEQ_LEN * BATCH * STEPS_PER_EPOCH * 2 + 1)
    with pytest.raises(ValueError, match=r"source 'train' num_samples: 40 -> 80"):
        fit(other, 6, 0, resume=checkpoint_at(tmp_path, 3))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"seq_len": 4}, r"source 'train' seq_len: 8 -> 4"),
        ({"pack_sequences": True}, r"source 'train' pack_sequences: False -> True"),
        ({"val_fraction": 0.25}, r"source 'train' token range of this split \[first, end\): \[0, 321\] -> \[0, 240\]"),
    ],
)
def test_a_refused_resume_names_a_changed_setting_in_words(
    tmp_path: Path, shards: Path, change: dict, words: str
) -> None:
    fit(shards, 3, 0, tmp_path, ckpt_every=3)
    with pytest.raises(ValueError, match=words) as refused:
        fit(shards, 6, 0, resume=checkpoint_at(tmp_path, 3), **change)
    assert "fingerprint" not in str(refused.value)


def test_allow_plan_change_resumes_at_the_saved_position(tmp_path: Path, shards: Path) -> None:
    fit(shards, 3, 0, tmp_path, ckpt_every=3)
    dm = TokenShardDataModule(shards, seq_len=SEQ_LEN, batch_size=BATCH, seed=2, allow_plan_change=True)
    trainer = quiet_trainer(max_steps=5)
    model = RecordingModel()
    trainer.fit(model, datamodule=dm, ckpt_path=checkpoint_at(tmp_path, 3))
    assert len(model.records) == 2
    assert dm.positions_consumed == 5 * BATCH


def mixture_checkpoint(tmp_path: Path, shards: Path, steps: int) -> Path:
    """A checkpoint after ``steps`` steps of another DataModule class (a mixture) over the same shards."""
    dm = MixtureDataModule(
        [MixtureComponent("train", 1.0, TokenShardSource(str(shards)))], seq_len=SEQ_LEN, batch_size=BATCH
    )
    callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=steps)]
    quiet_trainer(max_steps=steps, callbacks=callbacks).fit(RecordingModel(), datamodule=dm)
    return checkpoint_at(tmp_path, steps)


def test_a_checkpoint_of_another_datamodule_is_refused_naming_the_state_it_holds(tmp_path: Path, shards: Path) -> None:
    ckpt = mixture_checkpoint(tmp_path, shards, 3)
    with pytest.raises(ValueError, match=r"saved at step 3, but it holds the state of MixtureDataModule, not of Token"):
        fit(shards, 6, 0, resume=ckpt)


def test_allow_plan_change_starts_the_data_of_another_datamodules_checkpoint_from_its_beginning(
    tmp_path: Path, shards: Path
) -> None:
    ckpt = mixture_checkpoint(tmp_path, shards, 3)
    with pytest.warns(UserWarning, match="starting it from its beginning because allow_plan_change=True"):
        resumed = fit(shards, 5, 0, resume=ckpt, allow_plan_change=True)
    assert [r["digest"] for r in resumed] == [r["digest"] for r in fit(shards, 2, 0)]


def test_resume_with_gradient_accumulation_trains_identical_micro_batches(tmp_path: Path, shards: Path) -> None:
    expected = fit(shards, 12, 0, accumulate=2)
    killed = fit(shards, 6, 0, tmp_path, ckpt_every=4, accumulate=2)
    resumed = fit(shards, 12, 0, resume=checkpoint_at(tmp_path, 4), accumulate=2)
    assert len(expected) == 24
    assert [r["digest"] for r in killed if r["step"] < 4] + [r["digest"] for r in resumed] == [
        r["digest"] for r in expected
    ]


def test_mid_epoch_resume_does_not_warn_that_the_loader_is_not_resumable(tmp_path: Path, shards: Path) -> None:
    fit(shards, 4, 0, tmp_path, ckpt_every=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(shards, 6, 0, resume=checkpoint_at(tmp_path, 4))
    assert not [w for w in caught if "not resumable" in str(w.message)]


class KillWorkerAfter(Callback):
    """SIGKILLs one DataLoader worker after ``step``'s batch, as the kernel's out-of-memory killer does;
    with ``quiet``, SIGCHLD is first reset to its default (another library took it over from torch)."""

    def __init__(self, step: int, quiet: bool) -> None:
        self.step, self.quiet = step, quiet

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            if self.quiet:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.kill(multiprocessing.active_children()[-1].pid, signal.SIGKILL)


@pytest.mark.parametrize("sigchld", ["torch's handler", "default"])
def test_a_worker_killed_by_sigkill_ends_fit_at_the_loader_naming_it_and_the_likely_cause(
    shards: Path, sigchld: str
) -> None:
    dm = TokenShardDataModule(shards, seq_len=SEQ_LEN, batch_size=BATCH, num_workers=2)
    trainer = quiet_trainer(max_steps=TOTAL_STEPS, callbacks=[KillWorkerAfter(3, quiet=sigchld == "default")])
    handler = signal.getsignal(signal.SIGCHLD)
    try:
        with pytest.raises(
            WorkerDied, match=r"DataLoader worker \(pid \d+\) was killed by SIGKILL.*out-of-memory"
        ) as e:
            trainer.fit(RecordingModel(), datamodule=dm)
    finally:
        signal.signal(signal.SIGCHLD, handler)
    # Raised where the next batch is fetched, not from torch's signal handler mid backward.
    assert "from_workers" in [frame.name for frame in e.traceback]
    assert "backward" not in [frame.name for frame in e.traceback]


class FreezeCount:
    """A source whose samples report how many objects the collector of the reading process has frozen."""

    fingerprint = "freeze-count"

    def __len__(self) -> int:
        return 64

    def fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"frozen": np.full(len(indices), gc.get_freeze_count())}

    def to_batch(self, raw: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {"frozen": torch.from_numpy(raw["frozen"])}


def test_workers_freeze_what_they_inherit_so_their_collections_keep_it_shared() -> None:
    source = FreezeCount()
    dataset = PlanDataset(source, SamplePlan((PlannedSource("train", len(source), source.fingerprint),), seed=0))
    sampler = PlanSampler(dataset, batch_size=4, num_replicas=1, rank=0, num_batches=8, start_position=lambda: 0)
    frozen = [int(b["frozen"].min()) for b in PlanDataLoader(dataset, sampler, num_workers=2)]
    assert gc.get_freeze_count() == 0 and min(frozen) > 1000  # the parent's objects, frozen in each worker only
