"""The prepare command: text, JSONL, parquet and saved datasets into token shards plus metadata."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from datamodules import TokenShardDataModule, TokenShards
from datamodules.text.prepare import main, prepare
from datamodules.text.shard_metadata import smallest_token_dtype
from examples.default_corpus import train_tokenizer

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(DOCS))
    return str(train_tokenizer([corpus], root / "tokenizer", vocab_size=300))


def decoded_documents(output: Path, tokenizer: str) -> list[str]:
    shards = TokenShards(output)
    tokens = np.empty(shards.num_tokens, dtype=np.int64)
    shards.read_into(0, tokens)
    bounds = [*shards.document_starts.tolist(), shards.num_tokens]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    docs = [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert all(d[-1] == tok.eos_token_id and tok.eos_token_id not in d[:-1] for d in docs)
    return [tok.decode(d[:-1].tolist()) for d in docs]


def test_text_files_become_one_document_each(tmp_path: Path, tokenizer: str) -> None:
    files = []
    for i, doc in enumerate(DOCS[:5]):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(doc + "\nsecond line")
    meta = prepare([str(f) for f in files], tmp_path / "out", tokenizer, num_proc=2, shard_tokens=50)
    assert sorted(decoded_documents(tmp_path / "out", tokenizer)) == sorted(d + "\nsecond line" for d in DOCS[:5])
    assert meta.num_documents == 5 and len(meta.shards) == -(-meta.num_tokens // 50)


def test_jsonl_records_metadata_for_readers(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"content": d}) for d in DOCS))
    prepare([str(path)], tmp_path / "out", tokenizer, text_field="content", num_proc=1)
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    tok = AutoTokenizer.from_pretrained(tokenizer)
    assert meta["dtype"] == "uint16" and meta["num_documents"] == len(DOCS)
    assert meta["eos_id"] == tok.eos_token_id and meta["tokenizer"] == tokenizer
    assert meta["max_token_id"] < len(tok) and meta["content_hash"]
    assert meta["num_tokens"] == sum(s["num_tokens"] for s in meta["shards"])
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS


def test_parquet_and_saved_datasets_give_the_same_shards(tmp_path: Path, tokenizer: str) -> None:
    ds = datasets.Dataset.from_dict({"text": DOCS})
    ds.to_parquet(tmp_path / "docs.parquet")
    ds.save_to_disk(tmp_path / "saved")
    a = prepare([str(tmp_path / "docs.parquet")], tmp_path / "a", tokenizer, num_proc=1)
    b = prepare([str(tmp_path / "saved")], tmp_path / "b", tokenizer, num_proc=1)
    assert a.content_hash == b.content_hash
    assert decoded_documents(tmp_path / "a", tokenizer) == DOCS


def test_rerun_on_unchanged_input_is_a_no_op(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before
    path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS[:10]))
    assert prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1).num_documents == 10


def test_command_line_writes_shards_a_datamodule_trains_on(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    main([str(path), "--output", str(tmp_path / "out"), "--tokenizer", tokenizer, "--num-proc", "1"])
    dm = TokenShardDataModule(tmp_path / "out", seq_len=16, batch_size=2, pack_sequences=True)
    dm.setup("fit")
    assert next(iter(dm.train_dataloader()))["position_ids"].shape == (2, 16)


def test_dtype_is_uint16_when_the_vocabulary_fits_else_uint32() -> None:
    assert smallest_token_dtype(65535) == "uint16"
    assert smallest_token_dtype(65536) == "uint32"


def test_missing_input_file_is_reported(tmp_path: Path, tokenizer: str) -> None:
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare([str(tmp_path / "a.txt"), str(tmp_path / "missing.txt")], tmp_path / "out", tokenizer)


def test_unknown_text_field_is_reported(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"body": "x"}))
    with pytest.raises(ValueError, match="no column 'text'; columns are \\['body'\\]"):
        prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1)
