"""node_arrays: arrays made once per node by the first process that needs them and mapped by the rest;
a writer killed half way leaves nothing anyone maps; a bad input's error is the caller's; a cache that
cannot be written falls back to each process's own arrays."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from datamodules.storage.node_arrays import drop_node_arrays, is_mapped, node_arrays

ROOT = Path(__file__).parents[2]
# A process that makes the table slowly, noting its pid in ``made`` when it does, and prints what it maps.
MAKER = """
import os, sys, time
import numpy as np
from datamodules.storage.node_arrays import is_mapped, node_arrays

def make():
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(float(sys.argv[2]))
    return {"squares": np.arange(1000) ** 2, "count": np.array(1000)}

arrays = node_arrays("tests", sys.argv[3], make)
print(is_mapped(arrays["squares"]), int(arrays["squares"].sum()), int(arrays["count"]))
"""


def start_maker(made: Path, seconds: float, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", MAKER, str(made), str(seconds), name], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def test_processes_of_a_node_make_the_arrays_once_and_all_map_them(tmp_path: Path) -> None:
    made = tmp_path / "made"
    makers = [start_maker(made, 0.5, "shared") for _ in range(3)]
    outputs = [maker.communicate(timeout=60)[0].split() for maker in makers]
    assert all(maker.returncode == 0 for maker in makers)
    assert len(made.read_text().split()) == 1  # one process made them; the others waited and mapped
    assert outputs == [["True", str(sum(i * i for i in range(1000))), "1000"]] * 3


def test_a_writer_killed_half_way_leaves_nothing_mapped_and_the_next_makes_them(tmp_path: Path) -> None:
    made = tmp_path / "made"
    maker = start_maker(made, 60, "killed")
    deadline = time.monotonic() + 30
    while not made.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(maker.pid, signal.SIGKILL)
    maker.wait()
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "datamodules" / "tests"
    assert not (cache / "killed").exists() and list(cache.glob(".killed.partial-*"))
    arrays = node_arrays("tests", "killed", lambda: {"squares": np.arange(1000) ** 2})
    assert is_mapped(arrays["squares"]) and int(arrays["squares"][999]) == 999**2
    assert not list(cache.glob(".killed.partial-*"))  # the killed writer's part was removed


def test_an_error_in_make_is_raised_as_it_is_and_leaves_no_arrays() -> None:
    def bad() -> dict[str, np.ndarray]:
        raise ValueError("row 7 has no tokens")

    with pytest.raises(ValueError, match="row 7 has no tokens"):
        node_arrays("tests", "bad", bad)
    arrays = node_arrays("tests", "bad", lambda: {"ok": np.ones(3)})
    assert arrays["ok"].tolist() == [1, 1, 1]


def test_dropped_arrays_are_made_again_and_a_map_held_keeps_reading(tmp_path: Path) -> None:
    first = node_arrays("tests", "dropped", lambda: {"a": np.arange(5)})
    drop_node_arrays("tests", "dropped")
    assert first["a"].tolist() == [0, 1, 2, 3, 4]  # the map outlives the files
    again = node_arrays("tests", "dropped", lambda: {"a": np.arange(5) + 1})
    assert again["a"].tolist() == [1, 2, 3, 4, 5]


def test_an_unwritable_cache_gives_each_process_its_own_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    with caplog.at_level(logging.WARNING, logger="datamodules.storage.node_arrays"):
        arrays = node_arrays("tests", "unwritable", lambda: {"a": np.arange(3)})
    assert arrays["a"].tolist() == [0, 1, 2] and not is_mapped(arrays["a"])
    assert "each process computes its own" in caplog.text and str(blocked) in caplog.text
