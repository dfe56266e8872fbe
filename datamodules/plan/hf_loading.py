"""Loading HuggingFace datasets, tokenizers and processors for every source family, each failure a
user can cause (a path, a split, a hub name offline) told in one line instead of a traceback wall.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec

from datamodules.plan.arguments import quickstart_hint
from datamodules.storage.locations import describe_error, is_url, storage_path

SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def one_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), or its type's name."""
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def is_saved_dataset(path: str | Path, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` (a local folder or a URL) is a folder written by ``datasets``' ``save_to_disk``."""
    folder = storage_path(path, storage_options if is_url(path) else None)
    try:
        return any((folder / marker).exists() for marker in SAVED_DATASET_MARKERS)
    except OSError:  # a hub or URL that cannot be reached: load_dataset tells why
        return False
    except Exception as err:  # a store's own error (no credentials, ...): one line naming the URL
        raise OSError(f"cannot read {str(path)!r}: {describe_error(err)}") from None


def _is_builder(path: str) -> bool:
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return path in _PACKAGED_DATASETS_MODULES


def _saved_files(fs: Any, root: str) -> tuple[list[str], bytes]:
    """The files of a ``save_to_disk`` folder, relative to it (its JSON files and the Arrow files its
    ``state.json`` names, for a ``DatasetDict`` each split's; nothing else that sits beside them), and
    the contents of its ``state.json`` files, which say what version of the data it holds."""
    if fs.exists(f"{root}/dataset_dict.json"):
        names, states = ["dataset_dict.json"], b""
        for split in json.loads(fs.cat_file(f"{root}/dataset_dict.json"))["splits"]:
            split_names, split_state = _saved_files(fs, f"{root}/{split}")
            names += [f"{split}/{name}" for name in split_names]
            states += split_state
        return names, states
    state = fs.cat_file(f"{root}/state.json")
    data = [entry["filename"] for entry in json.loads(state)["_data_files"]]
    return ["state.json", "dataset_info.json", *data], state


def saved_dataset_copy(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """A node-local copy of the ``save_to_disk`` folder at ``url``: only the dataset's own files (a
    ``hidden_states/`` folder beside them is never downloaded), kept under the system's temporary
    folder, keyed by the URL and the dataset's state, and reused while they match."""
    fs, root = fsspec.url_to_fs(url, **copy.deepcopy(storage_options or {}))
    root = root.rstrip("/")
    names, states = _saved_files(fs, root)
    key = hashlib.blake2b(url.encode() + states, digest_size=12).hexdigest()
    target = Path(tempfile.gettempdir()) / "datamodules-saved-datasets" / key
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
        for name in names:
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{root}/{name}", str(partial / name))
        try:
            os.replace(partial, target)
        except OSError:  # another process of this node finished first: use its copy
            shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def _builder_meant(path: str) -> str | None:
    """The builder a one-word ``path`` that is none most likely means: the one reading files of that
    extension (``"jsonl"``: ``"json"``) or the nearest name (``"parquett"``); ``None`` if neither."""
    from datasets.packaged_modules import _EXTENSION_TO_MODULE, _PACKAGED_DATASETS_MODULES

    if "/" in path or is_url(path) or os.path.exists(path) or _is_builder(path):
        return None
    by_extension = _EXTENSION_TO_MODULE.get(f".{path.lstrip('.')}")
    close = difflib.get_close_matches(path, list(_PACKAGED_DATASETS_MODULES), n=1, cutoff=0.8)
    return by_extension[0] if by_extension else close[0] if close else None


def check_data_files(path: str, data_files: str | list[str] | dict[str, Any] | None) -> None:
    """For a builder (``"json"``, ``"parquet"``, ``"imagefolder"``, ...), every local ``data_files`` pattern
    must match a file: else an error naming the pattern, at construction (``load_dataset`` would say,
    at setup, only that the files are invalid). Patterns of a hub dataset are the hub's, not checked.
    A ``path`` with ``data_files`` that misspells a builder (``"jsonl"``) is refused naming the builder
    meant, instead of being looked up on the Hub (a long wait without network, then a hub error)."""
    if data_files is None:
        return
    meant = _builder_meant(str(path))
    if meant is not None:
        raise ValueError(f"path {path!r} is not a datasets builder; did you mean {meant!r}?")
    if not _is_builder(path):
        return
    values = data_files.values() if isinstance(data_files, dict) else [data_files]
    for value in values:
        for pattern in [value] if isinstance(value, str) else list(value or []):
            if not is_url(pattern) and not glob.glob(os.path.expanduser(str(pattern)), recursive=True):
                raise ValueError(f"data_files pattern {str(pattern)!r} matches no file{quickstart_hint(str(pattern))}")


def load_split(
    path: str,
    split: str | None,
    name: str | None = None,
    data_files: str | list[str] | dict[str, Any] | None = None,
    load_kwargs: dict[str, Any] | None = None,
    streaming: bool = False,
    error: type[Exception] = ValueError,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Split ``split`` of a ``save_to_disk`` folder (``load_from_disk``, memory-mapped; at a URL, its
    own files are copied to a node-local folder first, ``saved_dataset_copy``) or of anything
    ``datasets.load_dataset`` takes (a hub name, a builder such as ``"parquet"`` or ``"imagefolder"``
    with ``data_files``, local or URLs, a local data folder);
    ``streaming`` gives an ``IterableDataset``. ``storage_options``: for URLs, as ``datasets`` takes them.

    A folder holding one ``Dataset`` (not a ``DatasetDict``) has one split: the name it was saved
    with, else ``"train"``; any other split is refused, never answered with the same rows. ``split=None``
    takes such a folder whatever its name (and ``"train"`` of anything else)."""
    import datasets

    whole, split = split is None, split or "train"

    # A copy: datasets rewrites the dict it is given (per-protocol keys), which would spoil ours.
    remote = {"storage_options": copy.deepcopy(storage_options)} if storage_options else {}
    if is_saved_dataset(path, storage_options):
        try:
            local = saved_dataset_copy(str(path), storage_options) if is_url(path) else str(path)
            loaded = datasets.load_from_disk(local)
        except Exception as err:  # datasets' own failure, told in one line
            raise error(f"cannot load the saved dataset {path} ({type(err).__name__}: {one_line(err)})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise error(f"{path} has no split {split!r}; splits are {list(loaded)}")
            loaded = loaded[split]
        elif not whole and split != (own := str(loaded.split or "train")):
            raise error(
                f"{path} holds one Dataset (split {own!r}), not a DatasetDict of splits: split {split!r} is not "
                f"in it. Use {own!r}; validate with a val_fraction, or save a DatasetDict with both splits"
            )
        return loaded
    if is_url(path):  # load_dataset takes URLs in data_files only
        if not storage_path(path, storage_options).exists():
            raise error(f"{path!r} does not exist (or cannot be reached with the storage_options given)")
        raise error(
            f'{path!r} is not a save_to_disk folder; for files at URLs, give a builder ("parquet", '
            '"json", ...) as the path and the URLs as data_files'
        )
    try:
        with _without_download_count(path):
            return datasets.load_dataset(
                path, name, split=split, data_files=data_files, streaming=streaming, **remote, **(load_kwargs or {})
            )
    except Exception as err:  # the Hub's errors are many and long: one line is what a user needs
        where = "could not be loaded with datasets.load_dataset"
        if not (Path(path).exists() or _is_builder(path)):
            where = "is not a local path, and loading it from the HuggingFace Hub failed"
            if datasets.config.HF_HUB_OFFLINE:
                where = "is not a local path, and the HuggingFace Hub is offline here (HF_HUB_OFFLINE): no request made"
        raise error(f"{path!r} {where} ({type(err).__name__}: {one_line(err)})") from None


@contextlib.contextmanager
def _without_download_count(path: str) -> Iterator[None]:
    """For a builder (``"json"``, ``"parquet"``, ...) over the user's own files, ``datasets`` would
    still send a HEAD request to its download counter (``increase_load_count``); without network, as
    on many clusters, each ``load_dataset`` then waited 10-30 s for it. Not sent for those."""
    import datasets

    counting = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    if _is_builder(path):
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counting


@contextlib.contextmanager
def tokenizer_threads() -> Iterator[None]:
    """Fast tokenizers on every core in this block (a one-off pass over a dataset in the main process,
    before any DataLoader worker), back on one thread after it: a process forked later finds
    ``TOKENIZERS_PARALLELISM=false`` as ``load_pretrained`` set it, so the library neither warns nor
    risks its thread pool across the fork."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def load_pretrained(kind: str, name: str, error: type[Exception] = ValueError) -> Any:
    """A ``transformers`` tokenizer (``kind="tokenizer"``) or processor (``"processor"``) by hub name or
    local path, with tokenizers on one thread: the DataLoader's workers are the parallelism."""
    import os

    import transformers

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Only the class asked for: AutoProcessor's import pulls in the image processors (and torchvision), seconds.
    loader = getattr(transformers, {"tokenizer": "AutoTokenizer", "processor": "AutoProcessor"}[kind])
    try:
        return loader.from_pretrained(name)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise error(f"cannot load {kind} {name!r}: {one_line(err)}") from None
