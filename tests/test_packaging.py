"""What the installed distribution puts on users' import path: ``datamodules`` only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = """
import datamodules
from datamodules import PhaseScheduler, TokenShardDataModule
import callbacks, examples
print(PhaseScheduler.__module__, callbacks.MINE, examples.MINE)
"""


def test_a_users_own_callbacks_and_examples_modules_neither_break_nor_are_shadowed(tmp_path: Path) -> None:
    # A user's project beside ours: their callbacks.py and examples.py must stay theirs.
    (tmp_path / "callbacks.py").write_text("MINE = 'user-callbacks'\n")
    (tmp_path / "examples.py").write_text("MINE = 'user-examples'\n")
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["datamodules.callbacks.phase_scheduler", "user-callbacks", "user-examples"]


def test_importing_the_package_does_not_load_torch_until_a_datamodule_is_used(tmp_path: Path) -> None:
    probe = "import sys, datamodules.text.prepare; print('torch' in sys.modules, 'lightning' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]
