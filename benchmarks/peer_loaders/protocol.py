"""What every contender of ``benchmarks.peers`` implements, and the measurements run on each.

Each measurement runs in a fresh process, ``python -m benchmarks.peer_loaders.protocol '<json>'``,
started by ``benchmarks/peers.py`` with the contender's own interpreter (Mosaic ``streaming`` lives
in a virtual environment of its own, since its pins conflict with ours). So this file imports only
numpy, torch, the standard library and ``benchmarks.common`` (which needs no more), and a contender
module only those plus its own library.

A contender module (``benchmarks/peer_loaders/<name>.py``) defines:

- ``convert(corpus: Path, out: Path, seq_len: int) -> None``: the corpus, ``corpus/all/``,
  ``corpus/source0/`` and ``corpus/source1/`` (uint16 ``.npy`` shards), rewritten with the peer's
  own tooling into ``out/`` (samples of ``seq_len + 1`` tokens); nothing for those that read ``.npy``.
- ``Contender(setup: Setup, state: Any | None)``: a loader over ``setup.data`` (the single corpus,
  or with ``setup.mixture`` the two sources weighted ``setup.weights``), ``setup.batch_size``
  samples per batch, ``setup.workers`` loader workers, shuffled with ``setup.seed``; resumed from
  ``state`` (what ``state_dict`` or ``state_at`` returned) when given. Its methods:
  ``batches()``, an endless iterator (crossing epochs) of 2-D integer arrays or tensors, one row of
  token ids per sample; ``state_dict()``, the peer's own resume state after the batches yielded so
  far (raise ``Unsupported`` with the reason where the peer has none); ``close()``.
- ``state_at(setup: Setup, step: int) -> tuple[Any, str]``: the state a checkpoint taken after
  ``step`` batches would hold, built with the peer's own API, and in words what resuming from it
  must replay (``"nothing"``, ``"the sampler's N indices"``, ...). Raise ``Unsupported`` if none.

Module ``ours`` may instead define ``exact_resume(setup, steps, stop) -> tuple[list[str], list[str]]``
(the digests of an uninterrupted run and of a run stopped and resumed), since our state is taken
through ``Trainer.fit``, the path users run.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import descendants, memory_kb

SOURCE_SPLIT = 25_000  # source0's token ids lie below this, source1's at or above it


class Unsupported(Exception):
    """The peer cannot do what was asked (no resume state, no weighted mixture); the message says why."""


@dataclass
class Setup:
    data: str  # the contender's converted corpus (its ``out`` folder), or the corpus itself
    corpus: str  # the raw ``.npy`` corpus: all/, source0/, source1/
    seq_len: int = 2048
    batch_size: int = 8
    workers: int = 0
    mixture: bool = False
    weights: list[float] = field(default_factory=lambda: [0.7, 0.3])
    seed: int = 0


class LoaderContender:
    """A contender around one loader (``self.loader``) that resumes through its own ``state_dict``;
    one pass of the loader is an epoch, the next pass the next one."""

    loader: Any
    _epoch: Any = None

    def batches(self) -> Iterator[Any]:
        while True:
            self._epoch = iter(self.loader)
            yield from self._epoch

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def close(self) -> None:
        if self._epoch is not None and hasattr(self._epoch, "close"):
            self._epoch.close()  # the loader's generator: dropping torch's iterator joins its workers
        self._epoch = self.loader = None  # and the loader, which holds persistent workers


def as_rows(batch: Any) -> np.ndarray:
    """A batch as a 2-D numpy array, one row per sample."""
    rows = batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)
    if rows.ndim != 2:
        raise ValueError(f"a contender's batch must be 2-D (samples x tokens), got shape {rows.shape}")
    return rows


def digest(batch: Any) -> str:
    rows = np.ascontiguousarray(as_rows(batch).astype(np.int64))
    return hashlib.blake2b(rows.tobytes(), digest_size=8).hexdigest()


def source0_count(batch: Any) -> int:
    """Samples of the batch drawn from source0 (every token of source0 lies below SOURCE_SPLIT)."""
    return int((as_rows(batch)[:, 0] < SOURCE_SPLIT).sum())


class PeakMemory:
    """Peak memory of this process and, summed, of its children (the loader's workers), sampled every 50 ms.

    ``rss``: resident pages, file-backed ones included (a memory-mapped corpus counts as it is read,
    though the kernel can drop those pages). ``added``: anonymous and shared-memory pages over the
    whole process tree, each shared page counted once (PSS), less the tree's at ``__enter__`` (the
    imported libraries, which the training process holds anyway): the memory the loader adds.
    """

    def __init__(self) -> None:
        self.peaks = {"main rss": 0, "workers rss": 0, "added": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._baseline = 0

    @staticmethod
    def _read(pid: int) -> tuple[int, int]:
        """(RSS, PSS of anonymous and shared-memory pages) of ``pid``, in bytes."""
        fields = memory_kb(pid)
        return fields.get("Rss", 0) * 1024, (fields.get("Pss_Anon", 0) + fields.get("Pss_Shmem", 0)) * 1024

    def sample(self) -> None:
        try:
            children = descendants(os.getpid())
            rss, private = self._read(os.getpid())
            workers_rss = 0
            for child in children:
                child_rss, child_private = self._read(child)
                workers_rss += child_rss
                private += child_private
            if descendants(os.getpid()) != children:
                return  # a fork or an exit between the reads: pages would be counted twice or not at all
        except OSError:  # a child exited since it was listed
            return
        self.peaks["main rss"] = max(self.peaks["main rss"], rss)
        self.peaks["workers rss"] = max(self.peaks["workers rss"], workers_rss)
        self.peaks["added"] = max(self.peaks["added"], private - self._baseline)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.sample()

    def __enter__(self) -> PeakMemory:
        # Child processes already there (another loader's workers) are not this loader's.
        self._baseline = sum(self._read(pid)[1] for pid in [os.getpid(), *descendants(os.getpid())])
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def megabytes(self) -> dict[str, float]:
        return {f"{name} MB": value / 2**20 for name, value in self.peaks.items()}


def contender_module(name: str) -> Any:
    return importlib.import_module(f"benchmarks.peer_loaders.{name}")


def run(module: Any, setup: Setup, warmup: int, seconds: float) -> dict[str, Any]:
    """Fresh-process first batch, then tokens/s over ``seconds`` after ``warmup`` batches, and peak memory."""
    with PeakMemory() as memory:
        t0 = time.perf_counter()
        contender = module.Contender(setup, None)
        batches = contender.batches()
        first = next(batches)
        first_batch = time.perf_counter() - t0
        tokens_per_batch = as_rows(first).shape[0] * setup.seq_len
        for _ in range(warmup):
            next(batches)
        count, t0 = 0, time.perf_counter()
        deadline = t0 + seconds
        while time.perf_counter() < deadline:
            next(batches)
            count += 1
        elapsed = time.perf_counter() - t0
        contender.close()
    return {"first batch s": first_batch, "tokens/s": count * tokens_per_batch / elapsed, **memory.megabytes()}


def resume(module: Any, setup: Setup, step: int) -> dict[str, Any]:
    """Seconds from a checkpoint's state at ``step`` to the first batch after it."""
    try:
        state, replays = module.state_at(setup, step)
    except Unsupported as e:
        return {"resume s": None, "replays": f"cannot resume: {e}"}
    t0 = time.perf_counter()
    contender = module.Contender(setup, state)
    next(contender.batches())
    elapsed = time.perf_counter() - t0
    contender.close()
    return {"resume s": elapsed, "replays": replays}


