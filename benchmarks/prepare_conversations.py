"""Conversations to rows: ``prepare_conversations`` against the bare chat-template loop.

Generated ShareGPT conversations (2 to 8 turns, a system turn in one of four, 5 to 80 words a turn) in a
JSON-lines file, a byte-level BPE tokenizer trained on them, and a Llama-3-style chat template, without
and with ``{% generation %}`` markers. The floor is ``apply_chat_template(messages, tokenize=True)`` in a
loop over the parsed conversations (no mask, nothing written); ours reads the file, renders, masks,
tokenizes and writes the ``save_to_disk`` folder, with ``--num-proc`` 1 and 2. Each measurement runs in a
fresh process with an empty ``datasets`` cache: ``python -m benchmarks.prepare_conversations``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import add_run_arguments, data_directory, report, result_of, results_directory
from benchmarks.prepare_throughput import WORDS

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MARKERS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def write_conversations(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            turns = [{"from": "system", "value": "be brief"}] if rng.random() < 0.25 else []
            for i in range(rng.randint(2, 8)):
                turns.append(
                    {"from": "gpt" if i % 2 else "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(5, 80)))}
                )
            f.write(json.dumps({"conversations": turns}) + "\n")


def make_tokenizers(corpus: Path, directory: Path) -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    texts = (turn["value"] for line in corpus.read_text().splitlines() for turn in json.loads(line)["conversations"])
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=MARKERS))
    paths = {}
    for name, template in (("plain", TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")),
                           ("marked", TEMPLATE)):  # fmt: skip
        fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=MARKERS[0], eos_token=MARKERS[3])
        fast.chat_template = template
        fast.save_pretrained(directory / name)
        paths[name] = str(directory / name)
    return paths


def child(args: argparse.Namespace) -> None:
    """One timed contender in this process; prints ``RESULT {"seconds", "tokens"}``."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer  # imported before the clock starts, for both contenders

    if args.child == "bare":
        from datamodules.chat.prepare_conversations import messages_of

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        conversations = [messages_of(json.loads(line)) for line in Path(args.corpus).read_text().splitlines()]
        started, tokens = time.perf_counter(), 0
        for messages in conversations:
            tokens += len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        seconds = time.perf_counter() - started
    else:
        from datamodules.chat.prepare_conversations import prepare_conversations

        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            # Ours loads the tokenizer itself, inside the timed call; the floor's load is untimed.
            counts = prepare_conversations(args.corpus, args.tokenizer, f"{out}/rows", num_proc=int(args.child))
            seconds, tokens = time.perf_counter() - started, counts["tokens"]
    print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


def measure(corpus: Path, tokenizer: str, contender: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["HF_DATASETS_CACHE"] = cache  # an empty cache: nothing reused from another run
        command = [sys.executable, "-m", "benchmarks.prepare_conversations", "--child", contender]
        result = result_of([*command, "--corpus", str(corpus), "--tokenizer", tokenizer], timeout=1800)
    if "error" in result:
        raise RuntimeError(f"{contender}: {result['error']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.conversations, args.rounds = 200, 1
    rows, checks = [], {}
    with data_directory(args.data_dir) as directory:
        corpus = directory / "conversations.jsonl"
        write_conversations(corpus, args.conversations)
        templates = make_tokenizers(corpus, directory)
        for template, tokenizer in list(templates.items())[: 1 if args.quick else 2]:
            runs: dict[str, list[float]] = {"bare": [], "1": [], "2": []}
            for _ in range(args.rounds):
                for contender, rates in runs.items():
                    result = measure(corpus, tokenizer, contender)
                    rates.append(result["tokens"] / result["seconds"])
            rate = {c: sorted(r)[len(r) // 2] for c, r in runs.items()}
            rows.append(
                {
                    "template": template,
                    "bare apply_chat_template k tokens/s": rate["bare"] / 1e3,
                    "ours num_proc=1 k tokens/s": rate["1"] / 1e3,
                    "ours num_proc=2 k tokens/s": rate["2"] / 1e3,
                    "ours 1 / bare": rate["1"] / rate["bare"],
                    "ours 2 / ours 1": rate["2"] / rate["1"],
                }
            )
            checks[f"{template}: num_proc=1 >= 0.8 of the bare loop ({rate['1'] / rate['bare']:.2f})"] = (
                rate["1"] >= 0.8 * rate["bare"]
            )
            checks[f"{template}: num_proc=2 >= 1.7x num_proc=1 ({rate['2'] / rate['1']:.2f}x)"] = (
                rate["2"] >= 1.7 * rate["1"]
            )
    report(
        "prepare_conversations",
        {f"{args.conversations:,} conversations, medians of {args.rounds} rounds": (list(rows[0]), rows)},
        config={"conversations": args.conversations, "rounds": args.rounds},
        checks=checks,
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
