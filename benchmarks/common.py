"""What every benchmark shares: synthetic token shards, page-cache warming and result tables.

Absolute times drift on a shared machine, so each script reports ratios between contenders timed
in the same run; the tables written here are the record.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 50_257  # GPT-2's: fits uint16, like most token shards in practice
_WRITE_CHUNK = 1 << 24  # tokens generated and written per step, so memory stays flat at any size


def peer_venv(name: str, installs: Sequence[Sequence[str]], create: bool) -> str | None:
    """The Python of ``benchmarks/.venvs/<name>``, a virtual environment for a peer whose pins conflict
    with ours: created (minutes) if missing and ``create``, by one ``pip install`` per entry of
    ``installs``; ``None`` when it is missing and not created."""
    import subprocess
    import sys

    venv = ROOT / "benchmarks" / ".venvs" / name
    python = venv / "bin" / "python"
    if not python.exists() and create:
        print(f"creating {venv} (its pins conflict with ours)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for packages in installs:
            subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    return str(python) if python.exists() else None


def result_of(command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command`` (a measurement in a fresh process, from the repository root, in ``env``) and return
    the JSON it printed on a ``RESULT `` line, or ``{"error": ...}`` with its last line of stderr."""
    import subprocess

    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return {"error": (lines[-1] if lines else f"exit code {done.returncode}")[:300]}


def memory_kb(pid: int) -> dict[str, int]:
    """The fields of ``/proc/<pid>/smaps_rollup`` (``Rss``, ``Pss``, ``Pss_Anon``, ``Pss_Shmem``, ...), in kB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {name: int(rest.split()[0]) for name, _, rest in (line.partition(":") for line in f) if rest.strip()}


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (``/proc/<pid>/task/*/children``)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found + [g for c in found for g in descendants(c)]


def write_token_shards(directory: Path, num_tokens: int, num_shards: int, seed: int = 0) -> list[Path]:
    """``num_shards`` uint16 ``.npy`` shards of random token ids, ``num_tokens`` in all.

    The ``.npy`` header carries the dtype, so no ``metadata.json`` is needed to read them.
    """
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = np.full(num_shards, num_tokens // num_shards, dtype=np.int64)
    sizes[: num_tokens % num_shards] += 1
    paths = []
    for i, size in enumerate(sizes.tolist()):
        path = directory / f"shard_{i:05d}.npy"
        shard = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(size,))
        for lo in range(0, size, _WRITE_CHUNK):
            hi = min(size, lo + _WRITE_CHUNK)
            shard[lo:hi] = rng.integers(0, VOCAB_SIZE, hi - lo, dtype=np.uint16)
        shard.flush()
        del shard
        paths.append(path)
    return paths


def cached_token_shards(directory: Path, num_tokens: int, num_shards: int) -> list[Path]:
    """``write_token_shards`` in ``directory``, read once so they sit in the page cache.

    Shards of the right count and size already there (a kept ``--data-dir``) are reused.
    """
    paths = sorted(directory.glob("shard_*.npy"))
    if len(paths) != num_shards or sum(len(np.load(p, mmap_mode="r")) for p in paths) != num_tokens:
        for path in paths:
            path.unlink()
        paths = write_token_shards(directory, num_tokens, num_shards)
    warm_page_cache(paths)
    return paths


def warm_page_cache(paths: Sequence[Path]) -> int:
    """Read every file once so timed reads hit the page cache, not the disk; returns bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


@contextlib.contextmanager
def data_directory(given: str | None) -> Iterator[Path]:
    """``given`` (kept afterwards), or a temporary directory removed on exit."""
    if given is not None:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="datamodules-bench-") as tmp:
        yield Path(tmp)


def results_directory(given: Path | None, quick: bool) -> Path:
    """``given``, else ``benchmarks/results``; a ``--quick`` smoke run must not overwrite that record."""
    if given is not None:
        return given
    return Path(tempfile.gettempdir()) / "datamodules-benchmarks-quick" if quick else RESULTS_DIR


