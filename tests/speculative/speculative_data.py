"""Speculative-decoding test data built in the test: tokenized conversations saved with
``save_to_disk`` and their hidden states from a tiny randomly initialised ``transformers`` model."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from datamodules.speculative.generate import generate_hidden_states

VOCAB, HIDDEN = 101, 16


def conversations(num_rows: int, min_len: int = 4, max_len: int = 40, seed: int = 0) -> datasets.Dataset:
    """Rows of ``input_ids`` (token 1 opens each, so no two rows are alike by chance), ``loss_mask``
    (0 on the first third, the prompt) and ``seq_len``."""
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for _ in range(num_rows):
        n = int(rng.integers(min_len, max_len + 1))
        rows["input_ids"].append([1, *rng.integers(2, VOCAB, n - 1).tolist()])
        rows["loss_mask"].append([0] * (n // 3) + [1] * (n - n // 3))
        rows["seq_len"].append(n)
    return datasets.Dataset.from_dict(rows)


def tiny_verifier(path: Path | None = None, layers: int = 3) -> LlamaForCausalLM:
    """A 3-layer Llama of width 16, random weights; saved to ``path`` when given (a local model name)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    if path is not None:
        model.save_pretrained(path)
    return model


def speculative_dataset(root: Path, num_rows: int, layers: list[int] | None = None, **kw: int) -> Path:
    """``root/data``: conversations and ``hidden_states/hs_{i}.safetensors`` for every row."""
    data_dir = root / "data"
    conversations(num_rows, **kw).save_to_disk(str(data_dir))
    generate_hidden_states(str(data_dir), tiny_verifier(), layers=layers or [1, 2, 3], batch_size=16)
    return data_dir
