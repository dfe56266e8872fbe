"""Video dataset layouts: how a manifest lists clips and captions, chosen by ``dataset_type``.

A layout is one registered class. It turns a manifest into a ``datasets.Dataset`` (memory-mapped
Arrow: a 10M-row WebVid manifest costs no RAM per worker) with the columns every video source reads:
``video`` (a path under ``data_root``), ``text``, and optionally ``prompt`` and ``duration``
(seconds, a fallback for clips whose container states none); or, for tar shards, ``WebDatasetRows``
whose ``video`` is the clip's bytes.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import pyarrow.compute as pc

from datamodules.plan.arguments import require_int
from datamodules.plan.hf_loading import load_split
from datamodules.plan.parallelism import Job
from datamodules.storage.locations import is_url, join_location, storage_path
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles
from datamodules.storage.sample_table import IndexedShards
from datamodules.vision.webdataset_rows import WebDatasetRows, indexed_shards

VIDEO_LAYOUTS: dict[str, type[VideoLayout]] = {}
_ISO_DURATION = re.compile(r"^P(?:T)?(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?$")


def duration_seconds(value: Any) -> float | None:
    """A manifest's duration: seconds as a number or string, or ISO 8601 (WebVid's ``PT00H00M11S``)."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    match = _ISO_DURATION.match(text)
    if match and any(match.groups()):
        hours, minutes, seconds = (float(g or 0) for g in match.groups())
        return hours * 3600 + minutes * 60 + seconds
    try:
        return float(text)
    except ValueError:
        return None


def check_inside_root(dataset: Any, manifest: str) -> None:
    """Every ``video`` path is relative and has no ``..`` part: a manifest cannot reach outside
    ``data_root`` (checked on the Arrow column at once, so a 10M-row manifest takes a moment)."""
    column = dataset.data.column("video")
    if column.null_count:
        row = pc.index(pc.is_null(column), True).as_py()
        raise ValueError(f"{manifest} row {row} has no video path")
    escapes = pc.or_(
        pc.match_substring_regex(column, r"^(/|\\|[A-Za-z]:)"),
        pc.match_substring_regex(column, r"(^|[/\\])\.\.([/\\]|$)"),
    )
    if pc.any(escapes).as_py():
        row = pc.index(escapes, True).as_py()
        raise ValueError(
            f"{manifest} row {row}: video path {column[row].as_py()!r} leaves data_root; paths must be relative "
            "to data_root, without '..'"
        )


class VideoLayout(ABC):
    """Reads a manifest into rows of ``video``, ``text`` (and ``prompt``, ``duration``).

    Args:
        data_root: the folder the clips' paths are relative to (manifests too, when relative).
        options: the layout's own settings (``layout_options`` in a config).
    """

    name: ClassVar[str]
    default_manifest: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        VIDEO_LAYOUTS[cls.name] = cls

    def __init__(self, data_root: str) -> None:
        self.data_root = data_root
        self.storage_options: dict[str, Any] | None = None  # for URLs; set by the source
        self.files: RemoteFiles = LOCAL_FILES  # the source's, with its file cache

    def manifest_files(self, manifest: str | list[str]) -> list[str]:
        """Each manifest file, relative to ``data_root`` unless absolute; an error if one is not a file."""
        files = []
        for name in [manifest] if isinstance(manifest, str) else manifest:
            path = join_location(self.data_root, name)
            options = self.storage_options if is_url(path) else None
            if not storage_path(path, options).is_file():
                raise ValueError(f"video manifest {name} ({self.name} layout) is not a file: {path} does not exist")
            files.append(path)
        return files

    def load_manifest(self, path: str, split: str, name: Any = None, data_files: Any = None, **kwargs: Any) -> Any:
        """``load_split`` with this layout's ``storage_options``."""
        return load_split(path, split, name, data_files, kwargs or None, storage_options=self.storage_options)

    @abstractmethod
    def rows(self, manifest: str | list[str], train_manifest: Any = None) -> Any:
        """The manifest's rows as a ``datasets.Dataset`` with the standard columns;
        ``train_manifest`` is given when ``manifest`` is the validation one."""

    def prepare(self, manifest: str | list[str], train_manifest: Any = None) -> None:
        """Once per node before ``load`` (``prepare_data``): reading the manifest builds datasets' Arrow
        cache, which every rank then maps."""
        self.load(manifest, train_manifest)

    def load(self, manifest: str | list[str], train_manifest: Any = None, job: Job | None = None) -> Any:
        """The manifest's rows, checked (``job``: the job's processes, for a layout that reads what
        describes its data once per job)."""
        dataset = self.rows(manifest, train_manifest)
        if len(dataset) == 0:
            raise ValueError(f"video manifest {manifest} ({self.name} layout) has no rows")
        check_inside_root(dataset, str(manifest))
        return dataset


