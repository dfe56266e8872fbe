"""Model-parallel groups read once: the first rank of each group reads the batches, its peers receive them.

Under tensor (or context, or sequence) parallelism the ranks of one model-parallel group train on the
same batch. Reading it on each of them multiplies the reads, the decoding and (for hidden states
generated on demand) the requests by the group's size. With ``broadcast_within`` a DataModule names
the dimensions of the strategy's device mesh whose ranks share a batch; ``broadcast_groups`` makes
gloo groups per set of such ranks (CPU groups: batches are host tensors before the Trainer moves
them), and ``BroadcastLoader`` wraps a rank's loader: the group's first rank iterates it and
broadcasts each batch; the peers never iterate theirs (no worker starts, nothing is read) and yield
what they receive. Training batches are read, sent and received on a thread, ``BATCHES_AHEAD``
batches before the step that takes them, so the transfer overlaps the step.

A batch travels as one byte buffer: its tensors' bytes back to back, its numbers (``int``, ``float``)
in a small tensor, and its layout (the tree of keys, each tensor's dtype and shape, any other leaf
such as the stop vote's marker) pickled in a header that is sent only when it differs from the last
batch's: a group of ``G`` ranks pays two or three broadcasts a batch.
"""

from __future__ import annotations

import math
import pickle
import queue
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from datamodules.plan.parallelism import _sendable
from datamodules.plan.sequence_split import SequenceSplit
from datamodules.plan.stopping import Stop

_SAME, _NEW, _END = 0, 1, 2  # what follows a batch's first message
BATCHES_AHEAD = 2  # training batches a group sends before the step that takes them


@dataclass
class BroadcastGroup:
    """This rank's group: gloo process groups over ``ranks`` (global ranks), led by ``ranks[0]``;
    ``split`` cuts each batch's rows for this rank (context parallelism), or ``None``.

    Training batches cross ``ahead_group`` on a thread of their own, ahead of the step (``active`` is
    that transfer); validation and test batches cross ``group`` in step with the loop, so a validation
    in the middle of an epoch never interleaves its messages with the training batches'."""

    group: Any
    ranks: tuple[int, ...]
    rank: int  # this process's global rank
    split: SequenceSplit | None = None
    ahead_group: Any = None
    active: _Transfer | None = field(default=None, compare=False)

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def leads(self) -> bool:
        return self.rank == self.leader


def broadcast_groups(
    trainer: Any, dims: str | list[str] | tuple[str, ...], split: str | list[str] | tuple[str, ...] = (),
    layout: str = "head_tail",
) -> BroadcastGroup | None:  # fmt: skip
    """The group of this rank along the device mesh's dimensions ``dims`` and ``split`` (one gloo group
    made per set of ranks that differ only along them, on every rank, as ``new_group`` requires);
    ``None`` when every such group holds one rank. The ranks along ``split`` each take a share of
    every row (``SequenceSplit`` with ``layout``), by their place along those dimensions. The strategy
    must expose a ``device_mesh`` with those dimension names."""
    shared, cut = _names(dims), _names(split)
    names = [name for name in shared if name not in cut] + cut
    option = " and ".join(f"{o}={v!r}" for o, v in (("broadcast_within", dims), ("split_sequence_for", split)) if v)
    strategy = getattr(trainer, "strategy", None)
    mesh = getattr(strategy, "device_mesh", None)
    if mesh is None:
        raise ValueError(
            f"{option} names dimensions of the strategy's device mesh, but "
            f"{type(strategy).__name__} has none: use ModelParallelStrategy, or a strategy with a "
            "`device_mesh` (torch.distributed.device_mesh.DeviceMesh) whose dimensions are named"
        )
    known = list(mesh.mesh_dim_names or ())
    unknown = [name for name in names if name not in known]
    if unknown or len(set(shared)) != len(shared) or len(set(cut)) != len(cut):
        raise ValueError(f"{option}: the device mesh's dimensions are {known}")
    if "data_parallel" in names or "dp" in names:
        raise ValueError(f"{option} would give data-parallel ranks the same batches")
    layout_ranks = mesh.mesh  # global ranks, one axis per dimension
    moved = [known.index(name) for name in names]
    kept = [i for i in range(len(known)) if i not in moved]
    size = math.prod(layout_ranks.shape[i] for i in moved)
    sets = layout_ranks.permute(kept + moved).reshape(-1, size).tolist()
    if size == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(sets, backend="gloo")
    ahead_group, _ = dist.new_subgroups_by_enumeration(sets, backend="gloo")
    rank = dist.get_rank()
    ranks = next(tuple(s) for s in sets if rank in s)
    cut_size = math.prod(layout_ranks.shape[known.index(name)] for name in cut)
    # The split dimensions vary fastest along a set: a rank's place among them is its place mod their size.
    sequence = SequenceSplit(ranks.index(rank) % cut_size, cut_size, layout) if cut_size > 1 else None
    return BroadcastGroup(group, ranks, rank, sequence, ahead_group)


