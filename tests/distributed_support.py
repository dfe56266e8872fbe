"""Helpers for tests that run real multi-process training in subprocesses (gloo on CPU).

Lightning's ``ddp`` strategy re-launches ``sys.argv`` for the other ranks, so training runs go through
``tests/scripts/train_record.py``, never inside the pytest process.

Every rank is a process of its own, started here with the variables Lightning's own launcher gives
its children (``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so
Lightning launches nothing. Each runs in a process forked from the tests' preloaded server
(``tests/preloaded.py``): a fresh process for every rank of every run, without paying torch's and
Lightning's imports (about 6 s of CPU) each time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.preloaded import REPO, Preloaded, runs_preloaded
from tests.support import read_records

SCRIPTS = REPO / "tests" / "scripts"
TIMEOUT_S = 150

# A launcher's rank variables leaking into the children would change what Lightning launches.
_LAUNCH_ENV = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(port: int, **extra: object) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_ENV and not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "LSB_", "OMPI_"))
    }
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def ranks(cmd: list[str], port: int, devices: int, num_nodes: int = 1) -> list[tuple[list[str], dict[str, str]]]:
    """``cmd`` once per rank of a job of ``num_nodes`` x ``devices``, each with the variables Lightning's
    launcher gives the processes it starts (then it starts none)."""
    world = devices * num_nodes
    return [
        (cmd, launch_env(port, NODE_RANK=node, LOCAL_RANK=local, WORLD_SIZE=world))
        for node in range(num_nodes)
        for local in range(devices)
    ]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen | Preloaded:
    if runs_preloaded(cmd):
        return Preloaded(cmd, env, REPO, log, None)
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def run_processes(
    commands: list[tuple[list[str], dict[str, str]]], log_dir: Path, settled: Callable[[], bool] | None = None
) -> None:
    """Start every command at once and wait for all; on a failure or timeout, kill them and show their logs.

    Each process gets its own session, so a kill also reaches the processes it started.
    With ``settled``, a failure is expected: the processes must exit with an error, and the ranks
    they launched get until ``settled()`` holds (or the timeout) before anything is killed.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for i, (cmd, env) in enumerate(commands):
        logs.append(log_dir / f"process{i}.log")
        procs.append(_start(cmd, env, logs[-1]))
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if settled is not None and not timed_out:
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert settled(), f"the other ranks did not finish within {TIMEOUT_S} s: one was left hanging"
        assert all(p.returncode != 0 for p in procs), "the run was expected to fail"
    for proc in procs:
        if timed_out or proc.returncode != 0:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    failed = [(i, p.returncode) for i, p in enumerate(procs) if timed_out or p.returncode != 0]
    if failed and (settled is None or timed_out):
        for proc in procs:
            proc.wait()
        shown = "\n".join(
            f"--- {log} (exit {p.returncode}) ---\n{log.read_text()[-6000:]}"
            for p, log in zip(procs, logs, strict=True)
        )
        what = f"timed out after {TIMEOUT_S} s" if timed_out else f"failed: {failed}"
        pytest.fail(f"{commands[0][0][1]} {what}\n{shown}", pytrace=False)


@dataclass
class Run:
    """One training run of ``train_record.py``: its records, facts and checkpoints, per rank."""

    root: Path

    def records(self, rank: int) -> list[dict]:
        return read_records(self.root / "records", rank)

    def info(self, rank: int) -> dict:
        return json.loads((self.root / f"info.rank{rank}").read_text())

    def error(self, rank: int) -> str:
        """The exception that ended the run on ``rank``."""
        return (self.root / f"info.error.rank{rank}").read_text()

    def output(self) -> str:
        """What every process of the run printed, rank after rank."""
        return "".join(log.read_text() for log in sorted((self.root / "logs").glob("*.log")))

    def checkpoint(self, step: int) -> Path:
        return self.root / "checkpoints" / f"step={step}.ckpt"

    def rows(self, rank: int, first_step: int = 0, before_step: int | None = None) -> list[str]:
        """Digests of the rows ``rank`` trained on in steps ``[first_step, before_step)``, in order."""
        return [
            digest
            for record in self.records(rank)
            if record["step"] >= first_step and (before_step is None or record["step"] < before_step)
            for digest in record["rows"]
        ]

    def validated(self, rank: int) -> list[str]:
        """Digests of the rows ``rank`` evaluated (real rows only, padding excluded)."""
        path = self.root / f"records.val.rank{rank}"
        return [digest for line in path.read_text().splitlines() for digest in json.loads(line)]


