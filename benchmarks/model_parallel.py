"""Model-parallel groups read once (``broadcast_within``): what a group's peer no longer reads, and what
receiving the batch costs it instead. ``python -m benchmarks.model_parallel [--quick]``.

Two gloo processes on CPU form one tensor-parallel group, each with the same DataModule set up for
data-parallel rank 0 (as the two ranks of a group are), for three sources:

- token shards: batches of 8 x 2048 tokens from 4 ``.npy`` shards;
- image-text: batches of 8 images resized to 384 px from 1080p JPEGs (``imagefolder``);
- hidden-state rows: packed rows of 2048 tokens with cached verifier states (3 layers x 1024, bf16).

For each: the leader reads ``--batches`` batches from its own loader (in-process, timed: what each
peer paid before, reading the batch itself) while counting the source's fetches in both processes
(the peer's: zero, it never iterates its loader); then the same batches, already read, go through
``BroadcastLoader`` from the leader to the peer, timed per batch on the peer (its wait for a batch,
the read aside): in step with the loop (as validation batches go), and as training batches go, sent
ahead on a thread while both ranks train a step (``--step-ms``, a sleep: the CPU is free, as it is
while a GPU computes), the peer's wait then being the time it is blocked asking for the next batch
(the first batch aside: nothing comes before it to overlap). The goal: the peer's wait in training
under 10% of reading the batch itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common import (
    add_run_arguments,
    data_directory,
    gloo_ranks,
    report,
    results_directory,
    write_token_shards,
)

SOURCES = ("token shards", "image-text", "hidden-state rows", "hidden states generated on demand")


def build(name: str, folder: Path, quick: bool, server: str) -> Any:
    """The DataModule of source ``name`` over the data written in ``folder`` (``write_data``); ``server``:
    the URL of the verifier that generates hidden states."""
    from datamodules import HiddenStatesDataModule, ImageTextDataModule, TokenShardDataModule

    if name == "token shards":
        return TokenShardDataModule(str(folder / "shards"), seq_len=2048, batch_size=8)
    if name == "image-text":
        return ImageTextDataModule(
            "imagefolder", max_text_len=32, batch_size=8, tokenizer=str(folder / "tokenizer"),
            image_size=64 if quick else 384, num_image_tokens=0, load_kwargs={"data_dir": str(folder / "photos")},
        )  # fmt: skip
    if name == "hidden-state rows":
        return HiddenStatesDataModule(str(folder / "conversations"), total_seq_len=2048)
    options = {"on_missing": "generate", "on_generate": "delete", "fetch_threads": 8}
    server_options = {"urls": [server], "model": "tiny", "timeout": 30}
    return HiddenStatesDataModule(str(folder / "generated"), total_seq_len=2048, server=server_options, **options)


def write_data(folder: Path, quick: bool) -> None:
    """Every source's data under ``folder``."""
    from benchmarks.hidden_states import VOCAB, cache_states, conversations
    from benchmarks.image_text import write_photos
    from examples.default_conversations import tiny_verifier
    from examples.default_images import train_caption_tokenizer

    write_token_shards(folder / "shards", 2_000_000 if quick else 8_000_000, 4)
    size = (320, 180) if quick else (1920, 1080)
    photos = write_photos(folder / "photos", 48 if quick else 400, 8 if quick else 40, size)
    captions = [json.loads(line)["text"] for line in (photos / "metadata.jsonl").read_text().splitlines()]
    train_caption_tokenizer(captions, folder / "tokenizer")
    tiny_verifier(VOCAB).save_pretrained(folder / "verifier")
    conversations(folder / "generated", 40 if quick else 100, mean=300, seed=2)
    cache_states(conversations(folder / "conversations", 40 if quick else 200, mean=300), 256 if quick else 1024)


