"""``python -m datamodules.cli``: a mistake in a config or an option is one line naming the nearest valid
name, every option has its help, and progress shows when stdout is a file."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

import datamodules
from datamodules.cli import main
from datamodules.plan.datamodule import PlanDataModule
from datamodules.plan.loader import SourceSpec
from tests import preloaded
from tests.support import make_token_shards

REPO = Path(__file__).parent.parent
TOKEN_SHARDS = REPO / "configs" / "token_shards.yaml"


def error_of(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI's message for ``args``, which it must refuse with exit code 2 on one line."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "usage:" not in err
    return lines[0]


def test_a_misspelled_option_names_the_option_meant(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(["fit", f"--config={TOKEN_SHARDS}", "--data.init_args.seq_lenn=128"], capsys)
    assert line == "error: data: datamodules.TokenShardDataModule has no option 'seq_lenn'; did you mean 'seq_len'?"


def test_a_misspelled_key_in_a_config_file_names_the_key_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text(TOKEN_SHARDS.read_text().replace("every_n_train_steps:", "every_n_train_step:"))
    line = error_of(["fit", f"--config={config}"], capsys)
    assert "ModelCheckpoint has no option 'every_n_train_step'; did you mean 'every_n_train_steps'?" in line


def test_a_misspelled_trainer_option_names_the_option_meant(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(["fit", f"--config={TOKEN_SHARDS}", "--trainer.max_stepss=3"], capsys)
    assert line == "error: no option --trainer.max_stepss; did you mean '--trainer.max_steps'?"


def test_a_misspelled_class_path_names_the_class_meant(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(["fit", f"--config={TOKEN_SHARDS}", "--data=datamodules.TokenShardDataModul"], capsys)
    assert "no 'TokenShardDataModul' in module datamodules; did you mean 'datamodules.TokenShardDataModule'?" in line


def test_a_value_of_the_wrong_type_names_the_option_and_the_type(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(["fit", f"--config={TOKEN_SHARDS}", "--data.init_args.seq_len=abc"], capsys)
    assert line == "error: data.seq_len: expected int, got 'abc'"


def test_a_misspelled_checkpoint_path_names_the_checkpoint_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").touch()
    args = ["fit", f"--config={TOKEN_SHARDS}", f"--ckpt_path={tmp_path}/checkpoints/lats.ckpt"]
    line = error_of(args, capsys)
    meant = tmp_path / "checkpoints" / "last.ckpt"
    assert line == f"error: ckpt_path '{tmp_path}/checkpoints/lats.ckpt' does not exist; did you mean '{meant}'?"


def test_a_file_type_given_as_the_builder_names_the_builder(capsys: pytest.CaptureFixture[str]) -> None:
    # No network here: the hub lookup "jsonl" would otherwise get is never made.
    args = ["fit", f"--config={REPO / 'configs' / 'hf_text.yaml'}", "--data.init_args.path=jsonl"]
    assert error_of(args, capsys) == "error: path 'jsonl' is not a datasets builder; did you mean 'json'?"


CONFIGURABLE = sorted(
    (
        getattr(datamodules, name)
        for name in datamodules.__all__
        if isinstance(getattr(datamodules, name), type)
        and issubclass(getattr(datamodules, name), (PlanDataModule, SourceSpec))
        and getattr(datamodules, name) is not PlanDataModule
    ),
    key=lambda cls: cls.__name__,
)


# Arguments documented only inside another's entry, in files of datamodules/vision/.
@pytest.mark.parametrize("cls", CONFIGURABLE, ids=[c.__name__ for c in CONFIGURABLE])
def test_every_option_of_a_datamodule_or_source_has_its_help(cls: type) -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "data")
    helps = {a.dest: a.help or "" for a in parser._actions if a.dest.startswith("data.") and a.dest != "data.help"}
    undocumented = [dest for dest, text in helps.items() if not text or text.startswith("see ``")]
    assert undocumented == []


def test_the_cli_help_of_a_datamodule_describes_the_options_it_forwards(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--data.help", "datamodules.HFTextDataModule"])
    shown = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "--data.path PATH ``datasets.load_dataset``'s ``path``" in shown
    assert "--data.test_fraction TEST_FRACTION the same for the test split" in shown


def test_a_fit_with_stdout_piped_prints_progress_lines(tmp_path: Path) -> None:
    for name in ("stdlib", "pydoc"):
        make_token_shards(tmp_path / f".cache/quickstart/shards_{name}", 4000, doc_len=37)
    args = [sys.executable, "-m", "datamodules.cli", "fit", f"--config={TOKEN_SHARDS}", "--trainer.max_steps=20"]
    args += ["--data.init_args.seq_len=16", "--trainer.log_every_n_steps=5", "--trainer.val_check_interval=10"]
    args += ["--trainer.limit_val_batches=1", "--trainer.enable_model_summary=false"]
    done = preloaded.run(args, tmp_path / "output", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    progress = [line.split(" | ")[:3] for line in lines if line.startswith("epoch")]
    # 15 steps an epoch: the second epoch's batches count from 1 again, and max_steps ends it at 5.
    assert progress == [
        ["epoch 0", "batch 5/15", "step 5/20"],
        ["epoch 0", "batch 10/15", "step 10/20"],
        ["epoch 0", "batch 15/15", "step 15/20"],
        ["epoch 1", "batch 5/15", "step 20/20"],
    ]
    assert all(re.search(r"\| train_loss=\d", line) for line in lines if line.startswith("epoch"))
    assert [line.split(" | ")[0] for line in lines if line.startswith("validation")] == ["validation at step 10"]
