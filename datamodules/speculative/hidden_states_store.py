"""Where a sample's verifier hidden states live: a small transfer interface, its checks, and the
default backend, the ``hidden_states/hs_{i}.safetensors`` files the ``speculators`` project writes.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save, save_file

from datamodules.plan.bad_samples import BadSample
from datamodules.storage.locations import is_url
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles

States = dict[str, torch.Tensor]  # ``hidden_states`` [T, L, H] and ``token_ids`` [T]
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class StoredBytes:
    """A ``[T, L, H]`` tensor of ``dtype`` at ``offset`` in the local file ``path``."""

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read_into(self, out: torch.Tensor) -> None:
        """The first ``len(out)`` positions, read into the contiguous ``out`` of ``dtype`` by the kernel
        (one copy from the page cache; no mapping of the file to set up, fault in and tear down)."""
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        done = 0
        with open(self.path, "rb", buffering=0) as f:
            while done < len(view):
                read = os.preadv(f.fileno(), [view[done:]], self.offset + done)
                if read == 0:
                    raise BadSample(f"{self.path} ends {len(view) - done} bytes early: it changed while read")
                done += read


class HiddenStatesStore(ABC):
    """Look up the cached states of a sample, fetch generated ones, cache them, delete them.

    A backend (shared memory, a key-value store) is one class registered in ``STORES``; a
    DataModule names it by key. Methods raise ``BadSample`` for a state that exists but cannot be
    read, and are called from DataLoader workers, so a backend must pickle (open connections lazily).
    """

    def describe(self, index: int) -> str:
        """Row ``index``'s states in words, for messages (a file's path, a key)."""
        return f"row {index}"

    def version(self, index: int) -> tuple[int, ...] | None:
        """A cheap token of row ``index``'s stored states that changes whenever they do (a file's size,
        modification time and inode), so a reader validates them once; ``None`` (default): unknown,
        validated at every read."""
        return None

    @abstractmethod
    def lookup(self, index: int) -> States | None:
        """The cached states of dataset row ``index``, or ``None`` when there are none."""

    def layers_and_width(self, index: int) -> tuple[int, int] | None:
        """``(L, H)`` of row ``index``'s cached states without reading them all; ``None`` when there
        are none. By default, through ``lookup``."""
        states = self.lookup(index)
        return None if states is None else tuple(states["hidden_states"].shape[1:])

    def cached_indices(self) -> list[int] | None:
        """The rows with cached states, from one listing; ``None`` when the store cannot list."""
        return None

    def stored_bytes(self, index: int) -> StoredBytes | None:
        """Where row ``index``'s ``hidden_states`` lie in a local file, for a reader that has validated
        them to read them again straight into a batch; ``None`` (default): read through ``lookup``."""
        return None

    @abstractmethod
    def fetch(self, location: str) -> States:
        """States a generator wrote at ``location`` (a vLLM server's ``hidden_states_path``)."""

    @abstractmethod
    def cache(self, index: int, states: States) -> None:
        """Keep ``states`` as row ``index``'s, so the next lookup finds them; atomic: a reader sees
        the whole state or none."""

    @abstractmethod
    def delete(self, location: str) -> None:
        """Remove what a generator wrote at ``location`` (``on_generate="delete"``)."""


class HiddenStateFiles(HiddenStatesStore):
    """``directory/hs_{index}.safetensors``, each holding ``hidden_states`` and ``token_ids``.

    ``directory`` may be a URL (``s3://bucket/run/hidden_states``): files are then read whole through
    ``files`` (retried, optionally kept in its node-local cache) and written with one PUT each.
    """

    def __init__(self, directory: str | Path, files: RemoteFiles = LOCAL_FILES) -> None:
        self.directory = str(directory).rstrip("/")
        self.files = files

    def path(self, index: int) -> str:
        return f"{self.directory}/hs_{index}.safetensors"

    def describe(self, index: int) -> str:
        return self.path(index)

    def version(self, index: int) -> tuple[int, ...] | None:
        path = self.path(index)
        if is_url(path):
            return None
        try:
            stat = os.stat(path)
        except OSError:
            return None
        return stat.st_size, stat.st_mtime_ns, stat.st_ino

    def lookup(self, index: int) -> States | None:
        path = self.path(index)
        if is_url(path):
            try:
                return self._parse(path, self.files.read_bytes(path))
            except FileNotFoundError:
                return None
        return self.fetch(path) if os.path.exists(path) else None

    def _header(self, path: str) -> tuple[int, dict]:
        """The safetensors header of ``path``: its length (8 bytes), then the JSON naming every tensor's
        dtype, shape and byte range."""
        size = int.from_bytes(self.files.read_range(path, 0, 8), "little")
        return size, json.loads(self.files.read_range(path, 8, 8 + size))

    def layers_and_width(self, index: int) -> tuple[int, int] | None:
        path = self.path(index)
        try:
            _, header = self._header(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as err:
            raise BadSample(f"cannot read hidden states {path}: {err}") from None
        shape = header.get("hidden_states", {}).get("shape")
        if not shape or len(shape) != 3:
            raise BadSample(f"{path} holds no hidden_states tensor [T, L, H] (its tensors: {sorted(header)})")
        return int(shape[1]), int(shape[2])

    def stored_bytes(self, index: int) -> StoredBytes | None:
        path = self.path(index)
        if is_url(path):
            return None
        try:
            size, header = self._header(path)
            entry = header["hidden_states"]
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            return StoredBytes(path, 8 + size + entry["data_offsets"][0], tuple(entry["shape"]), dtype)
        except (OSError, ValueError, KeyError):
            return None  # read through lookup

    def cached_indices(self) -> list[int]:
        names = [Path(str(name)).name for name in self.files.list_names(self.directory)]
        return sorted(int(m.group(1)) for name in names if (m := re.fullmatch(r"hs_(\d+)\.safetensors", name)))

    def fetch(self, location: str) -> States:
        if is_url(location):
            return self._parse(location, self.files.read_bytes(location))
        try:
            return load_file(location)  # memory-mapped
        except (SafetensorError, OSError, ValueError) as err:
            raise BadSample(f"cannot read hidden states {location}: {err}") from None

    @staticmethod
    def _parse(location: str, data: bytes) -> States:
        try:
            return load(data)
        except (SafetensorError, ValueError) as err:
            raise BadSample(f"cannot read hidden states {location}: {err}") from None

    def cache(self, index: int, states: States) -> None:
        path = self.path(index)
        if is_url(path):
            self.files.write_bytes(path, save({key: value.contiguous() for key, value in states.items()}))
        else:
            write_atomically(Path(path), states)

    def delete(self, location: str) -> None:
        if is_url(location):
            self.files.delete(location)
        else:
            Path(location).unlink(missing_ok=True)


def write_atomically(path: Path, states: States) -> None:
    """Write ``states`` to ``path`` through a partial file renamed when complete: a crash leaves no
    half-written ``hs_*.safetensors`` for a reader to take as valid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    save_file({key: value.contiguous() for key, value in states.items()}, str(partial))
    os.replace(partial, path)


STORES: dict[str, type[HiddenStatesStore]] = {"files": HiddenStateFiles}


def token_mismatch(tokens: torch.Tensor, input_ids: torch.Tensor) -> str:
    """How the states' ``token_ids`` differ from the row's ``input_ids``: the first position and both ids."""
    common = min(len(tokens), len(input_ids))
    differ = torch.nonzero(tokens[:common] != input_ids[:common])
    counts = f"its {len(tokens)} token_ids are not the row's {len(input_ids)} input_ids"
    if len(differ):
        at = int(differ[0])
        return f"{counts}: first differing at position {at}, {int(tokens[at])} vs {int(input_ids[at])}"
    return f"{counts}: the first {common} agree, then one of them ends"


def check_states(states: States, input_ids: torch.Tensor, layers: int | None, hidden_size: int | None) -> str | None:
    """Why ``states`` are not the hidden states of ``input_ids`` (``None`` when they are): the token
    ids differ, the shape is not ``[T, layers, hidden_size]``, or a value is not finite."""
    if "hidden_states" not in states or "token_ids" not in states:
        return f"holds {sorted(states)}, not 'hidden_states' and 'token_ids'"
    hidden, tokens = states["hidden_states"], states["token_ids"]
    if tokens.shape != input_ids.shape or not torch.equal(tokens.to(torch.int64), input_ids):
        return token_mismatch(tokens.flatten().to(torch.int64), input_ids.flatten())
    if hidden.ndim != 3:
        return f"hidden_states has shape {tuple(hidden.shape)}, expected [T, layers, hidden]"
    expected = (len(input_ids), layers or hidden.shape[1], hidden_size or hidden.shape[2])
    if tuple(hidden.shape) != expected:
        return f"hidden_states has shape {tuple(hidden.shape)}, expected [T, layers, hidden] = {list(expected)}"
    # The minimum and maximum are NaN when a value is, and one of them is infinite when a value is:
    # one pass without a temporary, four times faster than ``isfinite(...).all()`` on one CPU thread.
    if not all(torch.isfinite(bound) for bound in torch.aminmax(hidden)):
        return "hidden_states holds NaN or infinite values"
    return None
