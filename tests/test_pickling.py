"""Every DataModule pickles before and after ``setup``, as launchers that ship it to their processes
(``strategy="ddp_spawn"``, Ray Train) need; the copy serves the same batches."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from datamodules.cli import main
from tests.support import batch_digest, quiet_trainer
from tests.test_configs import CONFIGS, SHORTER, quickstart_inputs


@pytest.fixture(scope="module")
def quickstart_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quickstart")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        quickstart_inputs()
    return root


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_a_datamodule_pickles_before_and_after_setup_and_its_copy_serves_the_same_batches(
    quickstart_dir: Path, monkeypatch: pytest.MonkeyPatch, config: Path
) -> None:
    monkeypatch.chdir(quickstart_dir)
    cli = main([f"--config={config}", *SHORTER.get(config.stem, ["--data.init_args.seq_len=16"])], run=False)
    dm = cli.datamodule
    fresh = pickle.loads(pickle.dumps(dm))
    for each in (dm, fresh):
        each.trainer = quiet_trainer(max_steps=2)
        each.prepare_data()
        each.setup("fit")
    copy = pickle.loads(pickle.dumps(dm))
    first = [batch_digest(next(iter(each.train_dataloader()))) for each in (dm, fresh, copy)]
    assert first[0] == first[1] == first[2]
