"""MixtureDataModule with PhaseScheduler: exact per-batch mixing, phase changes and exact resume."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from datamodules import MixtureComponent, MixtureDataModule, PhaseScheduler, TokenShardSource
from datamodules.mixture import mixture_probabilities
from datamodules.plan.sample_plan import MIXING_RULE, Segment
from datamodules.text.prepare import prepare
from datamodules.text.shard_metadata import METADATA_FILE, ShardMetadata
from examples.default_corpus import train_tokenizer
from tests.support import RecordingModel, logged_rows, make_mixture_shards, quiet_trainer

SEQ_LEN, BATCH = 4, 10
NAMES = ("a", "b", "c")
SIZES = {"a": 400, "b": 120, "c": 30}  # windows per source; "c" runs out and is oversampled
BASE = {"a": 0.5, "b": 0.3, "c": 0.2}
PHASES = [{"start_step": 5, "dataset_weights": {"a": 0.0, "c": 0.7}, "lr_scale": 0.5}]
ID = 10**6  # source s holds token values from s * ID, so a window names its source


@pytest.fixture(scope="module")
def shard_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_mixture_shards(tmp_path_factory.mktemp("mixture"), SIZES, SEQ_LEN, ID)


def make_dm(shard_dirs: dict[str, Path], weights: dict[str, float] = BASE, **kwargs) -> MixtureDataModule:
    components = [MixtureComponent(n, weights[n], TokenShardSource(str(shard_dirs[n]))) for n in NAMES]
    return MixtureDataModule(components, **{"seq_len": SEQ_LEN, "batch_size": BATCH, "seed": 3, **kwargs})


def fit(
    shard_dirs: dict[str, Path],
    max_steps: int,
    num_workers: int = 0,
    phases: list | None = PHASES,
    ckpt_dir: Path | None = None,
    ckpt_every: int = 0,
    resume: Path | None = None,
    weights: dict[str, float] = BASE,
    temperature: float = 1.0,
    batch_size: int = BATCH,
    reload_every: int = 0,
) -> list[dict]:
    dm = make_dm(shard_dirs, weights, num_workers=num_workers, temperature=temperature, batch_size=batch_size)
    callbacks = [PhaseScheduler(phases)] if phases is not None else []
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=ckpt_every, save_top_k=-1))
    model = RecordingModel()
    trainer = quiet_trainer(max_steps=max_steps, callbacks=callbacks, reload_dataloaders_every_n_epochs=reload_every)
    trainer.fit(model, datamodule=dm, ckpt_path=resume)
    return model.records


def source_counts(record: dict) -> list[int]:
    return np.bincount([start // ID for start in record["starts"]], minlength=len(NAMES)).tolist()


def expected_counts(
    weights: dict[str, float], temperature: float = 1.0, steps: int = 1, block_size: int = BATCH
) -> list[list[int]]:
    """Rows per source of the first ``steps`` global batches of a segment under ``weights``."""
    probabilities = mixture_probabilities([weights[n] for n in NAMES], temperature)
    return Segment(0, block_size, probabilities).counts(np.arange(steps)).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_batch_holds_the_active_counts_and_the_phase_switches_at_its_step(
    shard_dirs: dict[str, Path], num_workers: int
) -> None:
    records = fit(shard_dirs, 12, num_workers)
    annealed = {**BASE, **PHASES[0]["dataset_weights"]}
    assert expected_counts(BASE) == [[5, 3, 2]] and expected_counts(annealed) == [[0, 3, 7]]
    assert [source_counts(r) for r in records] == [[5, 3, 2]] * 5 + [[0, 3, 7]] * 7


@pytest.mark.parametrize("temperature", [0.5, 2.0, 10.0])
def test_temperature_follows_the_formula_and_weight_zero_is_never_sampled(
    shard_dirs: dict[str, Path], temperature: float
) -> None:
    weights = {"a": 0.6, "b": 0.0, "c": 0.4}
    probabilities = mixture_probabilities([weights[n] for n in NAMES], temperature)
    raw = np.array([0.6, 0.0, 0.4]) ** (1 / temperature)
    assert probabilities == pytest.approx(raw / raw.sum())
    records = fit(shard_dirs, 6, phases=None, weights=weights, temperature=temperature)
    assert [source_counts(r) for r in records] == expected_counts(weights, temperature, steps=6)
    assert all(source_counts(r)[1] == 0 for r in records)


def test_a_source_that_runs_out_starts_a_fresh_pass_without_repeats_inside_a_pass(shard_dirs: dict[str, Path]) -> None:
    records = fit(shard_dirs, 30, phases=None)
    windows = [(s - 2 * ID) // SEQ_LEN for r in records for s in r["starts"] if s // ID == 2]
    assert len(windows) == 60  # two passes over source "c" (30 windows)
    seen = np.bincount(windows, minlength=30)
    assert seen.tolist() == [2] * 30
    dm = make_dm(shard_dirs)
    dm.setup("fit")
    dm.train_dataloader()
    dm.load_state_dict({**dm.state_dict(), "positions_consumed": 30 * BATCH})
    dm.train_dataloader()
    assert dm.realized_counts()["c"] == {"samples": 60, "tokens": 60 * SEQ_LEN, "passes": 2}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop", [3, 5, 7], ids=["before-change", "at-boundary", "after-change"])
def test_resume_across_a_phase_change_trains_identical_batches(
    tmp_path: Path, shard_dirs: dict[str, Path], num_workers: int, stop: int
) -> None:
    expected = fit(shard_dirs, 10, num_workers)
    killed = fit(shard_dirs, stop + 2, num_workers, ckpt_dir=tmp_path, ckpt_every=stop)
    (ckpt,) = tmp_path.glob(f"*-step={stop}.ckpt")
    resumed = fit(shard_dirs, 10, num_workers, resume=ckpt)
    trained = [r for r in killed if r["step"] < stop] + resumed
    assert [r["digest"] for r in trained] == [r["digest"] for r in expected]
    assert [r["lr"] for r in trained] == [r["lr"] for r in expected] == [0.01] * 5 + [0.005] * 5


def test_a_mixture_resumed_without_its_phase_scheduler_continues_the_phase_it_trained_in(
    tmp_path: Path, shard_dirs: dict[str, Path]
) -> None:
    weights_only = [{**PHASES[0], "lr_scale": 1.0}]
    expected = fit(shard_dirs, 10, phases=weights_only)
    fit(shard_dirs, 7, phases=weights_only, ckpt_dir=tmp_path, ckpt_every=7)
    (ckpt,) = tmp_path.glob("*-step=7.ckpt")
    resumed = fit(shard_dirs, 10, phases=None, resume=ckpt)
    assert [source_counts(r) for r in resumed] == [[0, 3, 7]] * 3
    assert [r["digest"] for r in resumed] == [r["digest"] for r in expected[7:]]


def test_a_resume_without_the_callback_whose_phase_scales_the_lr_is_refused(
    tmp_path: Path, shard_dirs: dict[str, Path]
) -> None:
    fit(shard_dirs, 7, ckpt_dir=tmp_path, ckpt_every=7)
    (ckpt,) = tmp_path.glob("*-step=7.ckpt")
    with pytest.raises(ValueError, match=r"phase from step 5 scales the LR by 0.5; resumed at step 7 without"):
        fit(shard_dirs, 10, phases=None, resume=ckpt)
    # The checkpoint holds the scheduler's own LR (0.01), not the scaled one; the callback scales it again.
    group = torch.load(ckpt, weights_only=True)["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == 0.01
    assert [r["lr"] for r in fit(shard_dirs, 9, resume=ckpt)] == [0.005] * 2


def test_reloading_the_train_loader_every_epoch_keeps_the_trained_schedule(
    tmp_path: Path, shard_dirs: dict[str, Path]
) -> None:
    # 550 windows: an epoch is 55 steps of 10 and 110 steps of 5. Each reload rebuilds the plan after
    # the phase change; it must keep the segments already trained, also after a resume that changed
    # the global batch (10 -> 5, as a resume on half the ranks does).
    assert fit(shard_dirs, 60, reload_every=1) == fit(shard_dirs, 60)
    fit(shard_dirs, 3, ckpt_dir=tmp_path, ckpt_every=3)
    (ckpt,) = tmp_path.glob("*-step=3.ckpt")
    resumed = fit(shard_dirs, 115, batch_size=5, resume=ckpt)
    assert fit(shard_dirs, 115, batch_size=5, resume=ckpt, reload_every=1) == resumed
    # Half of 10 is 2.5 / 1.5 / 1 and 0 / 1.5 / 3.5: the halves alternate between floor and ceiling.
    annealed = {**BASE, **PHASES[0]["dataset_weights"]}
    expected = expected_counts(BASE, steps=2, block_size=5) + expected_counts(annealed, steps=110, block_size=5)
    assert [source_counts(r) for r in resumed] == expected
    assert {tuple(c) for c in expected} == {(3, 1, 1), (2, 2, 1), (0, 2, 3), (0, 1, 4)}


def test_editing_a_phase_already_trained_is_refused(tmp_path: Path, shard_dirs: dict[str, Path]) -> None:
    fit(shard_dirs, 7, ckpt_dir=tmp_path, ckpt_every=7)
    (ckpt,) = tmp_path.glob("*-step=7.ckpt")
    edited = [{**PHASES[0], "dataset_weights": {"a": 0.1}}]
    with pytest.raises(ValueError, match="phases already trained .* differ from the checkpoint"):
        fit(shard_dirs, 9, phases=edited, resume=ckpt)


def test_phases_after_the_resumed_step_may_be_edited(tmp_path: Path, shard_dirs: dict[str, Path]) -> None:
    fit(shard_dirs, 7, ckpt_dir=tmp_path, ckpt_every=7)
    (ckpt,) = tmp_path.glob("*-step=7.ckpt")
    later = [*PHASES, {"start_step": 9, "dataset_weights": {"b": 0.0}}]
    records = fit(shard_dirs, 11, phases=later, resume=ckpt)
    # Unnamed sources keep their base weight: a=0.5, b=0, c=0.2.
    later_weights = {"a": 0.5, "b": 0.0, "c": 0.2}
    assert [source_counts(r) for r in records] == [[0, 3, 7]] * 2 + expected_counts(later_weights, steps=2)


def test_changed_base_weights_are_refused_on_resume(tmp_path: Path, shard_dirs: dict[str, Path]) -> None:
    fit(shard_dirs, 3, ckpt_dir=tmp_path, ckpt_every=3)
    (ckpt,) = tmp_path.glob("*-step=3.ckpt")
    with pytest.raises(ValueError, match=r"base_weights: \[0.5, 0.3, 0.2\] -> \[0.4, 0.4, 0.2\]"):
        fit(shard_dirs, 5, resume=ckpt, weights={"a": 0.4, "b": 0.4, "c": 0.2})


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": -1.0, "b": 1.0, "c": 1.0}, "weight of source 'a' must be finite and >= 0, got -1.0"),
        ({"a": float("nan"), "b": 1.0, "c": 1.0}, "weight of source 'a' must be finite and >= 0, got nan"),
        ({"a": float("inf"), "b": 1.0, "c": 1.0}, "weight of source 'a' must be finite and >= 0, got inf"),
        ({"a": 0.0, "b": 0.0, "c": 0.0}, "are all zero: at least one source needs a positive weight"),
    ],
)
def test_bad_weights_fail_at_construction(shard_dirs: dict[str, Path], weights: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_dm(shard_dirs, weights)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan")])
def test_non_positive_temperature_fails_at_construction(shard_dirs: dict[str, Path], temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        make_dm(shard_dirs, temperature=temperature)


def test_duplicate_source_names_fail_at_construction(shard_dirs: dict[str, Path]) -> None:
    source = TokenShardSource(str(shard_dirs["a"]))
    with pytest.raises(ValueError, match=r"source names must be unique, \['a'\] appear more than once"):
        MixtureDataModule([MixtureComponent("a", 1.0, source), MixtureComponent("a", 1.0, source)], 4, 2)


def test_a_phase_naming_an_unknown_source_fails_at_setup(shard_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"phase at step 2 names unknown sources \['web'\]; sources are"):
        fit(shard_dirs, 3, phases=[{"start_step": 2, "dataset_weights": {"web": 1.0}}])


def test_a_phase_zeroing_every_source_fails_at_setup(shard_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="phase at step 2: weights .* are all zero"):
        fit(shard_dirs, 3, phases=[{"start_step": 2, "dataset_weights": {"a": 0.0, "b": 0.0, "c": 0.0}}])


@pytest.mark.parametrize("with_scheduler", [True, False], ids=["phase-scheduler", "no-callback"])
def test_metrics_are_logged_on_the_step_they_describe(
    tmp_path: Path, shard_dirs: dict[str, Path], with_scheduler: bool
) -> None:
    dm = make_dm(shard_dirs)
    logger = CSVLogger(tmp_path, name="logs")
    callbacks = [PhaseScheduler(PHASES)] if with_scheduler else []
    trainer = quiet_trainer(max_steps=8, logger=logger, log_every_n_steps=1, callbacks=callbacks)
    model = RecordingModel()
    trainer.fit(model, datamodule=dm)
    rows = logged_rows(logger.log_dir)
    assert sorted(rows) == list(range(8))
    switched = [step >= 5 for step in range(8)] if with_scheduler else [False] * 8
    if with_scheduler:
        assert [float(rows[s]["phase/index"]) for s in range(8)] == [float(x) for x in switched]
        assert [float(rows[s]["phase/lr_scale"]) for s in range(8)] == [0.5 if x else 1.0 for x in switched]
    assert [float(rows[s]["mixture/a/weight"]) for s in range(8)] == [0.0 if x else 0.5 for x in switched]
    drawn = np.cumsum([source_counts(r) for r in model.records], axis=0)
    for i, name in enumerate(NAMES):
        assert [float(rows[s][f"mixture/{name}/samples"]) for s in range(8)] == drawn[:, i].tolist()
        assert [float(rows[s][f"mixture/{name}/tokens"]) for s in range(8)] == (drawn[:, i] * SEQ_LEN).tolist()
    if with_scheduler:
        # Passes done, not begun: 5*2 + 3*7 = 31 samples of a 30-window source.
        assert float(rows[7]["mixture/c/passes"]) == pytest.approx(31 / 30)
        assert [float(rows[s]["mixture/c/passes"]) for s in range(8)] == pytest.approx(drawn[:, 2] / 30)


def test_sources_of_different_tokenizers_are_refused_unless_allowed(tmp_path: Path) -> None:
    dirs = make_mixture_shards(tmp_path, {"a": 50, "b": 50}, SEQ_LEN, ID)
    for name, (tokenizer, eos) in zip(dirs, [("gpt2", 50256), ("meta-llama/Llama-3.1-8B", 128001)], strict=True):
        meta = ShardMetadata.read(dirs[name])
        meta.tokenizer, meta.eos_id = tokenizer, eos
        meta.write(dirs[name])
    components = [MixtureComponent(n, 0.5, TokenShardSource(str(d))) for n, d in dirs.items()]
    dm = MixtureDataModule(components, seq_len=SEQ_LEN, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"sources 'a' and 'b' were tokenized differently: .*'gpt2'.*50256.*Llama"):
        dm.setup("fit")
    allowed = MixtureDataModule(components, seq_len=SEQ_LEN, batch_size=BATCH, allow_mixed_tokenizers=True)
    allowed.setup("fit")
    assert len(next(iter(allowed.train_dataloader()))["input_ids"]) == BATCH


@pytest.fixture(scope="module")
def corpus_and_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A text corpus, a tokenizer trained on it, and another tokenizer trained on other text."""
    root = tmp_path_factory.mktemp("tokenizers")
    corpus, other = root / "corpus.txt", root / "other.txt"
    corpus.write_text("\n".join(f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(60)))
    other.write_text("\n".join(f"line {i}: pack my box with five dozen liquor jugs" for i in range(60)))
    return corpus, train_tokenizer([corpus], root / "tok", 300), train_tokenizer([other], root / "other", 300)