def take(contender: Any, count: int) -> list[Any]:
    batches = contender.batches()
    return [as_rows(next(batches)).copy() for _ in range(count)]


def stop_and_resume(module: Any, setup: Setup, steps: int, stop: int) -> tuple[list[str], list[str]]:
    """Digests of ``steps`` batches uninterrupted, and of ``stop`` batches, the peer's state (through
    a pickle, as a checkpoint file keeps it), and a new loader resumed from it up to ``steps``."""
    contender = module.Contender(setup, None)
    whole = [digest(b) for b in take(contender, steps)]
    contender.close()
    contender = module.Contender(setup, None)
    try:
        take(contender, stop)
        state = pickle.loads(pickle.dumps(contender.state_dict()))
    finally:
        contender.close()
    contender = module.Contender(setup, state)
    resumed = whole[:stop] + [digest(b) for b in take(contender, steps - stop)]
    contender.close()
    return whole, resumed


def exact(module: Any, setup: Setup, steps: int, stop: int, mixture_batches: int = 200) -> dict[str, Any]:
    """Whether the batches after a stop at ``stop`` and a resume equal those of an uninterrupted run
    of ``steps`` batches (``module.exact_resume`` where the module has its own way, else
    ``stop_and_resume``). With a mixture, over ``mixture_batches`` batches: the largest deviation of a
    batch from the weights, in samples, and the share of source0 in all of them."""
    try:
        if hasattr(module, "exact_resume"):
            whole, resumed = module.exact_resume(setup, steps, stop)
        else:
            whole, resumed = stop_and_resume(module, setup, steps, stop)
    except Unsupported as e:
        result: dict[str, Any] = {"exact resume": f"no: {e}"}
    else:
        mismatched = [i for i, (a, b) in enumerate(zip(whole, resumed, strict=True)) if a != b]
        differ = f"no: {len(mismatched)} of {steps - stop} batches after the resume differ"
        result = {"exact resume": differ if mismatched else "yes"}
    if setup.mixture:
        contender = module.Contender(setup, None)
        counts = np.array([source0_count(b) for b in take(contender, mixture_batches)])
        contender.close()
        expected = setup.weights[0] / sum(setup.weights) * setup.batch_size
        result["max deviation"] = float(np.abs(counts - expected).max())
        result["source0 share"] = float(counts.sum() / (len(counts) * setup.batch_size))
    return result


def main() -> None:
    task = json.loads(sys.argv[1])
    module = contender_module(task["contender"])
    setup = Setup(**task["setup"])
    if task["task"] == "run":
        result = run(module, setup, task["warmup"], task["seconds"])
    elif task["task"] == "resume":
        result = resume(module, setup, task["step"])
    elif task["task"] == "exact":
        result = exact(module, setup, task["steps"], task["stop"])
    elif task["task"] == "convert":
        t0 = time.perf_counter()
        module.convert(Path(setup.corpus), Path(setup.data), setup.seq_len)
        result = {"convert s": time.perf_counter() - t0}
    else:
        raise ValueError(f"unknown task {task['task']!r}: expected run, resume, exact or convert")
    print("RESULT " + json.dumps({**result, "setup": asdict(setup)}), flush=True)


if __name__ == "__main__":
    main()