def markdown_table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def report(
    name: str,
    tables: dict[str, tuple[Sequence[str], Sequence[dict[str, Any]]]],
    config: dict[str, Any],
    checks: dict[str, bool],
    results_dir: Path,
) -> None:
    """Print the tables (title: (columns, rows)) and the checks; write ``<name>.json`` and ``<name>.md``."""
    machine = f"{platform.node()} / {platform.processor() or platform.machine()} / {os.cpu_count()} CPUs"
    parts = [f"# {name}", ", ".join(f"{k}={v}" for k, v in config.items())]
    parts += [f"## {title}\n\n{markdown_table(columns, rows)}" for title, (columns, rows) in tables.items()]
    parts.append("\n".join(f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in checks.items()))
    text = "\n\n".join(parts) + "\n"
    print(text)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.md").write_text(f"{text}\nMachine: {machine}; run {time.strftime('%Y-%m-%d %H:%M')}.\n")
    record = {
        "name": name,
        "config": config,
        "tables": {title: list(rows) for title, (_, rows) in tables.items()},
        "checks": checks,
        "machine": machine,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (results_dir / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"results written to {results_dir / name}.{{json,md}}")


def add_run_arguments(parser: argparse.ArgumentParser, data: bool = True) -> None:
    """The flags every benchmark shares: where data and results go, and ``--quick`` smoke runs."""
    if data:
        parser.add_argument("--data-dir", help="write (and keep) the shards here instead of a temporary directory")
    parser.add_argument("--results-dir", type=Path, help="default: benchmarks/results (a temp folder with --quick)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few seconds")


def _together_entry(work: Callable[..., float], args: tuple[Any, ...], start: Any, results: Any) -> None:
    import torch

    torch.set_num_threads(1)
    results.put(work(*args, ready=start.wait))


def started_together(
    work: Callable[..., float], args_per_process: list[tuple[Any, ...]], start_method: str = "spawn"
) -> list[float]:
    """``work(*args, ready=...)`` in one process per ``args`` (one torch thread each), all timing from
    the same moment: ``work`` sets up, calls ``ready()``, then returns its measure. Their values, in the
    order they finished."""
    import multiprocessing

    context = multiprocessing.get_context(start_method)
    start, results = context.Barrier(len(args_per_process)), context.Queue()
    workers = [context.Process(target=_together_entry, args=(work, args, start, results)) for args in args_per_process]
    for worker in workers:
        worker.start()
    values = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return values


def in_processes_at_once(work: Callable[..., float], args: tuple[Any, ...], processes: int) -> float:
    """The sum of ``work``'s rates over ``processes`` spawned processes (fresh interpreters) started
    together (``started_together``): what a loop alone gives on that many busy cores, the floor for
    that many workers."""
    return sum(started_together(work, [args] * processes))


def gloo_ranks(target: Callable[..., None], args: tuple[Any, ...], ranks: int = 2) -> Any:
    """``target(rank, port, *args, results)`` in ``ranks`` spawned processes that meet on a free loopback
    ``port``: the first value a rank puts on the queue ``results``, or an error as soon as a rank has
    died without one (the others are killed then, not left waiting for it)."""
    import queue
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(rank, port, *args, results)) for rank in range(ranks)]
    for process in processes:
        process.start()
    while True:
        try:
            value = results.get(timeout=1)
            break
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"a rank failed (exit codes {dead}); its traceback is above") from None
    for process in processes:
        process.join()
    return value


def tiny_shards(folder: Path, shards: int, per_shard: int) -> list[Path]:
    """``shards`` tars of ``per_shard`` samples each, written fast (a million samples in seconds: the
    headers stamped on a template by numpy): sample ``n`` is one member, ``{n:07d}.txt`` holding
    ``tiny_caption(n)`` in one block after its header."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        path = folder / f"shard-{shard:05d}.tar"
        with path.open("wb") as f:
            f.write(_captions(np.arange(shard * per_shard, (shard + 1) * per_shard)).tobytes())
            f.write(bytes(2 * tarfile.BLOCKSIZE))  # the end-of-archive blocks
        paths.append(path)
    return paths


def tiny_conversations(folder: Path, count: int) -> Path:
    """A saved ``datasets.Dataset`` of ``count`` tokenized conversations of 1 to 12 tokens (the columns
    ``prepare_conversations`` writes: ``input_ids``, ``loss_mask``, ``seq_len``), built by Arrow in
    seconds for millions."""
    import datasets
    import pyarrow as pa

    lengths = np.random.default_rng(0).integers(1, 13, count)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    ids = pa.ListArray.from_arrays(offsets, pa.array(np.arange(lengths.sum(), dtype=np.int32) % 1000))
    mask = pa.ListArray.from_arrays(offsets, pa.array(np.ones(lengths.sum(), dtype=np.int8)))
    table = pa.table({"input_ids": ids, "loss_mask": mask, "seq_len": pa.array(lengths)})
    datasets.Dataset(table).save_to_disk(str(folder))
    return folder


def tiny_caption(n: int) -> str:
    return f"caption {n:07d} of a tiny sample"


def _captions(numbers: np.ndarray) -> np.ndarray:
    """The header and data block of member ``{n:07d}.txt`` for each of ``numbers``, as an array of shape
    ``(len(numbers), 2, 512)``: a template's header and data with ``n`` and the checksum stamped."""
    template = tarfile.TarInfo("0000000.txt")
    text = tiny_caption(0).encode()
    template.mtime, template.mode, template.size = 1_700_000_000, 0o644, len(text)
    out = np.zeros((len(numbers), 2, tarfile.BLOCKSIZE), dtype=np.uint8)
    out[:, 0] = np.frombuffer(template.tobuf(tarfile.USTAR_FORMAT), dtype=np.uint8)
    out[:, 1, : len(text)] = np.frombuffer(text, dtype=np.uint8)
    at = text.index(b"0000000")
    out[:, 0, :7] = out[:, 1, at : at + 7] = _digits(numbers, 10, 7)
    out[:, 0, 148:156] = ord(" ")  # the checksum is summed over the header with its own field as spaces
    out[:, 0, 148:154] = _digits(out[:, 0].sum(axis=1, dtype=np.int64), 8, 6)
    out[:, 0, 154] = 0
    return out


def _digits(values: np.ndarray, base: int, width: int) -> np.ndarray:
    """``values`` written in ``base`` with ``width`` ASCII digits each, zero-padded: ``(len(values), width)``."""
    powers = base ** np.arange(width - 1, -1, -1)
    return (values[:, None] // powers % base + ord("0")).astype(np.uint8)
