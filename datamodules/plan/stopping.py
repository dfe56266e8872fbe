"""A data error stops every rank at the same batch, each with the same message.

One rank whose loader fails (a DataLoader worker killed by the kernel's out-of-memory killer, a read
that spent its retries, a generation circuit breaker) cannot train its next batch. Raised there
alone, the other ranks would wait for it in the next gradient all-reduce: until NCCL's timeout, or
until gloo notices the closed connection and says only that. So, with more than one rank, a loader
never raises: ``stop_together`` turns the failure into a stop marker in place of the batch it could
not make, and tells the batch before it (one batch of look-ahead). ``RankVote`` makes the ranks agree
on it at every batch with one small asynchronous all-reduce on a CPU (gloo) group, waited for one
batch later, when it is long done: so the vote adds no wait to a step, and every rank raises
before the same batch, with every stopping rank's message.
"""

from __future__ import annotations

import re
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

# A batch holding this key asks to stop training: a message (a source's own, on one rank), or a
# ``Stop`` (every batch of a loader with ``stop_together``, on several ranks).
STOP = "stop_training"


class Stop:
    """What a batch of a loader with ``stop_together`` tells the vote (a plain object: Lightning moves
    batches to the device through dataclasses, not through this)."""

    __slots__ = ("here", "error", "ahead", "first")

    def __init__(self, here: str | None = None, error: BaseException | None = None) -> None:
        self.here = here  # why this batch cannot be trained
        self.error = error  # the failure behind ``here``, chained on this rank
        self.ahead: Stop | None = None  # the next batch's
        self.first = False  # the first batch of a loader's iteration: its vote is taken at once


class WorkerDied(RuntimeError):
    """A DataLoader worker process ended without finishing its batch; says which, and the likely cause."""


_OOM_HINT = (
    "A SIGKILL no one sent is most often the kernel's out-of-memory killer (see `dmesg` or the job's memory "
    "limit): lower num_workers, prefetch_factor or batch_size, or give the job more memory"
)


def _worker_death(text: str, workers: list[Any]) -> WorkerDied:
    """What happened to a dead worker: its exit status where the process says (torch's own message
    may only say it "exited unexpectedly"), else torch's words; with the likely cause of a SIGKILL."""
    for worker in workers:
        code = worker.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            hint = f" {_OOM_HINT}" if -code == signal.SIGKILL else ""
            return WorkerDied(f"DataLoader worker (pid {worker.pid}) was killed by {name}.{hint}")
        if code:
            return WorkerDied(
                f"DataLoader worker (pid {worker.pid}) exited with code {code} without finishing its batch"
            )
    pid = re.search(r"\(pid\(?s?\)? ([^)]+)\)", text)
    if pid and re.search(r"killed by signal: Killed\.?$", text.strip()):
        return WorkerDied(f"DataLoader worker (pid {pid.group(1)}) was killed by SIGKILL. {_OOM_HINT}")
    return WorkerDied(f"{text.strip()}: it ended without finishing its batch (a crash in native code, or a kill)")


_deaths: list[str] = []  # torch's messages for workers of this process that died, oldest first


def _recording(previous: Any) -> Any:
    def handler(signum: int, frame: Any) -> None:
        try:
            previous(signum, frame)
        except RuntimeError as error:  # torch's handler: a DataLoader worker died
            _deaths.append(str(error))

    handler.records_worker_deaths = True  # type: ignore[attr-defined]
    return handler


def from_workers(loader: Any, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """The items of ``loader``'s worker iterator (``start()``: it starts or, persistent, resumes its
    workers); a worker's death raises ``WorkerDied`` here, at the next item, rather than from wherever
    the main thread happened to be when torch's SIGCHLD handler ran (mid backward, between collectives).
    It keeps the iterator and a weak reference to ``loader``, never ``start`` (a method bound to the
    loader) or the loader itself: a loader that keeps this generator would otherwise be in a reference
    cycle with it, and when the garbage collector broke that cycle the workers' shutdown came after
    their queues were closed: each worker waited out torch's 5 s join before it was terminated (10 s
    for every dropped 2-worker stream loader)."""
    loader = weakref.ref(loader)
    items = None
    try:
        items = start()
        del start
        # torch installs its handler as it first starts workers: from then on, it records instead.
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGCHLD)
            if callable(previous) and not getattr(previous, "records_worker_deaths", False):
                signal.signal(signal.SIGCHLD, _recording(previous))
        for item in items:
            if _deaths:
                raise RuntimeError(_deaths[0])
            yield item
    except RuntimeError as error:
        if not (_deaths or str(error).startswith("DataLoader worker (pid")):
            raise
        text = _deaths[0] if _deaths else str(error)
        _deaths.clear()
        # A persistent loader's workers may die as they resume, before ``start`` returned the iterator.
        iterator = items if items is not None else getattr(loader(), "_iterator", None)
        raise _worker_death(text, list(getattr(iterator, "_workers", []))) from error


