"""A real S3 endpoint on 127.0.0.1 and a proxy in front of it.

``s3_server()`` starts moto's ``ThreadedMotoServer`` (a real HTTP server speaking the S3 API; the
clients, s3fs and boto3, run unchanged). ``S3Proxy`` forwards every request to it and can add a
fixed delay per request (a far-away bucket), count the ranged GETs and the body bytes it returned,
log each ranged GET, and spoil the next requests with the faults it is given.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

KEY = SECRET = "testing"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[str]:
    """A moto S3 server on a free port of 127.0.0.1; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def storage_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """s3fs options (the ``storage_options`` a DataModule takes) for the server at ``endpoint``."""
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}, **extra}


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION
    ).create_bucket(Bucket=bucket)


class _Server(http.server.ThreadingHTTPServer):
    # The standard library listens with a backlog of 5: a client opening 16 connections at once then
    # sees SYNs dropped and re-sent a second later. S3 accepts as many as a client opens.
    request_queue_size = 1024
    daemon_threads = True


class S3Proxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream``.

    ``delay``: seconds added before answering each request. ``faults``: spoil the next ranged GETs,
    one fault each, in order (``"503"``: S3's SlowDown; ``"reset"``: the connection closed without an
    answer; ``"truncated"``: half the body, then closed); ``other_faults``: the same for the next other
    requests (HEADs, listings, whole GETs, PUTs, DELETEs). ``ranged_gets``, ``bytes_sent`` (bodies of
    ranged GETs) and ``requests`` (object path and Range header of each ranged GET) count what passed;
    ``gets`` and ``get_bytes`` count every GET and its body, ranged or whole (a client that downloads
    whole objects sends no Range); ``puts`` lists the object path of every PUT, in order; ``methods``
    counts requests by method; ``paths`` lists ``(method, object path)`` of every request, and
    ``unconditional`` those sent without ``If-Match`` (every request but the reads checked against an
    ETag recorded before).
    """

    def __init__(self, upstream: str, delay: float = 0.0) -> None:
        self.delay = delay
        self.faults: list[str] = []
        self.other_faults: list[str] = []
        self.ranged_gets = 0
        self.bytes_sent = 0
        self.gets = 0
        self.get_bytes = 0
        self.requests: list[tuple[str, str]] = []
        self.puts: list[str] = []  # object path of every PUT, in order
        self.methods: Counter[str] = Counter()  # requests by method (HEAD, GET, ...)
        self.paths: list[tuple[str, str]] = []  # (method, object path) of every request, in order
        self.unconditional: list[tuple[str, str]] = []  # the same, of the requests without If-Match
        self.most_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler(urlparse(upstream)))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def reset_counts(self) -> None:
        with self._lock:
            self.ranged_gets = self.bytes_sent = self.gets = self.get_bytes = self.most_in_flight = 0
            self.requests.clear()
            self.paths.clear()
            self.unconditional.clear()
            self.puts.clear()
            self.methods.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self, target: Any) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self
        local = threading.local()  # one kept-alive upstream connection per proxy thread

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes: with Nagle's algorithm the body waits for the
            # client's delayed ACK of the headers, 40 ms on a kept-alive connection.
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                ranged = self.command == "GET" and "Range" in self.headers
                if ranged:
                    with proxy._lock:
                        proxy._in_flight += 1
                        proxy.most_in_flight = max(proxy.most_in_flight, proxy._in_flight)
                try:
                    self._answer(ranged)
                finally:
                    if ranged:
                        with proxy._lock:
                            proxy._in_flight -= 1

            def _answer(self, ranged: bool) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                fault = None
                with proxy._lock:
                    proxy.methods[self.command] += 1
                    proxy.paths.append((self.command, self.path.split("?")[0]))
                    if "If-Match" not in self.headers:
                        proxy.unconditional.append(proxy.paths[-1])
                    if self.command == "PUT":
                        proxy.puts.append(self.path.split("?")[0])
                    if ranged:
                        proxy.ranged_gets += 1
                        proxy.requests.append((self.path.split("?")[0], self.headers["Range"]))
                        fault = proxy.faults.pop(0) if proxy.faults else None
                    elif proxy.other_faults:
                        fault = proxy.other_faults.pop(0)
                if proxy.delay:
                    time.sleep(proxy.delay)
                if fault == "503":
                    message = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(message)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD's answer has no body
                        self.wfile.write(message)
                    return
                if fault == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, headers, data = self._upstream(body)
                self.send_response(status)
                for key, value in headers:
                    # A HEAD's Content-Length is the object's size: kept; a body's is set below.
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                    elif key.lower() == "content-length" and self.command == "HEAD":
                        self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "truncated":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)
                if self.command == "GET":
                    with proxy._lock:
                        proxy.gets += 1
                        proxy.get_bytes += len(data)
                        proxy.bytes_sent += len(data) if ranged else 0

            def _upstream(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                for attempt in range(2):  # a kept-alive connection the server closed: open a new one
                    connection = getattr(local, "connection", None)
                    if connection is None:
                        connection = local.connection = http.client.HTTPConnection(
                            target.hostname, target.port, timeout=60
                        )
                    try:
                        connection.request(self.command, self.path, body, dict(self.headers))
                        answer = connection.getresponse()
                        return answer.status, answer.getheaders(), answer.read()
                    except (http.client.HTTPException, OSError):
                        connection.close()
                        local.connection = None
                        if attempt:
                            raise
                raise AssertionError("unreachable")

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        return Handler


@contextmanager
def proxied_bucket(endpoint: str, bucket: str) -> Iterator[S3Proxy]:
    """``bucket`` made on the S3 server at ``endpoint``, and a request-counting proxy in front of the server."""
    create_bucket(endpoint, bucket)
    proxy = S3Proxy(endpoint)
    try:
        yield proxy
    finally:
        proxy.close()