def _names(dims: str | list[str] | tuple[str, ...]) -> list[str]:
    return [dims] if isinstance(dims, str) else list(dims or ())


class BroadcastLoader:
    """``loader`` for the ranks of ``group``: its first rank iterates ``loader`` and sends each batch to
    the others, which yield what they receive and never iterate their own ``loader`` (kept for its
    length and its sampler, which the Trainer and the DataModule read on every rank alike). Where the
    group splits sequences, every rank (the first too) yields its share of each batch.

    With ``ahead > 0`` (training) the batches are read, sent and received on a thread, up to ``ahead``
    batches before the loop takes them, so the transfer overlaps the step; with ``0``, in step with the
    loop. An iteration the loop leaves (``max_steps``, a sanity check's few batches) is ended when the
    next one starts, or at ``close``: every rank leaves it after the same batch, and its first rank
    sends the end, so its peers' threads stop too."""

    def __init__(self, loader: Any, group: BroadcastGroup, ahead: int = 0) -> None:
        self.loader, self.broadcast, self.ahead = loader, group, ahead

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # sampler, stop_together: the wrapped loader's
        if name in _OWN:
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __iter__(self) -> Iterator[Any]:
        group = self.broadcast
        if self.ahead:
            batches = self._ahead()
        else:
            channel = _Channel(group.group, group.leader)
            batches = _lead(self.loader, channel) if group.leads else _follow(channel)
        return batches if group.split is None else map(group.split, batches)

    def _ahead(self) -> Iterator[Any]:
        # Begins at the first batch asked for (Lightning makes an iterator it never reads, to check
        # the loader), ending the iteration before it, which the loop left.
        group = self.broadcast
        if group.active is not None:
            group.active.finish()
        group.active = _Transfer(iter(self.loader) if group.leads else None, group, self.ahead)
        yield from group.active.batches()

    def close(self) -> None:
        if self.ahead and self.broadcast.active is not None:
            self.broadcast.active.finish(timeout=_CLOSE_WAIT_S)
            self.broadcast.active = None
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


_OWN = ("loader", "broadcast", "ahead")
_CLOSE_WAIT_S = 30.0  # at teardown: a peer that died must not keep this process from exiting


@dataclass(frozen=True)
class _Channel:
    group: Any  # a process group
    leader: int  # the global rank that sends


def _lead(batches: Any, channel: _Channel) -> Iterator[Any]:
    # Only an iteration that ends says so: one the loop leaves is left by every rank of the group after
    # the same batch, and sends nothing more.
    sender = _Sender(channel)
    for batch in batches:
        sender.send(batch)
        yield batch
    sender.end()


def _follow(channel: _Channel) -> Iterator[Any]:
    receiver = _Receiver(channel)
    while (batch := receiver.receive()) is not None:
        yield batch


class _Transfer:
    """One training iteration's batches, sent or received on a thread, queued ``ahead`` deep."""

    _DONE = object()

    def __init__(self, batches: Iterator[Any] | None, group: BroadcastGroup, ahead: int) -> None:
        self.queue: queue.Queue = queue.Queue(ahead)
        self.leaving = threading.Event()
        channel = _Channel(group.ahead_group, group.leader)
        work = (self._send, batches, channel) if batches is not None else (self._receive, channel)
        self.thread = threading.Thread(target=self._run, args=work, daemon=True)
        self.thread.start()

    def _run(self, work: Callable[..., None], *args: Any) -> None:
        try:
            work(*args)
            self._put(self._DONE)
        except BaseException as error:  # raised where the loop takes its next batch
            self._put(_Failed(error))

    def _send(self, batches: Iterator[Any], channel: _Channel) -> None:
        sender = _Sender(channel)
        for batch in batches:
            sender.send(batch)
            if not self._put(batch):
                break  # the loop left: the peers hear the end, and drop what they received past it
        sender.end()

    def _receive(self, channel: _Channel) -> None:
        for batch in _follow(channel):  # after the loop left, dropped until the end arrives
            self._put(batch)

    def _put(self, item: Any) -> bool:
        """Queues ``item`` unless the loop left this iteration (then ``False``)."""
        while not self.leaving.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def batches(self) -> Iterator[Any]:
        while (item := self.queue.get()) is not self._DONE:
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def finish(self, timeout: float | None = None) -> None:
        """Ends the iteration the loop left: the thread stops once its group heard the end."""
        self.leaving.set()
        self.thread.join(timeout)


