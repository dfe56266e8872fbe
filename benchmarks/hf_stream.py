"""The streaming HuggingFace text source against the ``datasets`` stream it replaces, in one run.

A local parquet dataset of generated short documents (row groups of 10,000 rows). Throughput,
alternating rounds, medians: the floor, iterating ``load_dataset("parquet", streaming=True)``
and tokenizing every batch with the same tokenizer in this process (what any streaming loader must
do; the stream read alone, untokenized, is shown for scale); against ``HFTextDataModule(streaming=True)``'s
training loader with ``num_workers`` 0 and 2 (batch 8 x 2048, packed). Resume: the first batch of a
fresh DataModule (setup and first batch timed) against one resumed at document 10^6 of its stream
(``load_state_dict`` with that cursor, then the same), the same checkpoint resumed elastically (one
reader's state dealt to 2 workers, against a fresh start with 2 workers), and for scale what a
replaying resume pays (``datasets``' ``skip(10**6)`` and its next row): ``python -m benchmarks.hf_stream``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import add_run_arguments, data_directory, report, results_directory
from benchmarks.loader_throughput import throughput
from benchmarks.prepare_throughput import WORDS
from examples.default_corpus import train_tokenizer

ROW_GROUP = 10_000


def write_parquet(path: Path, num_documents: int) -> None:
    """Documents of 20 to 200 words from a 5,000-word vocabulary, written a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for lo in range(0, num_documents, ROW_GROUP):
            texts = [
                f"Document {i}. " + " ".join(rng.choices(WORDS, k=rng.randint(20, 200))) + "."
                for i in range(lo, min(lo + ROW_GROUP, num_documents))
            ]
            writer.write_table(pa.table({"text": texts}, schema=schema), row_group_size=ROW_GROUP)


def stream_floor(data: Path, tokenizer: Path, tokenize: bool, seconds: float) -> float:
    """Tokens/s (documents/s without ``tokenize``) of the ``datasets`` stream, read in this process."""
    import datasets
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(str(tokenizer)).backend_tokenizer
    stream = datasets.load_dataset("parquet", data_files=str(data), split="train", streaming=True)
    batches = stream.shuffle(seed=0, buffer_size=ROW_GROUP).iter(batch_size=256)
    next(batches)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        texts = next(batches)["text"]
        if tokenize:
            count += sum(len(e.ids) + 1 for e in backend.encode_batch_fast(texts, add_special_tokens=False))
        else:
            count += len(texts)
    return count / (time.perf_counter() - started)


def first_batch_seconds(make, state=None) -> float:
    started = time.perf_counter()
    dm = make()
    dm.setup("fit")
    if state is not None:
        dm.load_state_dict(state)
    next(iter(dm.train_dataloader()))
    return time.perf_counter() - started


def cursor_at(dm, document: int) -> dict:
    """The saved state of a one-reader stream whose next document is ``document`` of its pass."""
    import torch

    stream = dm.build_stream()
    units = stream.units_of(0, 1, 0).tolist()
    rows = [stop - first for _, first, stop in (stream.units.ranges[u] for u in units)]
    slot, before = 0, 0
    while before + rows[slot] <= document:
        before, slot = before + rows[slot], slot + 1
    block, row = divmod(document - before, stream.shuffle_rows)
    reader = {"pass": 0, "unit": slot, "block": block, "row": row, "tokens": torch.zeros(0, dtype=torch.int32)}
    reader["starts"] = torch.zeros(0, dtype=torch.bool)
    identity = stream.identity()
    return {"stream": {"stream": identity, "ranks": 1, "workers": 1, "batches": 0, "readers": {0: reader}}}


