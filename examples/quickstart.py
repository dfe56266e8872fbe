"""The main job on the embedded default corpus: ``python -m examples.quickstart``.

Builds the corpus, trains a tokenizer, writes token shards with the prepare command, then runs
LightningCLI ``fit`` from ``configs/token_shards.yaml`` (or ``--config``, e.g.
``configs/mixture_annealing.yaml``) and reports tokens/s and the loss curve.
"""

from __future__ import annotations

import argparse
import csv
import logging
import time
from pathlib import Path

from datamodules.cli import main as cli_main
from datamodules.text.prepare import prepare
from examples.default_chats import write_default_chats
from examples.default_conversations import build_default_conversations
from examples.default_corpus import stdlib_sources, train_tokenizer, write_pydoc_topics
from examples.default_images import build_default_images
from examples.default_videos import build_default_videos

log = logging.getLogger("quickstart")
WORKDIR = Path(".cache/quickstart")


def build_inputs(workdir: Path) -> None:
    """What the configs name: token shards ``shards_stdlib`` and ``shards_pydoc``, the pydoc topic
    files and their tokenizer, the ``shapes`` pictures with their caption tokenizer, and the
    ``moving_shapes`` clips with theirs, the ``conversations`` with their verifier hidden states, and the
    ``chats.jsonl`` chat conversations."""
    corpus = {"stdlib": stdlib_sources(), "pydoc": write_pydoc_topics(workdir / "pydoc_topics")}
    log.info("default corpus: %s documents", {name: len(files) for name, files in corpus.items()})
    tokenizer = train_tokenizer([f for files in corpus.values() for f in files], workdir / "tokenizer")
    for name, files in corpus.items():
        prepare([str(f) for f in files], workdir / f"shards_{name}", str(tokenizer))
    build_default_images(workdir)
    build_default_videos(workdir)
    build_default_conversations(workdir, corpus["pydoc"], tokenizer)
    write_default_chats(workdir / "chats.jsonl", corpus["pydoc"])


def loss_curve(log_dir: str) -> list[float]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def cli_arguments(argv: list[str] | None = None) -> list[str]:
    """LightningCLI's arguments: ``--config`` (default: the token-shard job) and any others as given."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/token_shards.yaml")
    parser.epilog = "Other arguments go to LightningCLI, e.g. --trainer.max_steps=50."
    args, overrides = parser.parse_known_args(argv)
    return ["--config", args.config, *overrides]


def main() -> None:
    arguments = cli_arguments()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build_inputs(WORKDIR)
    cli = cli_main(arguments, run=False)
    trainer, dm = cli.trainer, cli.datamodule
    started = time.perf_counter()
    trainer.fit(cli.model, datamodule=dm)
    seconds = time.perf_counter() - started
    samples = dm.positions_consumed
    tokens = samples * next((getattr(dm, a) for a in ("seq_len", "max_text_len", "total_seq_len") if hasattr(dm, a)), 0)
    losses = loss_curve(trainer.logger.log_dir)
    print(f"\ntrained {trainer.global_step} steps, {samples:,} samples ({tokens:,} tokens) in {seconds:.1f} s")
    print(f"throughput: {samples / seconds:,.1f} samples/s, {tokens / seconds:,.0f} tokens/s")
    if losses:
        print(f"train loss: start {losses[0]:.3f} -> end {losses[-1]:.3f}")
    print(f"checkpoint: {trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path}")


if __name__ == "__main__":
    main()