@dataclass(frozen=True)
class _Failed:
    error: BaseException


def _bcast(tensor: torch.Tensor, channel: _Channel) -> None:
    dist.broadcast(tensor, src=channel.leader, group=channel.group)


class _Sender:
    def __init__(self, channel: _Channel) -> None:
        self.group, self.header = channel, b""

    def send(self, batch: Any) -> None:
        leaves, spec = tree_flatten(batch)
        kinds = [_kind(leaf) for leaf in leaves]
        header = pickle.dumps((spec, kinds))
        payload = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in leaves if isinstance(t, torch.Tensor)]
        numbers = [leaf for leaf, kind in zip(leaves, kinds, strict=True) if kind in _NUMBERS]
        if numbers:
            packed = struct.pack("<" + "".join(_NUMBERS[kind] for kind in kinds if kind in _NUMBERS), *numbers)
            payload.append(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        flat = torch.cat(payload) if payload else torch.empty(0, dtype=torch.uint8)
        new = header != self.header
        _bcast(torch.tensor([_NEW if new else _SAME, len(header), flat.numel()], dtype=torch.int64), self.group)
        if new:
            _bcast(torch.frombuffer(bytearray(header), dtype=torch.uint8), self.group)
            self.header = header
        _bcast(flat, self.group)

    def end(self) -> None:
        _bcast(torch.tensor([_END, 0, 0], dtype=torch.int64), self.group)


class _Receiver:
    def __init__(self, channel: _Channel) -> None:
        self.group, self.layout = channel, None

    def receive(self) -> Any:
        """The next batch, or ``None`` at the end of the leader's iteration."""
        head = torch.empty(3, dtype=torch.int64)
        _bcast(head, self.group)
        what, header_bytes, payload_bytes = head.tolist()
        if what == _END:
            return None
        if what == _NEW:
            header = torch.empty(header_bytes, dtype=torch.uint8)
            _bcast(header, self.group)
            self.layout = pickle.loads(header.numpy().tobytes())
        flat = torch.empty(payload_bytes, dtype=torch.uint8)
        _bcast(flat, self.group)
        spec, kinds = self.layout
        fmt = "<" + "".join(_NUMBERS[kind] for kind in kinds if kind in _NUMBERS)
        numbers = iter(struct.unpack(fmt, flat[flat.numel() - struct.calcsize(fmt) :].numpy().tobytes()))
        leaves, offset = [], 0
        for kind in kinds:
            if kind in _NUMBERS:
                leaves.append(next(numbers))
            elif kind[0] == "tensor":
                _, dtype, shape = kind
                size = math.prod(shape) * dtype.itemsize
                leaves.append(flat[offset : offset + size].view(dtype).reshape(shape))
                offset += size
            else:
                leaves.append(kind[1])
        return tree_unflatten(leaves, spec)


_NUMBERS = {"int": "q", "float": "d"}  # a number leaf's kind, and its struct format


def _kind(leaf: Any) -> Any:
    """What the header says of a leaf: a tensor's dtype and shape, a number's type (its value travels in
    the payload), or any other object itself (pickled)."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, tuple(leaf.shape))
    if isinstance(leaf, int) and not isinstance(leaf, bool):
        return "int"
    if isinstance(leaf, float):
        return "float"
    if isinstance(leaf, Stop):
        return ("object", _sendable_stop(leaf))
    return ("object", leaf)


def _sendable_stop(stop: Stop) -> Stop:
    """``stop`` with its errors (and its next batch's) as they survive pickling."""
    copy = Stop(stop.here, None if stop.error is None else _sendable(stop.error, dist.get_rank()))
    copy.first = stop.first
    if stop.ahead is not None:
        copy.ahead = _sendable_stop(stop.ahead)
    return copy