def _require_columns(dataset: Any, columns: list[str], manifest: Any, layout: str) -> None:
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{manifest} ({layout} layout) has no column {missing[0]!r}; columns are {dataset.column_names}"
        )


class WebVidLayout(VideoLayout):
    """WebVid-style CSV partitions: ``videoid``, ``name`` (the caption), optional ``duration``
    (seconds or ISO 8601); clips at ``data_root/<first id_prefix_len characters of the id>/<id><extension>``.

    Args:
        id_prefix_len: characters of ``videoid`` naming its sub-folder (0: all clips in ``data_root``).
        extension: the clips' file extension.
    """

    name = "webvid"

    def __init__(self, data_root: str, id_prefix_len: int = 3, extension: str = ".mp4") -> None:
        super().__init__(data_root)
        self.id_prefix_len = require_int("id_prefix_len", id_prefix_len, 0)
        self.extension = extension

    def rows(self, manifest: str | list[str], train_manifest: Any = None) -> Any:
        files = self.manifest_files(manifest)
        dataset = self.load_manifest("csv", "train", None, files)
        _require_columns(dataset, ["videoid", "name"], manifest, self.name)
        n, ext = self.id_prefix_len, self.extension
        has_duration = "duration" in dataset.column_names

        def standard(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            ids = [str(v) for v in batch["videoid"]]
            out = {
                "video": [f"{v[:n]}/{v}{ext}" if n else f"{v}{ext}" for v in ids],
                "text": batch["name"],
            }
            if has_duration:
                out["duration"] = [duration_seconds(d) for d in batch["duration"]]
            return out

        return dataset.map(standard, batched=True, remove_columns=dataset.column_names, desc="WebVid manifest")


class FolderLayout(VideoLayout):
    """A folder of clips and a captions JSONL (default ``captions.jsonl`` in ``data_root``), one
    object per clip.

    Args:
        video_key: the key of the clip's path.
        text_key: the key of its caption or answer.
        prompt_key: the key of its prompt (optional).
        duration_key: the key of its duration (optional).
    """

    name = "folder"
    default_manifest = "captions.jsonl"

    def __init__(
        self,
        data_root: str,
        video_key: str = "video",
        text_key: str = "text",
        prompt_key: str | None = None,
        duration_key: str | None = None,
    ) -> None:
        super().__init__(data_root)
        self.keys = {"video": video_key, "text": text_key, "prompt": prompt_key, "duration": duration_key}

    def rows(self, manifest: str | list[str], train_manifest: Any = None) -> Any:
        files = self.manifest_files(manifest)
        dataset = self.load_manifest("json", "train", None, files)
        return standard_columns(dataset, self.keys, manifest, self.name)


def standard_columns(dataset: Any, keys: dict[str, str | None], manifest: Any, layout: str) -> Any:
    """``dataset`` with ``keys``' columns renamed to the standard ones, the rest dropped."""
    wanted = {ours: theirs for ours, theirs in keys.items() if theirs is not None}
    _require_columns(dataset, list(wanted.values()), manifest, layout)
    dataset = dataset.select_columns(list(wanted.values()))
    renames = {theirs: ours for ours, theirs in wanted.items() if theirs != ours}
    if renames:
        dataset = dataset.rename_columns(renames)
    if "duration" in wanted:
        dataset = dataset.map(
            lambda b: {"duration": [duration_seconds(d) for d in b["duration"]]}, batched=True, desc="durations"
        )
    return dataset


class HFLayout(VideoLayout):
    """A HuggingFace dataset (a ``save_to_disk`` folder or ``load_dataset``'s path) with a column of
    clip paths under ``data_root``; the manifest is the dataset, ``val_manifest`` a split of it.

    Args:
        split: the training split.
        video_field: the column of clip paths.
        text_field: the column of captions or answers.
        prompt_field: the column of prompts (optional).
        duration_field: the column of durations (optional).
        name: the dataset configuration.
        data_files: ``load_dataset``'s ``data_files``.
        load_kwargs: further ``load_dataset`` arguments.
    """

    name = "hf"

    def __init__(
        self,
        data_root: str,
        split: str = "train",
        video_field: str = "video",
        text_field: str = "text",
        prompt_field: str | None = None,
        duration_field: str | None = None,
        name: str | None = None,
        data_files: Any = None,
        load_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(data_root)
        self.split = split
        self.keys = {"video": video_field, "text": text_field, "prompt": prompt_field, "duration": duration_field}
        self.config_name, self.data_files, self.load_kwargs = name, data_files, dict(load_kwargs or {})

    def rows(self, manifest: str | list[str], train_manifest: Any = None) -> Any:
        # The training manifest names the dataset; a validation manifest names a split of it.
        path, split = (manifest, self.split) if train_manifest is None else (train_manifest, manifest)
        if train_manifest is not None and split == self.split:
            raise ValueError(
                f"held-out manifest {split!r} is the training split: it would evaluate on the training rows"
            )
        dataset = self.load_manifest(str(path), str(split), self.config_name, self.data_files, **self.load_kwargs)
        return standard_columns(dataset, self.keys, f"{path}:{split}", self.name)


class WebDatasetLayout(VideoLayout):
    """WebDataset tar shards (as video2dataset writes them): each sample a clip and its caption, read
    by member (``WebDatasetRows``). The manifest names the shards, relative to ``data_root`` unless
    absolute: a brace pattern (``{00000..00099}.tar``), a glob, or a list (default: every ``.tar``).

    Args:
        video_key: the clip's member, the first present of ``;``-separated choices.
        text_key: the caption's member, or ``"json:NAME"`` for a value in the sample's ``.json``.
        prompt_key: the prompt's, likewise (optional).
        index_cache_dir: where the shards' member indexes are kept (default
            ``~/.cache/datamodules/tar_index``).
        allow_compressed_tar: decompress a compressed shard there once instead of refusing it.
    """

    name = "webdataset"
    default_manifest = "*.tar"

    def __init__(
        self,
        data_root: str,
        video_key: str = "mp4;webm;mkv;avi;mov",
        text_key: str = "txt",
        prompt_key: str | None = None,
        index_cache_dir: str | None = None,
        allow_compressed_tar: bool = False,
    ) -> None:
        super().__init__(data_root)
        self.fields = {"video": video_key, "text": text_key, **({"prompt": prompt_key} if prompt_key else {})}
        self.index_cache_dir = index_cache_dir
        self.allow_compressed_tar = allow_compressed_tar

    def _shards(self, manifest: str | list[str], job: Job | None) -> IndexedShards:
        shards = [join_location(self.data_root, m) for m in ([manifest] if isinstance(manifest, str) else manifest)]
        return indexed_shards(shards, self.index_cache_dir, self.storage_options, self.allow_compressed_tar, job)

    def prepare(self, manifest: str | list[str], train_manifest: Any = None) -> None:
        pass  # the shards are indexed in ``load``, where the job's ranks share the work

    def rows(self, manifest: str | list[str], train_manifest: Any = None, job: Job | None = None) -> Any:
        return WebDatasetRows(self._shards(manifest, job), self.fields, ("video",), self.files)

    def load(self, manifest: str | list[str], train_manifest: Any = None, job: Job | None = None) -> Any:
        rows = self.rows(manifest, train_manifest, job)  # the members lie inside the shards: no path to check
        if len(rows) == 0:
            raise ValueError(f"the tar shards {manifest} hold no sample")
        return rows


def video_layout(dataset_type: str, data_root: str, options: dict[str, Any]) -> VideoLayout:
    """The registered layout ``dataset_type`` with its ``options``, or a clear error."""
    if dataset_type not in VIDEO_LAYOUTS:
        raise ValueError(f"dataset_type must be one of {sorted(VIDEO_LAYOUTS)}, got {dataset_type!r}")
    try:
        return VIDEO_LAYOUTS[dataset_type](data_root, **options)
    except TypeError as err:
        raise ValueError(
            f"dataset_type {dataset_type!r} does not take layout_options {sorted(options)}: {err}"
        ) from None
