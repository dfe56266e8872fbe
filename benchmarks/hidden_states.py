"""Hidden-state loading for speculative decoding: generated on demand from a server, and cached.

1. Concurrent fetches: conversations/s out of ``HiddenStatesDataModule(on_missing="generate")`` with
   ``fetch_threads`` 1 and 8 (in-process), against a local server (``examples/hidden_states_server``,
   a tiny random Llama, in its own process) that adds 50 ms to every request.
2. ``in_order``: packed rows/s with 2 workers, ``in_order`` True against False, from a server that
   makes one request in five slow (+0.3 s).
3. Cached states: conversations/s and GB/s of safetensors read by the loader (``num_workers`` 0 and 2)
   against a bare loop over the same files (the floor): ``safetensors.torch.load_file``, then every
   tensor copied into a preallocated buffer (``load_file`` maps the file; the copy reads its bytes, as
   packing them into a row must). Side by side, speculators' own loader over the same folder
   (``benchmarks/peer_loaders/speculators_hidden_states.py``, its ``ArrowDataset`` and ``_setup_dataloader``, in a fresh
   process of ``benchmarks/.venvs/speculators``, which this script creates unless ``--quick`` or
   ``--no-venvs``: speculators pins ``datasets`` and ``transformers`` below ours).

4. Worker start: seconds to the first 5 batches with 2 workers started by ``fork`` and by ``spawn``
   (what ``worker_start_method=None`` chooses between).

Alternating contenders, medians over rounds: ``python -m benchmarks.hidden_states``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from safetensors.torch import load_file

from benchmarks.common import (
    add_run_arguments,
    data_directory,
    peer_venv,
    report,
    result_of,
    results_directory,
    warm_page_cache,
)
from datamodules import HiddenStatesDataModule
from datamodules.speculative.hidden_states_store import HiddenStateFiles
from examples.default_conversations import tiny_verifier

VOCAB = 1000
LAYERS = "1,2,4"


def conversations(directory: Path, count: int, mean: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean) - 0.18, 0.6, count), 8, 4 * mean).astype(int)
    ids = [[1, *rng.integers(2, VOCAB, n - 1).tolist()] for n in lengths]
    rows = {"input_ids": ids, "loss_mask": [[1] * n for n in lengths], "seq_len": lengths.tolist()}
    datasets.Dataset.from_dict(rows).save_to_disk(str(directory))
    return directory


def cache_states(data: Path, width: int) -> HiddenStateFiles:
    """Random bf16 states ``[T, 3, width]`` cached for every conversation of ``data``: its store."""
    store = HiddenStateFiles(data / "hidden_states")
    generator = torch.Generator().manual_seed(0)
    for row, ids in enumerate(datasets.load_from_disk(str(data))["input_ids"]):
        hidden = torch.randn(len(ids), 3, width, generator=generator).to(torch.bfloat16)
        store.cache(row, {"hidden_states": hidden, "token_ids": torch.tensor(ids)})
    return store


def documents(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["document_ids"].amax(dim=1) + 1).sum())


def rate(loader, seconds: float, count=documents) -> float:
    """Units per second out of ``loader`` after its first batch (start-up excluded), for ``seconds``."""
    batches = iter(loader)
    next(batches)
    units, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        try:
            units += count(next(batches))
        except StopIteration:
            batches = iter(loader)
    batches.close()  # its workers stop now: left to the collector, each waited out torch's 5 s join timeout
    return units / elapsed


class Server:
    """``examples.hidden_states_server`` in its own process (its model does not share our GIL)."""

    def __init__(self, model: Path, output: Path, *options: str) -> None:
        command = [sys.executable, "-m", "examples.hidden_states_server", "--model", str(model)]
        command += ["--model-id", "tiny", "--layers", LAYERS, "--output-dir", str(output), *options]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.url = self.process.stdout.readline().strip()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait()


def generating(data: Path, server: Server, **kw: object) -> HiddenStatesDataModule:
    dm = HiddenStatesDataModule(
        str(data),
        on_missing="generate",
        on_generate="delete",
        server={"urls": [server.url], "model": "tiny", "timeout": 30},
        **{"total_seq_len": 2048, **kw},
    )
    dm.setup("fit")
    return dm


def medians(contenders: dict[str, object], rounds: int, measure) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, subject in contenders.items():
            samples[name].append(measure(subject))
    return {name: statistics.median(values) for name, values in samples.items()}


def bare_loop(paths: list[Path], seconds: float) -> float:
    """Files/s of ``load_file`` over ``paths`` in order, each tensor copied out, repeated for ``seconds``."""
    buffer = torch.empty(1 << 28, dtype=torch.uint8)
    files, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for path in paths:
            for tensor in load_file(str(path)).values():
                raw = tensor.contiguous().view(torch.uint8).flatten()
                buffer[: raw.numel()].copy_(raw)
            files += 1
    return files / elapsed


# speculators 0.9.0 without torchaudio (a dependency its data path never imports; no torchaudio wheel
# on the index matches torch 2.14.1), so one install per line.
SPECULATORS_INSTALL = [
    ["torch==2.14.1", "torchvision==0.29.1"],
    ["--no-deps", "speculators==0.9.0", "hs-connectors==0.9.0"],
    ["aiohttp", "click", "datasets>=4,<=5.1.0", "httpx", "huggingface-hub", "loguru>=0.7.2,<=0.7.3", "numpy>=2,<=2.5.4"]
    + ["openai>=2", "protobuf", "psutil", "pydantic>=2", "pydantic-settings>=2", "rich", "safetensors"]
    + ["tqdm>=4.66.3,<=4.70.1", "transformers>=5,<=5.19.0", "typer>=0.12"],
]


def speculators_rate(python: str, data: Path, width: int, workers: int, seconds: float) -> float:
    """Conversations/s of speculators' own loader over ``data`` (a fresh process; start-up excluded)."""
    command = [
        python,
        "benchmarks/peer_loaders/speculators_hidden_states.py",
        "--data",
        str(data),
        "--total-seq-len",
        "2048",
    ]
    command += ["--hidden-size", str(width), "--num-workers", str(workers), "--seconds", str(seconds)]
    result = result_of(command, timeout=600)
    if "error" in result:
        raise RuntimeError(f"speculators' loader: {result['error']}")
    return result["rate"]


