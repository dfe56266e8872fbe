"""The prepare command against the bare tokenizer on the same documents, in one run.

200k generated documents in one JSONL file; alternating rounds of: the tokenizer's own batched
encode (``encode_batch_fast``, one thread, documents parsed beforehand, only encoding timed), the
same in two processes at once on half the documents each (what this machine's cores give),
``prepare`` with ``--num-proc 1``
and ``--num-proc 2`` (the whole call timed: reading, tokenizing, writing, hashing; the ~2 s import of
``transformers`` is not, as for the bare encode); medians. Each contender runs in its own process,
whose peak memory (PSS, with its workers) is sampled every 0.5 s; a quarter-size corpus shows whether memory grows
with the corpus. Then an unchanged re-run of the command, timed end to end, interpreter start-up
included: ``python -m benchmarks.prepare_throughput``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from benchmarks.common import add_run_arguments, data_directory, report, results_directory

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.Random(-i).randint(2, 9)))
    for i in range(5000)
]


def write_corpus(path: Path, num_documents: int, seed: int = 0) -> None:
    """Short documents of 20 to 200 words drawn from a 5,000-word vocabulary, one JSON line each."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_documents):
            words = rng.choices(WORDS, k=rng.randint(20, 200))
            f.write(json.dumps({"text": f"Document {i}. " + " ".join(words) + "."}) + "\n")


def train_tokenizer(corpus: Path, directory: Path) -> Path:
    from examples.default_corpus import train_tokenizer as train

    sample = directory / "sample.txt"
    with open(corpus) as f:
        sample.write_text("".join(json.loads(line)["text"] + "\n" for _, line in zip(range(20_000), f, strict=False)))
    return train([sample], directory / "tokenizer", vocab_size=8192)


