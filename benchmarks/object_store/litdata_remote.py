"""litdata beside ours on the same server: ``StreamingDataset`` over litdata's own optimized copy of the corpus.

Each task runs in a fresh process, ``python -m benchmarks.object_store.litdata_remote '<json>'``, so
litdata's threads stay out of the benchmark process and its obstore runtime (not fork-safe) is never
inherited by a loader's workers. The process ends as soon as it has printed its result, its loader's
workers and download threads with it, so nothing it started fetches into the next measurement:

- ``convert``: ``litdata.optimize`` with ``TokensLoader``, as ``benchmarks/peer_loaders/peer_litdata.py``
  converts for the peers benchmark (uint16 tokens, ``(seq_len + 1) * 8012`` tokens a chunk, ~33 MB);
- ``run``: a fresh ``StreamingDataset(input_dir="s3://...", item_loader=TokensLoader(block_size=seq_len
  + 1), shuffle=True, drop_last=True, storage_options=...)`` in a ``StreamingDataLoader``, its cache an
  empty folder: seconds and bytes to the first batch, then tokens/s over a fixed number of batches;
- ``state``: the loader's own ``state_dict`` moved to step N (``peer_litdata``'s replay of litdata's
  counters); ``resume``: a fresh loader given it, the cache emptied: seconds and bytes to the first batch.

Pointing litdata at the server: ``storage_options`` go to its boto3 client (endpoint, keys, region); it
fetches chunks with obstore, built from that client's endpoint but with fixed client options that
refuse plain ``http://``. ``allow_http`` is added to those options here (the local server has no TLS);
nothing else of litdata is changed.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import multiprocessing
import os
import pickle
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import litdata.streaming.downloader
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader, optimize

from benchmarks.object_store.serve import read_counts
from benchmarks.object_store.server import KEY, REGION, SECRET
from benchmarks.peer_loaders.peer_litdata import BLOCKS_PER_CHUNK, _shard_pieces, _single_state_at
from benchmarks.peer_loaders.protocol import Setup


def convert(shards: list[str], out: str, seq_len: int) -> dict[str, Any]:
    chunk_size = (seq_len + 1) * BLOCKS_PER_CHUNK
    start = time.perf_counter()
    optimize(
        fn=functools.partial(_shard_pieces, piece=chunk_size),
        inputs=shards,
        output_dir=out,
        chunk_size=chunk_size,
        item_loader=TokensLoader(),
        num_workers=min(2, len(shards)),
        reorder_files=False,
        keep_data_ordered=True,
        mode="overwrite",
        verbose=False,
    )
    return {"convert s": time.perf_counter() - start, "chunk tokens": chunk_size}


def _loader(task: dict[str, Any], cache_dir: str) -> StreamingDataLoader:
    dataset = StreamingDataset(
        input_dir=task["url"],
        cache_dir=cache_dir,
        item_loader=TokensLoader(block_size=task["seq_len"] + 1),
        shuffle=True,
        drop_last=True,
        storage_options={
            "endpoint_url": task["proxy"],
            "aws_access_key_id": KEY,
            "aws_secret_access_key": SECRET,
            "region_name": REGION,
        },
    )
    return StreamingDataLoader(dataset, batch_size=task["batch_size"], num_workers=task["workers"])


def _fetched(task: dict[str, Any]) -> int:
    """Body bytes of every GET the proxy has answered so far (litdata downloads whole chunks, no Range)."""
    return read_counts(task["control"], task["delay_ms"])["get_bytes"]


def run(task: dict[str, Any]) -> dict[str, Any]:
    """From an empty cache: the first batch, ``warmup`` batches, then ``batches`` timed."""
    before, start = _fetched(task), time.perf_counter()
    batches: Iterator[Any] = iter(_loader(task, task["cache"]))
    next(batches)
    first = {"first batch s": time.perf_counter() - start, "first batch bytes": _fetched(task) - before}
    for _ in range(task["warmup"]):
        next(batches)
    span_before, start = _fetched(task), time.perf_counter()
    for _ in range(task["batches"]):
        next(batches)
    seconds = time.perf_counter() - start
    counts = read_counts(task["control"], task["delay_ms"])
    return {
        **first,
        "seconds": seconds,
        "fetched": counts["get_bytes"] - before,
        "span fetched": counts["get_bytes"] - span_before,
        "in flight": counts["most_in_flight"],
    }


def state(task: dict[str, Any]) -> dict[str, Any]:
    """The loader's own state after ``step`` batches: a real ``state_dict()`` after one batch, its
    counters moved on by ``peer_litdata``'s replay of litdata's bookkeeping (pickled, base64)."""
    setup = Setup(task["url"], "", seq_len=task["seq_len"], batch_size=task["batch_size"], workers=task["workers"])
    loader = _loader(task, task["cache"])
    next(iter(loader))
    found = copy.deepcopy(loader.state_dict())
    replays = _single_state_at(setup, task["step"], found, loader)
    return {"state": base64.b64encode(pickle.dumps(found)).decode(), "replays": replays}


def resume(task: dict[str, Any]) -> dict[str, Any]:
    """Construction to the first batch of a loader given ``state`` (its cache folder, which the state
    names, emptied by the caller)."""
    before, start = _fetched(task), time.perf_counter()
    loader = _loader(task, task["cache"])
    loader.load_state_dict(pickle.loads(base64.b64decode(task["state"])))
    next(iter(loader))
    return {"first batch s": time.perf_counter() - start, "first batch bytes": _fetched(task) - before}


TASKS = {"run": run, "state": state, "resume": resume}


def main() -> None:
    task = json.loads(sys.argv[1])
    # The one change to litdata: its obstore client may speak plain HTTP to the local server.
    litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    try:
        if task["task"] == "convert":
            result = convert(task["shards"], task["out"], task["seq_len"])
        else:
            result = TASKS[task["task"]](task)
        print("RESULT " + json.dumps(result), flush=True)
        code = 0
    except Exception:
        traceback.print_exc()
        code = 1
    for worker in multiprocessing.active_children():  # the loader's workers, mid-download
        worker.kill()
    sys.stderr.flush()
    os._exit(code)  # not waiting for litdata's download threads either


if __name__ == "__main__":
    main()
