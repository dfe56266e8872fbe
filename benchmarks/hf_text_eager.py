"""The eager HuggingFace text source: tokenizing in ``prepare_data``, its cache, and its loader.

On generated short documents in a JSONL file read through ``load_dataset("json")``, in one run:
the bare tokenizer's batched encode (documents parsed beforehand, encoding alone timed) against
``HFTextDataModule.prepare_data`` with ``num_proc`` 1 and 2 (each into an empty cache, after an
untimed warm-up that pays the first imports); a second
``prepare_data`` on the same inputs against the first; and the training loader of
``HFTextDataModule`` against ``TokenShardDataModule`` over the same cache folder (batch 8 x 2048,
alternating rounds, medians): ``python -m benchmarks.hf_text_eager``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.common import add_run_arguments, data_directory, report, results_directory
from benchmarks.loader_throughput import endless, throughput
from benchmarks.prepare_throughput import train_tokenizer, write_corpus


def bare_tokens_per_s(corpus: Path, tokenizer: Path) -> float:
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(str(tokenizer)).backend_tokenizer
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    started, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), 1024):
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(texts[i : i + 1024], add_special_tokens=False))
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-documents", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="alternating loader rounds")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per loader round")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_documents, args.rounds, args.seconds, args.seq_len = 3_000, 1, 0.5, 256
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from datamodules import HFTextDataModule, TokenShardDataModule, TokenShards

    with data_directory(args.data_dir) as directory:
        corpus = directory / "corpus.jsonl"
        write_corpus(corpus, args.num_documents)
        tokenizer = train_tokenizer(corpus, directory)
        bare = bare_tokens_per_s(corpus, tokenizer)

        def datamodule(num_proc: int, cache: str) -> HFTextDataModule:
            return HFTextDataModule(
                "json", str(tokenizer), args.seq_len, args.batch_size, data_files=str(corpus), cache_dir=cache,
                num_proc=num_proc,
            )  # fmt: skip

        # Untimed warm-up on a small file: first imports (transformers, datasets) and builder resolution.
        write_corpus(directory / "warmup.jsonl", 200)
        HFTextDataModule(
            "json", str(tokenizer), args.seq_len, args.batch_size, data_files=str(directory / "warmup.jsonl"),
            cache_dir=str(directory / "warmup"), num_proc=1,
        ).prepare_data()  # fmt: skip
        rows, prepared = [], {}
        for num_proc in (1, 2):
            cache = directory / f"cache{num_proc}"
            shutil.rmtree(cache, ignore_errors=True)
            dm = datamodule(num_proc, str(cache))
            started = time.perf_counter()
            dm.prepare_data()
            seconds = time.perf_counter() - started
            tokens = TokenShards(dm.source.cache_path("train")).num_tokens - args.num_documents
            prepared[num_proc] = {"seconds": seconds, "tokens/s": tokens / seconds, "dm": dm}
            rows.append(
                {"step": f"prepare_data, num_proc={num_proc}", "seconds": seconds, "tokens/s": tokens / seconds}
            )
        started = time.perf_counter()
        datamodule(1, str(directory / "cache1")).prepare_data()
        cached = time.perf_counter() - started
        rows.append({"step": "prepare_data again, same inputs (cache hit)", "seconds": cached})
        rows.insert(0, {"step": "bare tokenizer, batched encode", "tokens/s": bare})

        hf = prepared[1]["dm"]
        hf.setup("fit")
        shards = TokenShardDataModule(hf.source.cache_path("train"), seq_len=args.seq_len, batch_size=args.batch_size)
        shards.setup("fit")
        loaders = {
            "HFTextDataModule": endless(hf.train_dataloader),
            "TokenShardDataModule": endless(shards.train_dataloader),
        }
        speeds: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(args.rounds):  # alternating, so drift hits both alike
            for name, batches in loaders.items():
                speeds[name].append(throughput(batches, args.batch_size * args.seq_len, 20, args.seconds)["tokens/s"])
        loader_rows = [{"loader": name, "M tokens/s": statistics.median(v) / 1e6} for name, v in speeds.items()]

    one, two = prepared[1]["tokens/s"], prepared[2]["tokens/s"]
    ratio = statistics.median(speeds["HFTextDataModule"]) / statistics.median(speeds["TokenShardDataModule"])
    checks = {
        f"prepare_data num_proc=1 >= 0.8 of the bare tokenizer ({one / bare:.2f})": one / bare >= 0.8,
        f"prepare_data num_proc=2 >= 1.7x num_proc=1 ({two / one:.2f}x)": two / one >= 1.7,
        f"a cached prepare_data < 10% of the first ({cached:.3f} s vs {prepared[1]['seconds']:.1f} s)": cached
        < 0.1 * prepared[1]["seconds"],
        f"loader throughput equals the token-shard loader's on the same cache ({ratio:.2f})": 0.9 <= ratio <= 1.1,
    }
    report(
        "hf_text_eager",
        {
            "tokenizing in prepare_data": (["step", "seconds", "tokens/s"], rows),
            f"training loader, batch {args.batch_size} x {args.seq_len}, medians of {args.rounds} rounds": (
                ["loader", "M tokens/s"],
                loader_rows,
            ),
        },
        {"num_documents": args.num_documents, "seq_len": args.seq_len, "batch_size": args.batch_size},
        checks,
        results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