def replay_seconds(data: Path, documents: int) -> float:
    import datasets

    started = time.perf_counter()
    stream = datasets.load_dataset("parquet", data_files=str(data), split="train", streaming=True)
    next(iter(stream.skip(documents)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-documents", type=int, default=1_100_000)
    parser.add_argument("--resume-at", type=int, default=1_000_000, help="documents into the stream")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per throughput round")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_documents, args.resume_at, args.rounds, args.seconds, args.seq_len = 30_000, 20_000, 1, 0.5, 256
        import datasets

        # datasets sleeps 5 s after closing each parquet stream, for arrow's threads to finish
        # (apache/arrow#45214); a smoke run closes three (the floors and the replay), a second apart at least.
        datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0.5
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from datamodules import HFTextDataModule

    with data_directory(args.data_dir) as directory:
        data = directory / "docs.parquet"
        write_parquet(data, args.num_documents)
        sample = directory / "sample.txt"
        sample.write_text("\n".join(" ".join(random.Random(i).choices(WORDS, k=100)) for i in range(20_000)))
        tokenizer = train_tokenizer([sample], directory / "tokenizer", vocab_size=8192)

        def datamodule(workers: int = 0) -> HFTextDataModule:
            return HFTextDataModule(
                "parquet", str(tokenizer), args.seq_len, args.batch_size, data_files=str(data), streaming=True,
                pack_sequences=True, num_workers=workers,
            )  # fmt: skip

        loaders = {}
        for workers in (0, 2):
            dm = datamodule(workers)
            dm.setup("fit")
            loaders[f"HFTextDataModule(streaming=True), num_workers={workers}"] = iter(dm.train_dataloader())
        floor = "floor: datasets stream + tokenizer, in-process"
        speeds: dict[str, list[float]] = {floor: [], **{name: [] for name in loaders}}
        documents_per_s = []
        state = cursor_at(datamodule(), args.resume_at)
        fresh, resumed, replay, fresh_2, elastic = [], [], [], [], []
        tokens = args.batch_size * args.seq_len
        for _ in range(args.rounds):  # alternating, so drift hits all alike
            speeds[floor].append(stream_floor(data, tokenizer, True, args.seconds))
            documents_per_s.append(stream_floor(data, tokenizer, False, args.seconds / 2))
            for name, batches in loaders.items():
                speeds[name].append(throughput(batches, tokens, 4, args.seconds)["tokens/s"])
            fresh.append(first_batch_seconds(datamodule))
            resumed.append(first_batch_seconds(datamodule, state))
            replay.append(replay_seconds(data, args.resume_at))
            fresh_2.append(first_batch_seconds(lambda: datamodule(2)))
            elastic.append(first_batch_seconds(lambda: datamodule(2), state))
        base = statistics.median(speeds[floor])
        rows = [
            {"reader": "datasets stream read alone (no tokenizer)", "documents/s": statistics.median(documents_per_s)}
        ]
        rows += [
            {"reader": name, "M tokens/s": statistics.median(v) / 1e6, "of the floor": statistics.median(v) / base}
            for name, v in speeds.items()
        ]
        resume_rows = [
            {"start": "fresh DataModule: setup + first batch", "seconds": statistics.median(fresh)},
            {"start": f"resumed at document {args.resume_at:,}: same", "seconds": statistics.median(resumed)},
            {
                "start": f"replay: datasets stream skip({args.resume_at:,}) + next row",
                "seconds": statistics.median(replay),
            },
            {"start": "fresh DataModule, num_workers=2: setup + first batch", "seconds": statistics.median(fresh_2)},
            {
                "start": f"elastic: 1 reader's checkpoint at document {args.resume_at:,} dealt to num_workers=2",
                "seconds": statistics.median(elastic),
            },
        ]
    worker0 = speeds[list(loaders)[0]]
    ratio = statistics.median(resumed) / statistics.median(fresh)
    checks = {
        f"num_workers=0 >= 0.8 of the floor ({statistics.median(worker0) / base:.2f})": statistics.median(worker0)
        >= 0.8 * base,
        f"resume at document {args.resume_at:,} within 2x of a fresh start ({ratio:.2f}x)": ratio <= 2.0,
        f"elastic resume at document {args.resume_at:,}: first batch under 2 s ({statistics.median(elastic):.2f} s)": (
            statistics.median(elastic) < 2.0
        ),
    }
    report(
        "hf_stream",
        {
            f"throughput, batch {args.batch_size} x {args.seq_len}, medians of {args.rounds} rounds": (
                ["reader", "documents/s", "M tokens/s", "of the floor"],
                rows,
            ),
            f"first batch, medians of {args.rounds} rounds": (["start", "seconds"], resume_rows),
        },
        {"num_documents": args.num_documents, "seq_len": args.seq_len, "batch_size": args.batch_size},
        checks,
        results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
