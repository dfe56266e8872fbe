"""The quickstart's speculative-decoding data: "conversations" cut from the default corpus, tokenized
with its tokenizer, and their hidden states from a tiny randomly initialised Llama verifier
(offline generation), in the layout the ``speculators`` project writes."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from datamodules.plan.hf_loading import is_saved_dataset
from datamodules.speculative.generate import generate_hidden_states

VERIFIER_WIDTH, VERIFIER_LAYERS = 32, 4


def write_conversations(texts: list[Path], tokenizer: Path, directory: Path, count: int, seed: int = 0) -> Path:
    """``count`` rows of 16-192 tokens cut from ``texts``: the first third a "prompt" (no loss), the
    rest the "answer" (``loss_mask`` 1); saved with ``save_to_disk``."""
    tokens = PreTrainedTokenizerFast.from_pretrained(str(tokenizer))(
        [p.read_text() for p in texts], add_special_tokens=False
    )["input_ids"]
    stream = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for _ in range(count):
        n = int(rng.integers(16, 193))
        start = int(rng.integers(0, len(stream) - n))
        rows["input_ids"].append(stream[start : start + n].tolist())
        rows["loss_mask"].append([0] * (n // 3) + [1] * (n - n // 3))
        rows["seq_len"].append(n)
    datasets.Dataset.from_dict(rows).save_to_disk(str(directory))
    return directory


def tiny_verifier(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=VERIFIER_WIDTH,
        intermediate_size=4 * VERIFIER_WIDTH,
        num_hidden_layers=VERIFIER_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def build_default_conversations(workdir: Path, texts: list[Path], tokenizer: Path, count: int = 1000) -> Path:
    """``workdir/conversations`` with ``hidden_states/`` (layers 1, 2, 4 of the 4-layer verifier, bf16);
    kept when already there (generation keeps valid files and writes only what is missing)."""
    directory = workdir / "conversations"
    if not is_saved_dataset(directory):
        write_conversations(texts, tokenizer, directory, count)
    vocab_size = len(PreTrainedTokenizerFast.from_pretrained(str(tokenizer)))
    generate_hidden_states(str(directory), tiny_verifier(vocab_size).to(torch.bfloat16), layers=[1, 2, 4])
    return directory
