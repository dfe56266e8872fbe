"""HFTextDataModule under real multi-process runs on CPU (gloo): DDP coverage, tokenizing once per node.

Runs go through ``tests/scripts/train_record.py`` (Lightning's ``ddp`` re-launches ``sys.argv``).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import HFTextSource
from examples.default_corpus import train_tokenizer
from tests.distributed_support import Run, train_record
from tests.support import row_digest

# Random words, so that windows rarely repeat; coverage is checked as a multiset of window digests.
_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
DOCS = [" ".join(random.Random(i).choices(_WORDS, k=20 + i % 30)) for i in range(60)]
SEQ_LEN, BATCH = 8, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("hf")
    (root / "corpus.txt").write_text("\n".join(DOCS))
    tokenizer = str(train_tokenizer([root / "corpus.txt"], root / "tokenizer", vocab_size=300))
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return data, tokenizer


def train(corpus: tuple[Path, str], root: Path, cache_dir: str, *, num_nodes: int = 1, devices: int = 1, **kw) -> Run:
    data, tokenizer = corpus
    args = ["--hf-json", str(data), "--tokenizer", tokenizer, "--cache-dir", cache_dir, "--max-epochs", "1"]
    args += ["--hf-val-json", kw["val"]] if kw.get("val") else []
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--devices", str(devices), "--strategy", "ddp"]
    args += ["--prepare-once"] if kw.get("prepare_once") else []
    return train_record(args, root, num_nodes=num_nodes)


def all_windows(corpus: tuple[Path, str], cache_dir: str) -> Counter:
    data, tokenizer = corpus
    train, _ = HFTextSource("json", tokenizer, data_files=str(data), cache_dir=cache_dir).build(SEQ_LEN, False)
    rows = torch.from_numpy(train.fetch(np.arange(len(train)))["tokens"][:, :-1].astype(np.int64))
    return Counter(row_digest(row) for row in rows)


def test_two_ddp_ranks_train_disjoint_windows_that_cover_the_epoch_once(
    corpus: tuple[Path, str], tmp_path: Path
) -> None:
    run = train(corpus, tmp_path, str(tmp_path / "cache"), devices=2)
    rank0, rank1 = run.rows(0), run.rows(1)
    expected = all_windows(corpus, str(tmp_path / "cache"))
    # The multiset of trained windows equals the corpus's: every window once, none on both ranks
    # (a window trained twice would count twice; the epoch holds whole global batches).
    assert len(rank0) == len(rank1) == sum(expected.values()) // 2
    assert Counter(rank0 + rank1) == expected
    assert run.info(0)["tokenized"] + run.info(1)["tokenized"] == 1  # one node: its local rank 0


def test_two_nodes_with_their_own_cache_directories_tokenize_once_each(
    corpus: tuple[Path, str], tmp_path: Path
) -> None:
    run = train(corpus, tmp_path, str(tmp_path / "node{node}"), num_nodes=2)
    assert [run.info(node)["tokenized"] for node in (0, 1)] == [1, 1]
    assert all(any((tmp_path / f"node{node}").iterdir()) for node in (0, 1))
    assert Counter(run.rows(0) + run.rows(1)) == all_windows(corpus, str(tmp_path / "node0"))


def test_a_shared_cache_with_prepare_data_per_node_false_is_tokenized_once_in_all(
    corpus: tuple[Path, str], tmp_path: Path
) -> None:
    run = train(corpus, tmp_path, str(tmp_path / "shared"), num_nodes=2, prepare_once=True)
    assert [run.info(node)["tokenized"] for node in (0, 1)] == [1, 0]
    assert Counter(run.rows(0) + run.rows(1)) == all_windows(corpus, str(tmp_path / "shared"))


def test_an_evaluation_split_is_loaded_on_rank_zero_only_and_each_window_evaluated_once(
    corpus: tuple[Path, str], tmp_path: Path
) -> None:
    data, tokenizer = corpus
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": d[::-1]}) + "\n" for d in DOCS[:25]))
    run = train(corpus, tmp_path, str(tmp_path / "cache"), devices=2, val=str(val))
    assert [run.info(r)["evaluation_sets_tokenized"] for r in (0, 1)] == [1, 0]  # rank 1 never opened it
    assert run.info(0)["validation_tokens"] == run.info(1)["validation_tokens"]
    (tokens,) = run.info(0)["validation_tokens"]
    windows = torch.tensor(tokens[: (len(tokens) - 1) // SEQ_LEN * SEQ_LEN]).view(-1, SEQ_LEN)
    evaluated = run.validated(0) + run.validated(1)
    assert Counter(evaluated) == Counter(row_digest(w) for w in windows)  # each window once, over both ranks
