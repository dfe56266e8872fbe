"""Python commands run in processes forked from a server that imported torch, Lightning and the library
once per test session.

A test that runs a script, a module (``python -m``) or code (``python -c``) in a process of its own pays
torch's and Lightning's imports, about 6 s of CPU here, every time. ``multiprocessing``'s forkserver
with a preload imports them once; each command then runs in a fresh process forked from it, whose state
is that of an interpreter that has only imported them: its own environment, working directory, session
(a kill reaches the processes it starts) and output files.

Not for a test whose point is a fresh interpreter's imports (what ``import datamodules`` loads, a
variable read at import) or its memory (forked pages are shared with the server): those start Python.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the server imports ``tests.scripts`` whatever the cwd

_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["tests.distributed_support", "tests.scripts.train_record"])


def runs_preloaded(cmd: list[str]) -> bool:
    """Whether ``cmd`` is a Python command this module runs: ``[python, script.py | -m module | -c code, ...]``."""
    return len(cmd) > 1 and cmd[0] == sys.executable and (cmd[1] in ("-m", "-c") or cmd[1].endswith(".py"))


def _run(cmd: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """In a process forked from the server: ``cmd`` as ``python`` would run it, in ``env`` and ``cwd``."""
    os.setsid()
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # A forkserver's child inherits ``forkserver`` as its start method: back to the platform's default, so
    # its DataLoader workers start as they would in a fresh interpreter.
    multiprocessing.set_start_method(None, force=True)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))  # read at import elsewhere
    if cmd[1] == "-m":
        sys.argv = [cmd[2], *cmd[3:]]
        runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
    elif cmd[1] == "-c":
        sys.argv = ["-c", *cmd[3:]]
        sys.path.insert(0, "")  # as ``python -c`` has it
        exec(compile(cmd[2], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = cmd[1:]
        runpy.run_path(cmd[1], run_name="__main__")


class Preloaded:
    """``cmd`` running in a process forked from the server, with the ``Popen`` members tests use:
    ``pid``, ``returncode``, ``wait(timeout)``, ``kill()``. Output goes to the files ``stdout`` and
    ``stderr`` (the same file for both, if ``stderr`` is ``None``)."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path | None) -> None:
        for path in {stdout, stderr or stdout}:
            path.write_text("")
        target = (cmd, env, str(cwd), str(stdout), str(stderr or stdout))
        self._process = _SERVER.Process(target=_run, args=target)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self._process.exitcode

    def kill(self) -> None:
        """Kills the process and every process it started (its session)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.join()


def run(
    cmd: list[str], output: Path, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a Python command, forked from the server:
    its exit code, stdout and stderr (also kept in the folder ``output``); killed after ``timeout`` s."""
    output.mkdir(parents=True, exist_ok=True)
    stdout, stderr = output / "stdout.log", output / "stderr.log"
    process = Preloaded(cmd, dict(os.environ) if env is None else env, cwd, stdout, stderr)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(cmd, process.returncode, stdout.read_text(), stderr.read_text())