def nbytes(batch: Any) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def counting(fetch: Any, count: list[int]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return fetch(*args, **kwargs)

    return counted


def _rank(
    rank: int, port: int, folder: str, server: str, batches: int, rounds: int, quick: bool, step_s: float, results: Any
) -> None:
    from datamodules.plan.model_parallel import BATCHES_AHEAD, BroadcastGroup, BroadcastLoader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]
    group = BroadcastGroup(groups[0], (0, 1), rank, ahead_group=groups[1])
    measured = {}
    for name in SOURCES:
        dm = build(name, Path(folder), quick, server)
        dm.setup("fit")
        fetches = [0]
        for method in ("fetch", "fetch_many"):  # a source reads its batches through these
            if hasattr(dm._train, method):
                setattr(dm._train, method, counting(getattr(dm._train, method), fetches))
        reads, waits, overlapped, sent = [], [], [], []
        for _ in range(rounds):
            read: list[Any] = []
            if rank == 0:  # the leader reads, as each rank did before
                loader = dm.train_dataloader()
                count = min(batches, len(loader))
                started = time.perf_counter()
                read = [batch for batch, _ in zip(loader, range(count), strict=False)]
                reads.append((time.perf_counter() - started) / count)
            dist.barrier()
            started = time.perf_counter()
            received = list(BroadcastLoader(read, group))  # the batches already read: the transfer alone
            waits.append((time.perf_counter() - started) / len(received))
            dist.barrier()
            overlapped.append(statistics.median(_blocked(BroadcastLoader(read, group, BATCHES_AHEAD), step_s)[1:]))
            if rank == 1:
                sent.append(nbytes(received[0]))
        all_fetches: list[Any] = [None, None]
        dist.all_gather_object(all_fetches, fetches[0])
        measured[name] = {"read_s": statistics.median(reads) if reads else None, "wait_s": statistics.median(waits)}
        measured[name]["overlapped_s"] = statistics.median(overlapped)
        measured[name].update(fetches=all_fetches, bytes=sent[0] if sent else None)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        results.put(gathered)
    dist.destroy_process_group()


def _blocked(loader: Any, step_s: float) -> list[float]:
    """The time blocked asking ``loader`` for each batch, training a step of ``step_s`` on each."""
    blocked, batches = [], iter(loader)
    while True:
        started = time.perf_counter()
        if next(batches, None) is None:
            return blocked
        blocked.append(time.perf_counter() - started)
        time.sleep(step_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=50.0, help="the training step the transfer overlaps")
    args = parser.parse_args()
    batches, rounds = (4, 1) if args.quick else (args.batches, args.rounds)
    from benchmarks.hidden_states import Server

    with data_directory(args.data_dir) as folder:
        write_data(folder, args.quick)
        with Server(folder / "verifier", folder / "served", "--delay", "0.05") as server:  # 50 ms a request
            leader, peer = gloo_ranks(_rank, (str(folder), server.url, batches, rounds, args.quick, args.step_ms / 1e3))
    rows, checks = [], {}
    for name in SOURCES:
        read, wait, overlapped = leader[name]["read_s"], peer[name]["wait_s"], peer[name]["overlapped_s"]
        fetches = leader[name]["fetches"]
        rows.append(
            {
                "source": name,
                "MB a batch": peer[name]["bytes"] / 1e6,
                "read a batch, ms (each rank before)": read * 1e3,
                "peer's wait a batch, ms, in step (validation)": wait * 1e3,
                f"peer's wait a batch, ms, sent ahead during a {args.step_ms:g} ms step (training)": overlapped * 1e3,
                "training wait / read": overlapped / read,
                "fetches: leader / peer": f"{fetches[0]} / {fetches[1]}",
            }
        )
        checks[f"{name}: the peer's wait in training under 10% of reading the batch ({overlapped / read:.1%})"] = (
            overlapped < 0.1 * read
        )
        checks[f"{name}: the peer fetched nothing (reads per group: 1x, not 2x)"] = fetches[1] == 0 and fetches[0] > 0
    columns = list(rows[0])
    config = {"processes": 2, "backend": "gloo", "batches": batches, "rounds": rounds, "step_ms": args.step_ms}
    tables = {"one tensor-parallel group of 2 ranks: the leader reads, the peer receives": (columns, rows)}
    report("model_parallel", tables, config, checks, results_directory(args.results_dir, args.quick))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
