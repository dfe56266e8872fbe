"""Where a source's files live: a local path, or a URL that fsspec reads (``s3://``, ``gs://``,
``hf://``, ``http(s)://``, ``file://``), with ``storage_options`` as ``datasets`` and pandas take them
(``{"endpoint_url": ..., "key": ..., "secret": ..., "anon": True}``).

A local path stays a ``pathlib.Path``: memory-mapped, as fast as before. A URL becomes a
``universal_pathlib`` path, so listing folders and reading small files (metadata, headers, indexes)
is the same code for both. The fsspec filesystem object is re-created in every process that uses it
(fsspec's async clients are not fork-safe).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec

LOCAL_PROTOCOLS = ("", "file", "local")


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a remote filesystem (``file://`` and plain paths are local); a
    ``UPath`` (not ``os.PathLike``) reads as its URL."""
    text = str(location)
    return "://" in text and urlparse(text).scheme not in LOCAL_PROTOCOLS


def storage_path(location: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Path:
    """``location`` as a path object: ``pathlib.Path`` for local paths (``file://`` stripped), a
    ``UPath`` over the URL's fsspec filesystem otherwise."""
    if not is_url(location):
        if storage_options:
            raise ValueError(f"storage_options are for URLs (s3://, gs://, ...); {str(location)!r} is a local path")
        text = os.fspath(location)
        return Path(text[len("file://") :] if text.startswith("file://") else text)
    from upath import UPath

    try:
        return UPath(str(location), **(storage_options or {}))
    except (ImportError, ValueError) as err:
        scheme = urlparse(str(location)).scheme
        raise ValueError(f"cannot read {location!r}: {err}. Is the fsspec package for {scheme}:// installed?") from None


def describe_error(err: BaseException) -> str:
    """A store's error in one line, with what to check where it is about credentials."""
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    if "credential" in text.lower() or isinstance(err, PermissionError):
        text += " (check the key and secret in storage_options, or the environment's credentials)"
    return text


def object_version(info: dict[str, Any]) -> tuple[int, str | None]:
    """``(size, version tag)`` of a remote object from its fsspec ``info``: the ETag (S3, HTTP), or
    the generation (GCS) or modification time where a store has no ETag."""
    tags = ("ETag", "etag", "generation", "LastModified", "last_modified", "mtime")
    tag = next((str(info[key]) for key in tags if info.get(key) is not None), None)
    return int(info["size"]), tag


def default_cache_dir(kind: str) -> str:
    """This node's cache folder for ``kind`` (what a source derives once and keeps, such as
    ``"token_shards"``): ``$XDG_CACHE_HOME/datamodules/<kind>`` (``~/.cache`` when unset)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "datamodules", kind)


def join_location(root: str, name: str) -> str:
    """``name`` under ``root`` (a folder path or URL); a ``name`` that is absolute or a URL stands alone."""
    if is_url(name) or os.path.isabs(name):
        return name
    return f"{root.rstrip('/')}/{name}" if is_url(root) else os.path.join(root, name)


_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}


def process_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> Any:
    """The fsspec filesystem of ``url``'s protocol with ``storage_options``, one per process: one made
    before a fork (as a ``UPath`` keeps its own) would hang or fail in the child."""
    protocol, options = urlparse(url).scheme, dict(storage_options or {})
    key = (os.getpid(), protocol, repr(sorted(options.items())))
    if key not in _FILESYSTEMS:
        _FILESYSTEMS[key] = fsspec.url_to_fs(f"{protocol}://", skip_instance_cache=True, **options)[0]
    return _FILESYSTEMS[key]


def open_remote(path: Path) -> Any:
    """A ``UPath``'s file opened for reading through this process's filesystem."""
    return process_filesystem(str(path), getattr(path, "storage_options", None)).open(str(path), "rb")
