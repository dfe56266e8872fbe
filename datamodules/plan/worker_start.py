"""How DataLoader workers start: ``fork`` where it is safe (it starts in a fraction of a second), ``spawn``
where a fork could deadlock or break (threads or CUDA in the parent), and a one-line error before a
spawned worker would re-run an unguarded training script.
"""

from __future__ import annotations

import ast
import gc
import sys
from pathlib import Path

START_METHODS = ("spawn", "fork", "forkserver")


def keep_inherited_memory_shared(worker_id: int) -> None:
    """A DataLoader worker's first act: every object it inherited goes to the collector's permanent
    generation (``gc.freeze``), so the worker's full collections never write to them and their pages
    stay shared with the main process. Otherwise the first full collection in a forked worker copies
    the whole inherited heap (``benchmarks.soak`` saw +270 MB of PSS at once in a video worker)."""
    gc.freeze()


def unguarded_main_script() -> str | None:
    """The main script's path when a spawned worker would run its training code again: a script (or
    ``-m`` module) with top-level calls and no ``if __name__ == "__main__":`` block; else ``None``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or not Path(path).is_file():
        return None  # an interactive session or notebook: a spawned worker does not re-run it
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            return None
    calls = any(isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) for node in tree.body)
    return path if calls else None


def start_method(
    requested: str | None, spawn_reasons: list[str], owner: str, instead_of_fork: str = "spawn"
) -> str | None:
    """The start method to use: ``requested``, else ``instead_of_fork`` (``spawn``, or ``forkserver``:
    workers forked from a clean server process that imported torch once, which starts them in a
    fraction of a spawn's time) when there are reasons a fork is unsafe, else the platform's default
    (``fork`` on Linux). Spawning from an unguarded script is refused here."""
    method = requested or (instead_of_fork if spawn_reasons else None)
    if method == "forkserver" and requested is None:
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", "datamodules.plan.loader"])  # if not started yet
    if method in ("spawn", "forkserver") and (script := unguarded_main_script()) is not None:
        why = f" ({'; '.join(spawn_reasons)})" if spawn_reasons and requested is None else ""
        raise RuntimeError(
            f"{owner}: DataLoader workers start with {method!r}{why}, and each would run {script} again from the "
            'top: put its training code under `if __name__ == "__main__":`'
            + ("" if spawn_reasons else ", or pass worker_start_method='fork'")
        )
    return method
