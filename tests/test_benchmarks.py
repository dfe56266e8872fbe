"""Every benchmark script runs end to end (``--quick`` sizes) and writes its results files.

Timings are not asserted here: the targets are read from the full-size runs in benchmarks/results.
Each runs as ``python -m benchmarks.<name>`` in a process forked from the tests' preloaded server
(``tests/preloaded.py``), so torch's and Lightning's imports are paid once, not once per benchmark.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests import preloaded

ROOT = Path(__file__).parent.parent
PEERS = {"litdata": "litdata", "torchdata": "torchdata"}  # Mosaic runs in its own venv, made by the full-size run
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_runs_and_writes_its_results(tmp_path: Path, name: str) -> None:
    if name == "peers" and not any(importlib.util.find_spec(module) for module in PEERS.values()):
        pytest.skip("no peer loader installed (pip install -e '.[bench]'); .ci/run runs it with them")
    command = [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--results-dir", str(tmp_path)]
    done = preloaded.run(command, tmp_path / "output")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PASS" in done.stdout or "FAIL" in done.stdout
    assert json.loads((tmp_path / f"{name}.json").read_text())
    assert "|---" in (tmp_path / f"{name}.md").read_text()
    if name == "peers":
        check_peers(json.loads((tmp_path / "peers.json").read_text()))


def check_peers(record: dict) -> None:
    """Every contender whose library is installed was measured; ours resumed exactly at every setting."""
    rows = next(iter(record["tables"].values()))
    measured = {(r["loader"], r["num_workers"]) for r in rows if r["M tokens/s"]}
    installed = {"ours", "plain DataLoader", "raw floor"}
    installed |= {name for name, module in PEERS.items() if importlib.util.find_spec(module) is not None}
    for row in rows:
        if row["loader"].split(":")[0].split(" (")[0] in installed and not row["loader"].startswith("raw floor"):
            assert (row["loader"], row["num_workers"]) in measured, row
    ours = [r for r in rows if r["loader"].startswith("ours")]
    assert len(ours) == 4 and all(r["exact resume"] == "yes" for r in ours), ours
    # 0.7 of 8 is 5.6: every batch holds 5 or 6 of source0, and the run holds 0.7 of its samples.
    mixtures = [r for r in ours if "Mixture" in r["loader"]]
    assert all(r["max mixture deviation"] < 1 and abs(r["source0 share"] - 0.7) < 0.005 for r in mixtures), ours