def stop_together(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``batches``, each holding a ``Stop`` under ``STOP``; a failure ends them with a marker batch,
    ``{STOP: Stop(here=...)}``, whose reason the batch before it carries too (``Stop.ahead``)."""
    first, previous = True, None
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except Exception as error:  # a rank's data error: stop every rank, not this one alone
            batch = {STOP: Stop(reason_of(error), error)}
        message = batch.pop(STOP, None)
        stop = message if isinstance(message, Stop) else Stop(message)
        stop.first, first = first, False
        batch[STOP] = stop
        if previous is not None:
            previous[STOP].ahead = stop
            yield previous
        if stop.error is not None:
            yield batch
            return
        previous = batch
    if previous is not None:
        yield previous


def reason_of(error: BaseException) -> str:
    """What stopped a rank, in a line or a few: a DataLoader worker's error comes back with the worker's
    traceback in its message; its own message is what follows the traceback's last frame."""
    if isinstance(error, WorkerDied):
        return str(error)
    text = str(error)
    if "Original Traceback" in text:
        lines = text.rstrip().splitlines()
        last_frame = max(i for i, line in enumerate(lines) if line.startswith(" "))
        named, _, message = "\n".join(lines[last_frame + 1 :]).partition(": ")
        return f"{named.rsplit('.', 1)[-1]}: {message}"
    return f"{type(error).__name__}: {text}"


class RankVote:
    """Every rank raises before the same batch when any rank's batch cannot be trained.

    ``check`` runs on every rank for every batch (``on_after_batch_transfer``), so the ranks take
    the same votes in the same order.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._group: Any = None
        self._pending: tuple[Any, torch.Tensor, str | None, BaseException | None] | None = None

    def check(self, stop: Stop | str | None) -> None:
        if not isinstance(stop, Stop):  # one rank: stop now
            if stop is not None:
                raise RuntimeError(f"{self.owner}: training stopped on every rank by rank(s) [0]: {stop}")
            return
        if self._pending is not None:
            self._settle(*self._pending)
            self._pending = None
        if stop.first:
            self._settle(*self._vote(stop.here, stop.error))
        elif stop.here is not None:  # the previous batch's vote missed it: cannot happen with stop_together
            raise RuntimeError(f"{self.owner}: training stopped on this rank: {stop.here}") from stop.error
        ahead = stop.ahead or Stop()
        self._pending = self._vote(ahead.here, ahead.error, wait=False)

    def finish(self, failed: bool = False) -> None:
        """The end of a run: wait for the last vote (every rank took it), so no collective is left
        running as the process group goes; after a failure, drop it (a peer may be gone)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not None and not failed:
            pending[0].wait()

    def _vote(
        self, message: str | None, error: BaseException | None, wait: bool = True
    ) -> tuple[Any, torch.Tensor, str | None, BaseException | None]:
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([int(message is not None)], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=not wait)
        return work, flag, message, error

    def _settle(self, work: Any, flag: torch.Tensor, message: str | None, error: BaseException | None) -> None:
        if work is not None:
            work.wait()
        if not flag.item():
            return
        messages: list[str | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(messages, message, group=self._group)
        ranks = [rank for rank, text in enumerate(messages) if text is not None]
        reasons = (
            "; ".join(f"rank {rank}: {messages[rank]}" for rank in ranks) if len(ranks) > 1 else messages[ranks[0]]
        )
        raise RuntimeError(f"{self.owner}: training stopped on every rank by rank(s) {ranks}: {reasons}") from error
