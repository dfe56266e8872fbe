"""Every benchmark script runs end to end (``--quick`` sizes) and writes its results files.

Timings are not asserted here: the targets are read from the full-size runs in benchmarks/results.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_runs_and_writes_its_results(tmp_path: Path, name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--results-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PASS" in done.stdout or "FAIL" in done.stdout
    assert json.loads((tmp_path / f"{name}.json").read_text())
    assert "|---" in (tmp_path / f"{name}.md").read_text()