def mix_prepared(first: Path, second: Path) -> MixtureDataModule:
    components = [MixtureComponent(n, 0.5, TokenShardSource(str(d))) for n, d in (("a", first), ("b", second))]
    return MixtureDataModule(components, seq_len=SEQ_LEN, batch_size=BATCH)


def test_folders_prepared_with_one_tokenizer_from_two_paths_mix(
    tmp_path: Path, corpus_and_tokenizers: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus, tokenizer, _ = corpus_and_tokenizers
    shutil.copytree(tokenizer, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    prepare([str(corpus)], tmp_path / "a", str(tokenizer), num_proc=1)
    prepare([str(corpus)], tmp_path / "b", "tok", num_proc=1)
    dm = mix_prepared(tmp_path / "a", tmp_path / "b")
    dm.setup("fit")
    assert len(next(iter(dm.train_dataloader()))["input_ids"]) == BATCH


def test_a_different_tokenizer_under_the_same_path_is_refused(
    tmp_path: Path, corpus_and_tokenizers: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus, tokenizer, other = corpus_and_tokenizers
    for name, which in (("a", tokenizer), ("b", other)):
        shutil.copytree(which, tmp_path / name / "tok")
        monkeypatch.chdir(tmp_path / name)
        prepare([str(corpus)], tmp_path / f"{name}-out", "tok", num_proc=1)
    with pytest.raises(ValueError, match="sources 'a' and 'b' were tokenized differently"):
        mix_prepared(tmp_path / "a-out", tmp_path / "b-out").setup("fit")


def test_a_folder_prepared_before_tokenizer_hashes_is_compared_by_tokenizer_path(
    tmp_path: Path, corpus_and_tokenizers: tuple[Path, Path, Path]
) -> None:
    corpus, tokenizer, _ = corpus_and_tokenizers
    shutil.copytree(tokenizer, tmp_path / "copy")
    for name, path in (("old", tokenizer), ("same", tokenizer), ("copied", tmp_path / "copy")):
        prepare([str(corpus)], tmp_path / name, str(path), num_proc=1)
    written = json.loads((tmp_path / "old" / METADATA_FILE).read_text())
    del written["tokenizer_hash"]  # as metadata.json was written before the hash was recorded
    (tmp_path / "old" / METADATA_FILE).write_text(json.dumps(written))
    mix_prepared(tmp_path / "old", tmp_path / "same").setup("fit")
    with pytest.raises(ValueError, match="sources 'a' and 'b' were tokenized differently"):
        mix_prepared(tmp_path / "old", tmp_path / "copied").setup("fit")


def test_a_phase_taking_more_samples_per_batch_than_a_source_has_fails_at_setup(tmp_path: Path) -> None:
    dirs = make_mixture_shards(tmp_path, {"big": 400, "tiny": 5}, SEQ_LEN, ID)
    components = [
        MixtureComponent("big", 0.9, TokenShardSource(str(dirs["big"]))),
        MixtureComponent("tiny", 0.1, TokenShardSource(str(dirs["tiny"]))),
    ]
    dm = MixtureDataModule(components, seq_len=SEQ_LEN, batch_size=BATCH)
    model, trainer = (
        RecordingModel(),
        quiet_trainer(max_steps=3, callbacks=[PhaseScheduler(anneal_start_step=2, anneal_weights={"tiny": 10.0})]),
    )
    # 10 / 10.9 of 10 rows is 9.2: some batches hold 10.
    with pytest.raises(ValueError, match=r"takes 10 samples of source 'tiny', which has only 5: rows would repeat"):
        trainer.fit(model, datamodule=dm)
    assert model.records == []


def test_checkpoints_load_with_weights_only_and_hold_plain_state(tmp_path: Path, shard_dirs: dict[str, Path]) -> None:
    fit(shard_dirs, 6, ckpt_dir=tmp_path, ckpt_every=6)
    (ckpt,) = tmp_path.glob("*-step=6.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)
    state = checkpoint["MixtureDataModule"]
    assert state["positions_consumed"] == 6 * BATCH
    annealed = {**BASE, **PHASES[0]["dataset_weights"]}
    probabilities = [list(mixture_probabilities([w[n] for n in NAMES], 1.0)) for w in (BASE, annealed)]
    assert state["segments"] == [[0, BATCH, probabilities[0]], [5 * BATCH, BATCH, probabilities[1]]]
    assert state["epoch_end"] == sum(SIZES.values()) // BATCH * BATCH
    assert state["plan"]["mixing"] == MIXING_RULE
    (scheduler_state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("PhaseScheduler")]
    assert scheduler_state["active_phase"] == 1 and scheduler_state["step"] == 6


def test_a_checkpoint_of_the_earlier_mixing_rule_is_refused_with_the_change_named(
    shard_dirs: dict[str, Path],
) -> None:
    """Plan 1 held the same largest-remainder counts in every batch: its positions hold other samples."""
    dm = make_dm(shard_dirs)
    dm.setup("fit")
    dm.train_dataloader()
    state = dm.state_dict()
    identity = {k: v for k, v in state["plan"].items() if k != "mixing"}
    digest = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()
    old = {**state, "plan": identity, "plan_fingerprint": digest, "segments": [[0, BATCH, [5, 3, 2]]]}
    old.pop("epoch_end")
    resumed = make_dm(shard_dirs)
    resumed.setup("fit")
    with pytest.raises(ValueError, match=r"mixing: not recorded \(a checkpoint of an earlier version\) -> 'floor"):
        resumed.load_state_dict(old)


def test_shares_that_do_not_divide_the_global_batch_are_met_over_the_run(shard_dirs: dict[str, Path]) -> None:
    """0.66 / 0.22 / 0.12 of 10 rows: every batch holds the floor or ceiling of each share (6-7, 2-3,
    1-2), and 50 batches hold 330 / 110 / 60 rows, within a row; no warning is needed."""
    weights = {"a": 0.66, "b": 0.22, "c": 0.12}
    counts = np.array([source_counts(r) for r in fit(shard_dirs, 50, phases=None, weights=weights)])
    assert counts.tolist() == expected_counts(weights, steps=50)
    assert ((counts >= [6, 2, 1]) & (counts <= [7, 3, 2])).all() and (counts.sum(axis=1) == BATCH).all()
    assert np.abs(counts.sum(axis=0) - [330, 110, 60]).max() <= 1


def test_each_source_with_a_test_split_gets_a_test_loader_and_the_hyperparameters_are_plain(
    shard_dirs: dict[str, Path],
) -> None:
    components = [
        MixtureComponent("a", 0.5, TokenShardSource(str(shard_dirs["a"]), test_fraction=0.1)),
        MixtureComponent("b", 0.5, TokenShardSource(str(shard_dirs["b"]))),
    ]
    dm = MixtureDataModule(components, seq_len=SEQ_LEN, batch_size=BATCH)
    dm.setup("test")
    starts = [
        int(r[0])
        for b in dm.test_dataloader()
        for r, lab in zip(b["input_ids"], b["labels"], strict=True)
        if (lab != -100).any()
    ]
    assert len(starts) == (math.ceil((SIZES["a"] * SEQ_LEN + 1) * 0.1) - 1) // SEQ_LEN and {
        s // ID for s in starts
    } == {0}
    source = dm.hparams["sources"]["a"]
    assert (
        source["weight"] == 0.5
        and source["source"]["class_path"] == "datamodules.text.token_shard_source.TokenShardSource"
    )
    assert (
        source["source"]["init_args"]["test_fraction"] == 0.1 and "storage_options" not in source["source"]["init_args"]
    )
    assert dm.hparams["seq_len"] == SEQ_LEN
