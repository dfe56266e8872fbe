"""The client of vLLM OpenAI-compatible servers that generate verifier hidden states on demand.

Protocol (vLLM with a hidden-states KV connector): ``GET /v1/models`` lists the served model ids;
``POST /v1/completions`` with ``{"model", "prompt": [token ids], "max_tokens": 1, "return_token_ids":
true}`` answers with the prompt's token ids (``choices[0].prompt_token_ids``, or at the top level) and
``kv_transfer_params.hidden_states_path``: the safetensors file the server wrote.

Connections are kept alive, one per endpoint per thread (``http.client`` in a ``threading.local``),
and opened lazily, so a client pickles into DataLoader workers.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


class GenerationFailed(Exception):
    """A sample's states could not be generated: every attempt failed, or the server refused it."""


class InvalidResponse(Exception):
    """A response that arrived but does not hold what was asked (retried as a validation failure);
    ``location``: the states file it named, if any, for the caller to remove."""

    def __init__(self, message: str, location: str | None = None) -> None:
        super().__init__(message)
        self.location = location


@dataclass
class GenerationServer:
    """Where and how to generate missing hidden states (``HiddenStatesDataModule(server=...)``).

    Args:
        urls: one or more server base URLs (``http://host:8000``); a failed request moves on to the next.
        model: the served model id, checked against ``/v1/models`` at setup.
        timeout: seconds one request may take (connect and read).
        retries: further attempts after a transport error (refused, reset, timed out) or a 5xx, with
            exponential backoff and jitter, moving to the next URL each time; a 4xx is not retried.
        validation_retries: further generations of a sample whose states came back wrong (token ids
            that differ, a wrong shape, NaN or infinite values).
        backoff: the first retry waits ``backoff`` seconds (times a jitter in [0.5, 1]), each next one
            twice as long, at most ``max_backoff``.
        max_backoff: the longest wait between two retries, in seconds.
        max_failures: the circuit breaker: after this many conversations in a row (in plan order)
            could not be generated, training stops on every rank with one error.
    """

    urls: list[str] = field(default_factory=list)
    model: str = ""
    timeout: float = 60.0
    retries: int = 3
    validation_retries: int = 2
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_failures: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.urls, str):
            self.urls = [self.urls]
        if not self.urls:
            raise ValueError("GenerationServer needs at least one url, such as 'http://127.0.0.1:8000'")
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"GenerationServer url must be http(s)://host[:port], got {url!r}")
        if not self.model:
            raise ValueError("GenerationServer needs the served model id (model=...), as /v1/models lists it")
        for name in ("timeout", "backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or not value == value:
                raise ValueError(f"GenerationServer {name} must be a number >= 0, got {value!r}")
        for name, least in (("retries", 0), ("validation_retries", 0), ("max_failures", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"GenerationServer {name} must be an integer >= {least}, got {value!r}")


class GenerationClient:
    """Asks the servers of ``config`` for the hidden states of token sequences."""

    def __init__(self, config: GenerationServer) -> None:
        self.config = config
        self.endpoints = [url.rstrip("/") for url in config.urls]
        self._local = threading.local()
        self._threads = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "endpoints": self.endpoints}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])

    # Connections -------------------------------------------------------------------------------

    def _connection(self, endpoint: str) -> http.client.HTTPConnection:
        connections = self._local.__dict__.setdefault("connections", {})
        if endpoint not in connections:
            parts = urlsplit(endpoint)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            connections[endpoint] = kind(parts.hostname, parts.port, timeout=self.config.timeout)
        return connections[endpoint]

    def _drop(self, endpoint: str) -> None:
        connection = self._local.__dict__.get("connections", {}).pop(endpoint, None)
        if connection is not None:
            connection.close()

    def _request(self, endpoint: str, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        """``(status, parsed JSON)``; raises ``OSError``/``HTTPException`` for a transport failure."""
        connection = self._connection(endpoint)
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            connection.request(method, urlsplit(endpoint).path + path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            self._drop(endpoint)
            raise
        if response.will_close:
            self._drop(endpoint)
        try:
            return response.status, json.loads(data) if data else None
        except ValueError:
            return response.status, data[:200].decode(errors="replace")

    # The protocol ------------------------------------------------------------------------------

    def check_model(self) -> None:
        """Every reachable server must serve ``model``; at least one must be reachable."""
        reached = []
        for endpoint in self.endpoints:
            try:
                status, body = self._request(endpoint, "GET", "/v1/models")
            except (OSError, http.client.HTTPException) as err:
                log.warning("generation server %s is unreachable (%s); requests fail over to the others", endpoint, err)
                continue
            served = [m.get("id") for m in body.get("data", [])] if status == 200 and isinstance(body, dict) else None
            if served is None:
                raise ValueError(f"generation server {endpoint}/v1/models answered {status}: {str(body)[:200]}")
            if self.config.model not in served:
                raise ValueError(f"generation server {endpoint} serves {served}, not model {self.config.model!r}")
            reached.append(endpoint)
        if not reached:
            raise ValueError(f"no generation server reachable at {self.endpoints} (GET /v1/models failed on each)")

    def _first_endpoint(self) -> int:
        """The endpoint this thread starts at: threads spread over the servers, then stay where it worked."""
        if not hasattr(self._local, "preferred"):
            with self._lock:
                self._local.preferred = self._threads % len(self.endpoints)
                self._threads += 1
        return self._local.preferred

    def _wait(self, attempt: int) -> None:
        delay = min(self.config.max_backoff, self.config.backoff * 2**attempt)
        time.sleep(delay * random.uniform(0.5, 1.0))

    def complete(self, token_ids: list[int]) -> str:
        """The path of the hidden states the server wrote for ``token_ids``.

        Raises ``GenerationFailed`` when every attempt failed or a server refused the request (4xx),
        ``InvalidResponse`` when the answer arrived but is not about these tokens.
        """
        body = {"model": self.config.model, "prompt": token_ids, "max_tokens": 1, "return_token_ids": True}
        first, errors = self._first_endpoint(), []
        for attempt in range(self.config.retries + 1):
            endpoint = self.endpoints[(first + attempt) % len(self.endpoints)]
            try:
                status, answer = self._request(endpoint, "POST", "/v1/completions", body)
            except (OSError, http.client.HTTPException) as err:
                errors.append(f"{endpoint}: {type(err).__name__}: {err}")
            else:
                if status == 200:
                    self._local.preferred = self.endpoints.index(endpoint)
                    return self._hidden_states_path(answer, token_ids, endpoint)
                if status < 500:
                    raise GenerationFailed(f"{endpoint} refused the request ({status}: {str(answer)[:200]})")
                errors.append(f"{endpoint}: HTTP {status}")
            if attempt < self.config.retries:
                self._wait(attempt)
        raise GenerationFailed(f"{len(errors)} attempts failed, the last: {errors[-1]}")

    @staticmethod
    def _hidden_states_path(answer: Any, token_ids: list[int], endpoint: str) -> str:
        if not isinstance(answer, dict):
            raise InvalidResponse(f"{endpoint} answered {str(answer)[:200]!r}, not a JSON object")
        choices = answer.get("choices") or [{}]
        path = (answer.get("kv_transfer_params") or choices[0].get("kv_transfer_params") or {}).get(
            "hidden_states_path"
        )
        if not path:
            raise InvalidResponse(f"{endpoint} named no kv_transfer_params.hidden_states_path")
        prompt = choices[0].get("prompt_token_ids", answer.get("prompt_token_ids"))
        if prompt != token_ids:
            got = "none" if prompt is None else f"{len(prompt)} tokens that differ"
            raise InvalidResponse(
                f"{endpoint} returned prompt_token_ids ({got}) for a prompt of {len(token_ids)}", location=path
            )
        return path


class CircuitBreaker:
    """Counts conversations whose generation failed in a row, in plan order (it runs where batches
    are assembled into tensors, the main process); ``None`` as the limit: never trips."""

    def __init__(self, max_failures: int | None) -> None:
        self.max_failures = max_failures
        self.failures_in_a_row = 0

    def record(self, generated: list[bool], skipped: list[tuple[str, str]]) -> str | None:
        """Take in one batch's outcomes (``True``: states came); the stop message once the limit is reached."""
        if self.max_failures is None:
            return None
        tripped = False
        for ok in generated:
            self.failures_in_a_row = 0 if ok else self.failures_in_a_row + 1
            tripped |= self.failures_in_a_row >= self.max_failures
        if not tripped:
            return None
        last = skipped[-1][1] if skipped else "unknown"
        return (
            f"hidden-state generation failed for {self.failures_in_a_row} conversations in a row "
            f"(max_failures={self.max_failures}); the last: {last}"
        )
