"""The S3 server and its delay proxies in a process of their own, so their Python threads never take
the GIL from the loader being measured.

``python -m benchmarks.object_store.serve --delays-ms 0 50`` starts moto's server, one ``S3Proxy`` in
front of it per delay and a control endpoint (``GET /counts``: what each proxy has counted, by delay;
``POST /reset``), prints their URLs as one JSON line, and serves until its stdin closes.
``StoreProcess`` is the benchmark's side: it starts that process, reads and resets the counts.

moto answers a ranged GET by reading the whole object and slicing it (74 ms for a 128 MiB object on
the 2-core machine, whatever the range), which S3 does not; here a ranged GET reads its range alone.
"""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import re
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.object_store.server import S3Proxy, s3_server

ROOT = Path(__file__).resolve().parents[2]
_SIMPLE_RANGE = re.compile(r"bytes=(\d+)-(\d+)$")


class _ObjectBytes:
    """A moto object's bytes, read from its buffer only where sliced (moto's range handling slices)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, part: slice) -> bytes:
        with self.key.lock:
            self.key._value_buffer.seek(part.start)
            return self.key._value_buffer.read(part.stop - part.start)


def read_ranges_in_place() -> None:
    """Make moto serve ``Range: bytes=a-b`` GETs from that range of the object, not from a copy of all of it.

    Inside such a GET, ``FakeKey.value`` is an ``_ObjectBytes``; moto then takes ``len()`` and one
    slice of it. Other GETs (whole objects, suffix or multiple ranges, parts) are left as they are.
    """
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    whole, get_object = FakeKey.value, S3Response.get_object
    ranged = threading.local()

    def value(key: Any) -> Any:
        return _ObjectBytes(key) if getattr(ranged, "on", False) else whole.fget(key)

    def ranged_get_object(response: Any) -> Any:
        match = _SIMPLE_RANGE.match(response.headers.get("range") or "")
        ranged.on = bool(match) and int(match[1]) <= int(match[2]) and "partNumber" not in response.querystring
        try:
            return get_object(response)
        finally:
            ranged.on = False

    FakeKey.value = property(value, whole.fset)
    S3Response.get_object = ranged_get_object


def _control(proxies: dict[int, S3Proxy]) -> http.server.ThreadingHTTPServer:
    """``GET /counts``: ``{delay_ms: {gets, get_bytes, ranged_gets, bytes_sent, most_in_flight, methods}}``, what
    each proxy counted since it started or was last reset; ``POST /reset``: every proxy's counts to zero."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            fields = ("gets", "get_bytes", "ranged_gets", "bytes_sent", "most_in_flight")
            self._answer(
                {ms: {f: getattr(p, f) for f in fields} | {"methods": dict(p.methods)} for ms, p in proxies.items()}
            )

        def do_POST(self) -> None:
            for proxy in proxies.values():
                proxy.reset_counts()
            self._answer({})

        def _answer(self, found: dict) -> None:
            body = json.dumps(found).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--delays-ms", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every 404 a client's probe gets
    read_ranges_in_place()
    with s3_server() as endpoint:
        proxies = {ms: S3Proxy(endpoint, delay=ms / 1000) for ms in args.delays_ms}
        control = _control(proxies)
        urls = {ms: p.url for ms, p in proxies.items()}
        print(json.dumps({"endpoint": endpoint, "proxies": urls, "control": control.server_address[1]}), flush=True)
        sys.stdin.read()  # until the benchmark closes the pipe (or exits)
        control.shutdown()
        for proxy in proxies.values():
            proxy.close()


def read_counts(control: str, delay_ms: int) -> dict[str, int]:
    """What the proxy adding ``delay_ms`` has counted since the last reset (any process may ask)."""
    with urllib.request.urlopen(f"{control}/counts", timeout=10) as answer:
        return json.loads(answer.read())[str(delay_ms)]


def reset_counts(control: str) -> None:
    """Every proxy's counts to zero (``most_in_flight`` is a peak since the last reset)."""
    urllib.request.urlopen(urllib.request.Request(f"{control}/reset", method="POST"), timeout=10).close()


class StoreProcess:
    """``benchmarks.object_store.serve`` started in a subprocess: ``endpoint`` (the server itself, for
    uploads), ``proxies`` (delay in ms: URL), ``control`` (the URL ``read_counts`` asks), ``counts`` and
    ``reset_counts``."""

    def __init__(self, delays_ms: list[int]) -> None:
        command = [sys.executable, "-m", "benchmarks.object_store.serve", "--delays-ms", *map(str, delays_ms)]
        # Its stderr goes to a file: each connection a loader drops mid-answer (a worker stopped) is a
        # traceback there. Shown if the server does not start.
        self._log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self._log.seek(0)
            raise RuntimeError(f"the S3 server process exited with code {self.process.returncode}:\n{self._log.read()}")
        started = json.loads(line)
        self.endpoint: str = started["endpoint"]
        self.proxies = {int(ms): url for ms, url in started["proxies"].items()}
        self.control = f"http://127.0.0.1:{started['control']}"

    def counts(self, delay_ms: int) -> dict[str, int]:
        return read_counts(self.control, delay_ms)

    def reset_counts(self) -> None:
        reset_counts(self.control)

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stdin.close()
        try:
            # Its servers close by joining their request threads, which wait on the connections our
            # clients keep alive (a cached s3fs, a loader's workers): not worth waiting 10 s for.
            self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            self.process.wait()
        self._log.close()


if __name__ == "__main__":
    main()
