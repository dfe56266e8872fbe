"""Every YAML in configs/ runs with LightningCLI (a few steps, on data built in the test)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from datamodules.cli import main
from examples.default_chats import write_default_chats
from examples.default_conversations import build_default_conversations
from examples.default_corpus import train_tokenizer
from examples.default_images import build_default_images
from examples.default_videos import build_default_videos
from tests import preloaded
from tests.support import make_token_shards

REPO = Path(__file__).parent.parent
CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def quickstart_inputs() -> None:
    """What the quickstart leaves in ``.cache/quickstart``: shards, pydoc topic files and a tokenizer,
    pictures and clips with their caption tokenizers, conversations with their hidden states."""
    for name in ("stdlib", "pydoc"):
        make_token_shards(Path(f".cache/quickstart/shards_{name}"), 4000, doc_len=37)
    topics = Path(".cache/quickstart/pydoc_topics")
    topics.mkdir(parents=True)
    for i in range(30):
        (topics / f"{chr(ord('a') + i % 26)}topic{i}.txt").write_text(
            f"Topic {i}. " + "The while statement repeats a block. " * (i + 3)
        )
    tokenizer = train_tokenizer(sorted(topics.glob("*.txt")), Path(".cache/quickstart/tokenizer"), vocab_size=300)
    build_default_images(Path(".cache/quickstart"), count=60)
    build_default_videos(Path(".cache/quickstart"), count=40)
    build_default_conversations(Path(".cache/quickstart"), sorted(topics.glob("*.txt")), tokenizer, count=60)
    write_default_chats(Path(".cache/quickstart/chats.jsonl"), sorted(topics.glob("*.txt")), count=60)


# Text configs train on 16-token sequences here; a vision sample keeps its prompt and placeholders.
SHORTER = {
    "image_text": [],
    "interleaved": [],
    "image_text_webdataset": [],
    "video": [],
    "speculative": ["--data.init_args.total_seq_len=256"],
    "conversations": ["--data.init_args.total_seq_len=128", "--data.init_args.batch_size=2"],
}


@pytest.fixture(scope="module")
def built_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``quickstart_inputs`` built once for the module (a folder holding ``.cache/quickstart``)."""
    folder = tmp_path_factory.mktemp("quickstart")
    os.chdir(folder)
    try:
        quickstart_inputs()
    finally:
        os.chdir(REPO)
    return folder


@pytest.fixture()
def inputs_here(built_inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the quickstart's inputs in a fresh working directory: the configs name them relative to
    it, and a run writes its caches, logs and checkpoints beside them."""
    shutil.copytree(built_inputs / ".cache", tmp_path / ".cache")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_fits_a_few_steps(inputs_here: None, config: Path) -> None:
    cli = main(
        [
            "fit",
            f"--config={config}",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=4",
            "--trainer.enable_progress_bar=false",
            *SHORTER.get(config.stem, ["--data.init_args.seq_len=16"]),
        ]
    )
    assert cli.trainer.global_step == 4
    assert list(Path(".cache/quickstart").glob("checkpoints*/*.ckpt"))
    assert all(v.isfinite() for k, v in cli.trainer.callback_metrics.items() if k.startswith("val_loss"))
    assert any(k.startswith("val_loss") for k in cli.trainer.callback_metrics)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_tests_its_model(inputs_here: None, config: Path) -> None:
    args = ["test", f"--config={config}", "--trainer.limit_test_batches=2", "--trainer.enable_progress_bar=false"]
    args += SHORTER.get(config.stem, ["--data.init_args.seq_len=16"])
    metrics = main(args).trainer.callback_metrics
    losses = {k: v for k, v in metrics.items() if k.startswith("test_loss")}
    assert losses and all(v.isfinite() for v in losses.values())


def test_a_mixture_names_its_validation_and_test_losses_by_source(inputs_here: None) -> None:
    config = Path(__file__).parent.parent / "configs" / "mixture_annealing.yaml"
    args = [f"--config={config}", "--trainer.max_steps=2", "--trainer.val_check_interval=2"]
    args += ["--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1", "--data.init_args.seq_len=16"]
    cli = main(["fit", *args, "--trainer.enable_progress_bar=false"])
    assert sorted(k for k in cli.trainer.callback_metrics if k.startswith("val_loss")) == [
        "val_loss/pydoc",
        "val_loss/stdlib",
    ]
    cli.trainer.test(cli.model, datamodule=cli.datamodule)
    assert sorted(cli.trainer.callback_metrics) == ["test_loss/pydoc", "test_loss/stdlib"]


def test_a_mixture_source_path_is_overridden_from_the_command_line_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("stdlib", "pydoc", "elsewhere"):
        make_token_shards(Path(f".cache/quickstart/shards_{name}"), 4000, doc_len=37)
    override = "--data.init_args.sources.pydoc.source.init_args.data_dir=.cache/quickstart/shards_elsewhere"
    config = Path(__file__).parent.parent / "configs" / "mixture_annealing.yaml"
    cli = main([f"--config={config}", override, "--data.init_args.seq_len=16"], run=False)
    paths = {c.name: c.source.data_dir for c in cli.datamodule.components}
    assert paths == {"stdlib": ".cache/quickstart/shards_stdlib", "pydoc": ".cache/quickstart/shards_elsewhere"}


def test_the_cli_shows_what_the_data_is_at_the_start_of_fit(tmp_path: Path) -> None:
    for name in ("stdlib", "pydoc"):
        make_token_shards(tmp_path / f".cache/quickstart/shards_{name}", 4000, doc_len=37)
    config = Path(__file__).parent.parent / "configs" / "token_shards.yaml"
    args = [sys.executable, "-m", "datamodules.cli", "fit", f"--config={config}", "--trainer.max_steps=2"]
    args += ["--data.init_args.seq_len=16", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0"]
    done = preloaded.run(args, tmp_path / "output", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = done.stdout + done.stderr
    assert "TokenShardDataModule: 15 steps per epoch of 16 samples" in shown
    assert [c.strip() for c in shown[shown.index("Source |") :].splitlines()[2].split("|")][:4] == [
        "0",
        "train",
        "244",  # 1% held out for validation, 1% for test
        "3,904",
    ]


def test_a_config_run_without_the_quickstart_data_says_so_in_one_line(tmp_path: Path) -> None:
    config = Path(__file__).parent.parent / "configs" / "token_shards.yaml"
    args = [sys.executable, "-m", "datamodules.cli", "fit", f"--config={config}"]
    done = preloaded.run(args, tmp_path / "output", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "run `python -m examples.quickstart` first" in line


def test_the_quickstart_passes_extra_arguments_to_lightning_cli() -> None:
    from examples.quickstart import cli_arguments

    assert cli_arguments(["--config", "configs/hf_text.yaml", "--trainer.max_steps=50"]) == [
        "--config",
        "configs/hf_text.yaml",
        "--trainer.max_steps=50",
    ]
    assert cli_arguments([]) == ["--config", "configs/token_shards.yaml"]