def rows_by_position(run: Run, dp_size: int, batch_size: int, first_position: int = 0, **steps: int) -> dict[int, str]:
    """``{plan position: row digest}`` of every row ``run`` trained (``Run.rows`` with ``steps``): rank ``r``'s
    micro-batch ``i`` covers ``batch_size`` positions from ``first_position + (i * dp_size + r) * batch_size``."""
    out: dict[int, str] = {}
    for rank in range(dp_size):
        rows = run.rows(rank, **steps)
        for j, digest in enumerate(rows):
            i, offset = divmod(j, batch_size)
            out[first_position + (i * dp_size + rank) * batch_size + offset] = digest
    return out


def resumed_on_two_ranks(stopped: Run, resumed: Run, batch_size: int, stop_step: int) -> dict[int, str]:
    """``{plan position: row digest}`` of a 1-rank run stopped at ``stop_step`` and resumed on 2 ranks;
    every position from 0 on is trained once, none padded, and both ranks agree on where they stopped."""
    before = rows_by_position(stopped, 1, batch_size, before_step=stop_step)
    after = rows_by_position(resumed, 2, batch_size, first_position=stop_step * batch_size)
    end = stop_step * batch_size + len(after)
    assert sorted(before) + sorted(after) == list(range(end)), "a position was skipped or trained twice"
    assert resumed.info(0)["positions_consumed"] == resumed.info(1)["positions_consumed"] == end
    return {**before, **after}


def train_record(args: list[str], root: Path, num_nodes: int = 1, failing_ranks: int = 0) -> Run:
    """Run ``train_record.py`` with ``args`` (plus its output paths under ``root``) and wait for it.

    With ``num_nodes > 1`` one process per node is launched here, each with its ``NODE_RANK``, all
    meeting at ``MASTER_ADDR=127.0.0.1``; Lightning launches the ranks inside a node. With
    ``failing_ranks``, the run must fail, each of that many ranks recording its error (``Run.error``).
    """
    cmd = [sys.executable, str(SCRIPTS / "train_record.py"), *args, "--num-nodes", str(num_nodes)]
    cmd += ["--root", str(root), "--record", str(root / "records"), "--info", str(root / "info")]
    port = free_port()
    settled = (lambda: len(list(root.glob("info.error.rank*"))) == failing_ranks) if failing_ranks else None
    if "--strategy" in args and args[args.index("--strategy") + 1] == "ddp_spawn":  # Lightning's own spawn
        commands = [(cmd, launch_env(port, NODE_RANK=node)) for node in range(num_nodes)]
    else:
        devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 1
        commands = ranks(cmd, port, devices, num_nodes)
    run_processes(commands, root / "logs", settled)
    return Run(root)


def assert_positions_consumed_once(parts: list[dict[int, object]], total: int, plan_at) -> None:
    """The ``{plan position: what was trained}`` parts cover ``[0, total)`` once, as ``plan_at(total)`` says."""
    merged: dict[int, object] = {}
    for part in parts:
        twice = merged.keys() & part.keys()
        assert not twice, f"positions trained in both runs: {sorted(twice)}"
        merged.update(part)
    assert sorted(merged) == list(range(total)), "some plan positions were skipped"
    assert [merged[p] for p in range(total)] == plan_at(total), "a position trained another sample"
