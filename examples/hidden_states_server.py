"""A local server that speaks vLLM's hidden-states protocol, running a ``transformers`` model: what
``HiddenStatesDataModule(on_missing="generate")`` talks to, for tests, benchmarks and trying it out.

``GET /v1/models`` lists the model id; ``POST /v1/completions`` with ``{"model", "prompt": [token ids],
"max_tokens": 1, "return_token_ids": true}`` runs the model over the prompt, writes the chosen layers
as ``{output_dir}/{n}.safetensors`` (``hidden_states`` ``[T, L, H]``, ``token_ids`` ``[T]``) and answers
with ``choices[0].prompt_token_ids`` and ``kv_transfer_params.hidden_states_path``, as vLLM's
hidden-states connector does. ``delay`` adds latency to every request; ``faults`` injects failures.

``python -m examples.hidden_states_server --model PATH --layers 1,2,4 [--delay 0.05]`` serves until
interrupted and prints its URL first.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file

from datamodules.speculative.generate import verifier_states

# What ``faults(request_number, prompt)`` may answer: ``"error"`` (HTTP 500), ``"hang"`` (answers after
# ``hang_seconds``), ``"slow"`` (answers after ``slow_seconds``), ``"nan"`` (states hold a NaN),
# ``"mismatch"`` (other prompt_token_ids), ``"drop"`` (closes the connection without an answer), or None.
FAULTS = ("error", "hang", "slow", "nan", "mismatch", "drop")
Faults = Callable[[int, list[int]], str | None]


class HiddenStatesServer:
    """Serves ``model``'s hidden states at ``layers`` on ``127.0.0.1`` from a background thread.

    Args:
        model: a ``transformers`` causal LM.
        model_id: the id ``/v1/models`` lists and requests must name.
        layers: ``hidden_states`` indices written, the last being the one a draft model predicts.
        output_dir: where the states files go.
        delay: seconds added to every completion (network and queueing of a real server).
        faults: ``faults(n, prompt)`` for the ``n``-th completion request (from 0) names a fault or ``None``.
        slow_seconds, hang_seconds: how long ``"slow"`` and ``"hang"`` take.

    Example::

        with HiddenStatesServer(model, "tiny", [1, 2, 3], "states/") as server:
            dm = HiddenStatesDataModule(..., on_missing="generate", server={"urls": [server.url], "model": "tiny"})
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_id: str,
        layers: list[int],
        output_dir: str | Path,
        delay: float = 0.0,
        faults: Faults | None = None,
        slow_seconds: float = 0.5,
        hang_seconds: float = 5.0,
    ) -> None:
        self.model, self.model_id, self.layers = model.eval(), model_id, layers
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.delay, self.faults = delay, faults
        self.slow_seconds, self.hang_seconds = slow_seconds, hang_seconds
        self.prompts: list[list[int]] = []  # every completion request's prompt, in arrival order
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        self._model_lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> HiddenStatesServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()

    def _begin(self, prompt: list[int]) -> int:
        with self._lock:
            self.prompts.append(prompt)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            return len(self.prompts) - 1

    def _end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def complete(self, prompt: list[int], fault: str | None, number: int) -> dict:
        """The answer to a completion request (the states written first)."""
        with self._model_lock:  # one forward at a time, as one GPU would run them
            states = verifier_states(self.model, [torch.tensor(prompt, dtype=torch.long)], self.layers)[0]
        if fault == "nan":
            states["hidden_states"][0, 0, 0] = float("nan")
        path = self.output_dir / f"{number}.safetensors"
        save_file(states, str(path))
        returned = prompt[::-1] if fault == "mismatch" else prompt
        return {
            "id": f"cmpl-{number}",
            "object": "text_completion",
            "model": self.model_id,
            "choices": [{"index": 0, "text": "", "prompt_token_ids": returned, "finish_reason": "length"}],
            "kv_transfer_params": {"hidden_states_path": str(path)},
        }


def _handler(server: HiddenStatesServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client expects
        disable_nagle_algorithm = True  # headers and body go out at once, not 40 ms apart (delayed ACK)

        def log_message(self, format: str, *args: object) -> None:  # quiet: tests and benchmarks read counts
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._answer(200, {"object": "list", "data": [{"id": server.model_id, "object": "model"}]})
            else:
                self._answer(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/completions":
                return self._answer(404, {"error": f"no route {self.path}"})
            if request.get("model") != server.model_id:
                return self._answer(404, {"error": f"model {request.get('model')!r} is not served"})
            prompt = request.get("prompt")
            if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
                return self._answer(400, {"error": "prompt must be a list of token ids"})
            number = server._begin(prompt)
            try:
                fault = server.faults(number, prompt) if server.faults is not None else None
                time.sleep(server.delay)
                if fault == "slow":
                    time.sleep(server.slow_seconds)
                if fault == "hang":
                    time.sleep(server.hang_seconds)
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)  # no answer at all: the client sees the connection end
                    return
                if fault == "error":
                    return self._answer(500, {"error": "injected failure"})
                self._answer(200, server.complete(prompt, fault, number))
            finally:
                server._end()

    return Handler


def every_nth_slow(every: int) -> Faults:
    """Faults that make requests ``0, every, 2 * every, ...`` slow."""
    return lambda number, prompt: "slow" if number % every == 0 else None


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a transformers causal LM: local path or hub name")
    parser.add_argument("--model-id", help="the id /v1/models lists; default: --model")
    parser.add_argument("--layers", required=True, help="comma-separated hidden_states indices, the last predicted")
    parser.add_argument("--output-dir", default="served_hidden_states")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added to every request")
    parser.add_argument("--slow-every", type=int, help="make every n-th request slow (--slow-seconds more)")
    parser.add_argument("--slow-seconds", type=float, default=0.5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    layers = [int(x) for x in args.layers.split(",")]
    faults = every_nth_slow(args.slow_every) if args.slow_every else None
    server = HiddenStatesServer(
        model, args.model_id or args.model, layers, args.output_dir, args.delay, faults, args.slow_seconds
    )
    with server:
        print(server.url, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