def first_batches(data: Path, method: str, count: int) -> float:
    """Seconds from ``iter(train_dataloader())`` to its ``count``-th batch, workers started by ``method``."""
    dm = HiddenStatesDataModule(str(data), total_seq_len=2048, num_workers=2, worker_start_method=method)
    dm.setup("fit")
    loader = dm.train_dataloader()
    started = time.perf_counter()
    batches = iter(loader)
    for _ in range(count):
        next(batches)
    elapsed = time.perf_counter() - started
    del batches
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-venvs", action="store_true", help="do not create speculators' venv if it is missing")
    args = parser.parse_args(argv)
    quick = args.quick
    seconds, rounds = (0.5, 1) if quick else (5.0, args.rounds)
    torch.set_num_threads(1)
    tables, checks = {}, {}
    with data_directory(args.data_dir) as root:
        model = root / "verifier"
        tiny_verifier(VOCAB).save_pretrained(model)
        # Cached states first: their workers fork from this process before the generation sections
        # start their fetch threads and server clients (a fork is safe only from a process without them).
        cached = conversations(root / "cached", 40 if quick else 200, mean=300, seed=1)
        width = 256 if quick else 1024
        store = cache_states(cached, width)
        paths = [store.path(row) for row in range(len(datasets.load_from_disk(str(cached))))]
        file_bytes = warm_page_cache(paths)
        loaders = {w: HiddenStatesDataModule(str(cached), total_seq_len=2048, num_workers=w) for w in (0, 2)}
        for dm in loaders.values():
            dm.setup("fit")
        per_file = file_bytes / len(paths) / 1e9
        contenders = {
            "bare loop: load_file + copy": lambda: bare_loop(paths, seconds),
            **{
                f"loader, num_workers={w}": (lambda dm=dm: rate(dm.train_dataloader(), seconds))
                for w, dm in loaders.items()
            },
        }
        speculators = peer_venv("speculators", SPECULATORS_INSTALL, create=not (quick or args.no_venvs))
        for w in (0, 2) if speculators else ():
            contenders[f"speculators 0.9.0 loader, num_workers={w}"] = lambda w=w: speculators_rate(
                speculators, cached, width, w, seconds
            )
        reads = medians(contenders, rounds, lambda measure: measure())
        floor = reads["bare loop: load_file + copy"]
        tables[f"Cached states: {len(paths)} files, {file_bytes / 1e6:,.0f} MB, bf16 [T, 3, {width}]"] = (
            ["reader", "conversations/s", "GB/s", "of the floor"],
            [
                {"reader": k, "conversations/s": r, "GB/s": r * per_file, "of the floor": r / floor}
                for k, r in reads.items()
            ],
        )
        starts = medians(
            {method: method for method in ("fork", "spawn")},
            rounds,
            lambda method: first_batches(cached, method, 5),
        )
        tables["Worker start: seconds from iter() to the 5th batch, 2 workers (cached states)"] = (
            ["worker_start_method", "seconds", "vs fork"],
            [{"worker_start_method": m, "seconds": t, "vs fork": t / starts["fork"]} for m, t in starts.items()],
        )
        for w in (0, 2):
            ours = reads[f"loader, num_workers={w}"] / floor
            checks[f"cached states, num_workers={w}: >= 0.7 of the floor ({ours:.2f})"] = ours >= 0.7
        checks[f"fork starts workers faster than spawn ({starts['spawn'] / starts['fork']:.1f}x)"] = (
            starts["fork"] < starts["spawn"]
        )
        data = conversations(root / "generated", 200 if quick else 2000, mean=300)

        delayed, slowed = ("--delay", "0.05"), ("--slow-every", "5", "--slow-seconds", "0.3")
        with contextlib.ExitStack() as servers:
            # A smoke run serves both sections from one server slowed both ways: each start imports transformers.
            shared = servers.enter_context(Server(model, root / "served", *delayed, *slowed)) if quick else None
            with contextlib.nullcontext(shared) if quick else Server(model, root / "served", *delayed) as server:
                threaded = {n: generating(data, server, fetch_threads=n) for n in (1, 8)}
                fetched = medians(threaded, rounds, lambda dm: rate(dm.train_dataloader(), seconds))
            speedup = fetched[8] / fetched[1]
            tables["Generated on demand, 50 ms per request, in-process"] = (
                ["fetch_threads", "conversations/s", "vs 1 thread"],
                [{"fetch_threads": n, "conversations/s": r, "vs 1 thread": r / fetched[1]} for n, r in fetched.items()],
            )
            checks[f"fetch_threads=8 >= 5x fetch_threads=1 ({speedup:.2f}x)"] = speedup >= 5

            with contextlib.nullcontext(shared) if quick else Server(model, root / "served", *slowed) as server:
                ordered = {
                    flag: generating(data, server, total_seq_len=512, num_workers=2, in_order=flag)
                    for flag in (True, False)
                }
                rows = medians(ordered, rounds, lambda dm: rate(dm.train_dataloader(), 2 * seconds, lambda b: 1))
        gain = rows[False] / rows[True]
        tables["One request in five slow (+0.3 s), 2 workers, rows of 512 tokens"] = (
            ["in_order", "rows/s", "vs in order"],
            [{"in_order": flag, "rows/s": r, "vs in order": r / rows[True]} for flag, r in rows.items()],
        )
        checks[f"in_order=False faster than in_order=True ({gain:.2f}x)"] = gain > 1

    # The tables in reading order: generation, then the cached states.
    tables = dict(sorted(tables.items(), key=lambda item: not item[0].startswith(("Generated", "One request"))))
    config = {"rounds": rounds, "seconds": seconds, "quick": quick, "torch_threads": 1}
    report("hidden_states", tables, config, checks, results_directory(args.results_dir, quick))


if __name__ == "__main__":
    main()
