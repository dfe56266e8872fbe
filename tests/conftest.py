"""Fixtures the test folders share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def endpoint() -> Iterator[str]:
    """A real S3 server (moto's ``ThreadedMotoServer``) on 127.0.0.1, one for the session; each test
    module keeps its data in a bucket of its own."""
    pytest.importorskip("moto.server")
    from benchmarks.object_store.server import s3_server

    with s3_server() as url:
        yield url


@pytest.fixture(scope="session", autouse=True)
def node_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The node caches our sources keep (token shard layouts, tar indexes) in a folder of the session,
    not the user's ``~/.cache``; subprocesses inherit it. HuggingFace's cache stays where it was."""
    saved = {name: os.environ.get(name) for name in ("XDG_CACHE_HOME", "HF_HOME")}
    os.environ.setdefault(
        "HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    )
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("node-cache"))
    yield Path(os.environ["XDG_CACHE_HOME"])
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