def child(args: argparse.Namespace) -> None:
    """One timed contender, in this process; prints ``{"seconds", "tokens"}``."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if args.child.startswith("bare"):
        from transformers import AutoTokenizer

        # The documents are parsed first, untimed: this times the tokenizer alone.
        index, count = map(int, args.child.split(":")[1:]) if ":" in args.child else (0, 1)
        backend = AutoTokenizer.from_pretrained(args.tokenizer).backend_tokenizer
        # Read whole, then split: of the ways tried, the one after which the encoder ran fastest.
        lines = Path(args.corpus).read_text().splitlines()
        texts = [json.loads(line)["text"] for line in lines[index::count]]
        del lines
        batches = [texts[i : i + 1024] for i in range(0, len(texts), 1024)]
        started = time.perf_counter()
        tokens = 0
        for batch in batches:
            tokens += sum(len(e.ids) for e in backend.encode_batch_fast(batch, add_special_tokens=False))
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "tokens": tokens}))
        return
    from transformers import AutoTokenizer  # noqa: F401  (imported untimed, as for the bare encode: ~2 s of torch)

    from datamodules.text.prepare import prepare

    started = time.perf_counter()
    meta = prepare([args.corpus], args.output, args.tokenizer, num_proc=int(args.child), overwrite=True)
    # The separator adds one token per document that the bare encode does not produce.
    print(json.dumps({"seconds": time.perf_counter() - started, "tokens": meta.num_tokens - meta.num_documents}))


def run_child(kind: str, corpus: Path, tokenizer: Path, output: Path, env: dict[str, str]) -> dict[str, float]:
    """Run one contender in a fresh process, into an empty ``output``; its result plus its peak memory."""
    if kind == "bare x2":  # the machine's own parallel speed-up: two bare encodes at once, half each
        with ThreadPoolExecutor(2) as pool:
            halves = list(pool.map(lambda i: run_child(f"bare:{i}:2", corpus, tokenizer, output, env), range(2)))
        seconds = max(h["seconds"] for h in halves)
        tokens = sum(h["tokens"] for h in halves)
        peak = sum(h["peak_pss_mb"] for h in halves)
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "peak_pss_mb": peak}
    shutil.rmtree(output, ignore_errors=True)
    cmd = [sys.executable, "-m", "benchmarks.prepare_throughput", "--child", kind, "--corpus", str(corpus)]
    cmd += ["--tokenizer", str(tokenizer), "--output", str(output)]
    process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = [0]

    def sample() -> None:
        parent = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                tree = [parent, *parent.children(recursive=True)]
                # PSS: pages a forked worker shares with its parent count once, split between them.
                peak[0] = max(peak[0], sum(p.memory_full_info().pss for p in tree))
            except psutil.Error:
                pass
            # Reading PSS walks every page table of the tree: often enough to see the peak of a
            # steady pipeline, rarely enough not to slow the contenders (at 50 ms it cost the
            # three-process run ~10% of its speed).
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    sampler.join()
    if process.returncode:
        raise RuntimeError(f"{kind} failed with exit code {process.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "tokens_per_s": result["tokens"] / result["seconds"], "peak_pss_mb": peak[0] / 2**20}


def rerun_seconds(corpus: Path, tokenizer: Path, output: Path, env: dict[str, str], repeats: int = 5) -> float:
    """Median wall time of the unchanged re-run command, interpreter start-up included."""
    cmd = [sys.executable, "-m", "datamodules.text.prepare", str(corpus), "--output", str(output)]
    cmd += ["--tokenizer", str(tokenizer), "--num-proc", "1"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)  # the first, real run
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-documents", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.num_documents, args.rounds = 4_000, 1

    with data_directory(args.data_dir) as directory, tempfile.TemporaryDirectory() as hf_home:
        corpus, quarter = directory / "corpus.jsonl", directory / "quarter.jsonl"
        write_corpus(corpus, args.num_documents)
        write_corpus(quarter, args.num_documents // 4)
        tokenizer = train_tokenizer(corpus, directory)
        env = {**os.environ, "HF_HOME": hf_home, "PYTHONPATH": str(REPO)}
        contenders = {
            "bare tokenizer, batched encode": "bare",
            "bare tokenizer, 2 processes at once (half each)": "bare x2",
            "prepare --num-proc 1": "1",
            "prepare --num-proc 2": "2",
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
        for _ in range(args.rounds):  # alternating, so drift on the machine hits all alike
            for name, kind in contenders.items():
                runs[name].append(run_child(kind, corpus, tokenizer, directory / f"out-{kind}", env))
        quarter_run = run_child("1", quarter, tokenizer, directory / "out-quarter", env)
        rerun = rerun_seconds(corpus, tokenizer, directory / "out-rerun", env, repeats=2 if args.quick else 5)
        leftover = sum(p.stat().st_size for p in Path(hf_home).rglob("*") if p.is_file())

    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    bare, bare2, one, two = (med[name]["tokens_per_s"] for name in contenders)
    rows = [
        {
            "contender": name,
            "tokens": int(m["tokens"]),
            "seconds": m["seconds"],
            "tokens/s": m["tokens_per_s"],
            "of bare, per process": m["tokens_per_s"] / bare / (2 if "2" in kind else 1),
            "peak PSS MB": m["peak_pss_mb"],
        }
        for (name, kind), m in zip(contenders.items(), med.values(), strict=True)
    ]
    rows.append(
        {
            "contender": f"prepare --num-proc 1, quarter corpus ({args.num_documents // 4:,} docs)",
            "tokens": int(quarter_run["tokens"]),
            "seconds": quarter_run["seconds"],
            "tokens/s": quarter_run["tokens_per_s"],
            "peak PSS MB": quarter_run["peak_pss_mb"],
        }
    )
    full_pss = med["prepare --num-proc 1"]["peak_pss_mb"]
    checks = {
        f"prepare --num-proc 1 >= 0.8 of the bare tokenizer ({one / bare:.2f})": one / bare >= 0.8,
        f"prepare --num-proc 2 >= 1.7x --num-proc 1 ({two / one:.2f}x; two bare encodes at once: "
        f"{bare2 / bare:.2f}x one)": two / one >= 1.7,
        f"unchanged re-run < 1 s ({rerun:.2f} s, interpreter start-up included)": rerun < 1.0,
        f"peak memory (PSS) of the full corpus within 1.2x the quarter corpus's ({full_pss:.0f} vs "
        f"{quarter_run['peak_pss_mb']:.0f} MB)": full_pss <= 1.2 * quarter_run["peak_pss_mb"],
        f"no cache left behind in HF_HOME ({leftover} bytes)": leftover == 0,
    }
    columns = ["contender", "tokens", "seconds", "tokens/s", "of bare, per process", "peak PSS MB"]
    report(
        "prepare_throughput",
        {f"medians of {args.rounds} alternating rounds": (columns, rows)},
        {"num_documents": args.num_documents, "rounds": args.rounds, "vocab_size": 8192},
        checks,
        results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
