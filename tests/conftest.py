"""Fixtures the test folders share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def endpoint() -> Iterator[str]:
    """A real S3 server (moto's ``ThreadedMotoServer``) on 127.0.0.1, one for the session; each test
    module keeps its data in a bucket of its own."""
    pytest.importorskip("moto.server")
    from benchmarks.object_store.server import s3_server

    with s3_server() as url:
        yield url
