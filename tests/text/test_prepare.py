"""The prepare command: every input kind into token shards plus metadata, bad input, output safety, parts."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import zstandard
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from datamodules import TokenShardDataModule, TokenShards
from datamodules.text.prepare import main, prepare
from datamodules.text.prepare_inputs import PrepareError
from datamodules.text.shard_metadata import smallest_token_dtype
from examples.default_corpus import train_tokenizer
from tests.support import all_tokens

REPO = Path(__file__).resolve().parents[2]
DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(DOCS))
    return str(train_tokenizer([corpus], root / "tokenizer", vocab_size=300))


def stream(output: Path) -> tuple[np.ndarray, list[int]]:
    shards = TokenShards(output)
    return all_tokens(shards), shards.document_starts.tolist()


def decoded_documents(output: Path, tokenizer: str, separator: int | None = None) -> list[str]:
    tokens, starts = stream(output)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    separator = tok.eos_token_id if separator is None else separator
    docs = [tokens[a:b] for a, b in zip(starts, [*starts[1:], len(tokens)], strict=True)]
    assert all(d[-1] == separator and separator not in d[:-1] for d in docs)
    return [tok.decode(d[:-1].tolist()) for d in docs]


def jsonl(docs: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: d}) + "\n" for d in docs).encode()


def cli_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one short line, no traceback
    return err


def errors_from_both(
    capsys: pytest.CaptureFixture, inputs: list[str], output: Path, tokenizer: str, **options
) -> tuple[str, str]:
    """The message ``prepare`` raises with these options, and the one the command ends with, given them as flags."""
    with pytest.raises(PrepareError) as raised:
        prepare(inputs, output, tokenizer, num_proc=1, **options)
    capsys.readouterr()
    args = [*inputs, "--output", str(output), "--tokenizer", tokenizer, "--num-proc", "1"]
    args += [f"--{name.replace('_', '-')}" for name in options]  # every option given is a switch here
    with pytest.raises(SystemExit):
        main(args)
    return str(raised.value), capsys.readouterr().err.strip().splitlines()[-1]  # after any progress bar


# Inputs


def test_text_files_become_one_document_each(tmp_path: Path, tokenizer: str) -> None:
    files = []
    for i, doc in enumerate(DOCS[:5]):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(doc + "\nsecond line")
    meta = prepare([str(f) for f in files], tmp_path / "out", tokenizer, num_proc=2, shard_tokens=50)
    assert decoded_documents(tmp_path / "out", tokenizer) == [d + "\nsecond line" for d in DOCS[:5]]
    assert meta.num_documents == 5 and len(meta.shards) == -(-meta.num_tokens // 50)


def test_jsonl_records_metadata_for_readers(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(DOCS, "content"))
    prepare([str(path)], tmp_path / "out", tokenizer, text_field="content", num_proc=1)
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    tok = AutoTokenizer.from_pretrained(tokenizer)
    assert meta["dtype"] == "uint16" and meta["num_documents"] == len(DOCS)
    assert meta["eos_id"] == tok.eos_token_id and meta["tokenizer"] == tokenizer
    assert meta["max_token_id"] < len(tok) and meta["content_hash"]
    assert meta["num_tokens"] == sum(s["num_tokens"] for s in meta["shards"])
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS


@pytest.mark.parametrize("name", ["docs.jsonl.gz", "docs.json.zst", "docs.jsonl.bz2", "docs.json", "docs.parquet"])
def test_every_record_format_and_compression_gives_the_same_tokens(tmp_path: Path, tokenizer: str, name: str) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(jsonl(DOCS))
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(jsonl(DOCS)))
    elif name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCS)))
    elif name.endswith(".bz2"):
        path.write_bytes(bz2.compress(jsonl(DOCS)))
    elif name.endswith(".parquet"):
        datasets.Dataset.from_dict({"text": DOCS}).to_parquet(path)
    else:  # a JSON array of records
        path.write_text(json.dumps([{"text": d} for d in DOCS]))
    a = prepare([str(plain)], tmp_path / "a", tokenizer, num_proc=1)
    b = prepare([str(path)], tmp_path / "b", tokenizer, num_proc=1)
    assert a.content_hash == b.content_hash and b.num_documents == len(DOCS)


def test_compressed_text_files_are_decompressed(tmp_path: Path, tokenizer: str) -> None:
    for i, doc in enumerate(DOCS[:3]):
        (tmp_path / f"doc{i}.txt.gz").write_bytes(gzip.compress(doc.encode()))
    prepare(sorted(str(p) for p in tmp_path.glob("*.gz")), tmp_path / "out", tokenizer, num_proc=1)
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS[:3]


def test_a_directory_is_read_recursively_in_sorted_order_with_a_glob(tmp_path: Path, tokenizer: str) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "b" / "deep").mkdir(parents=True)
    (corpus / "a").mkdir()
    (corpus / "a" / "1.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS[:10])))
    (corpus / "b" / "deep" / "2.jsonl").write_bytes(jsonl(DOCS[10:20]))
    (corpus / "README.md").write_text("not a document")
    prepare([str(corpus)], tmp_path / "out", tokenizer, num_proc=1, glob="**/*.jsonl*")
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS[:20]


def test_a_directory_of_several_kinds_without_a_glob_is_refused(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(jsonl(DOCS))
    (tmp_path / "in" / "README.md").write_text("x")
    python, command = errors_from_both(capsys, [str(tmp_path / "in")], tmp_path / "out", tokenizer)
    assert "several kinds" in python and "choose the documents with glob, e.g. glob='**/*.jsonl.gz'" in python
    assert "choose the documents with --glob, e.g. --glob '**/*.jsonl.gz'" in command


def test_a_saved_dataset_dict_is_read_by_split(tmp_path: Path, tokenizer: str) -> None:
    saved = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS[:30]}),
            "test": datasets.Dataset.from_dict({"text": DOCS[30:]}),
        }
    )
    saved.save_to_disk(tmp_path / "saved")
    prepare([str(tmp_path / "saved")], tmp_path / "out", tokenizer, num_proc=1, split="test")
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS[30:]
    with pytest.raises(PrepareError, match="has no split 'validation'; splits are \\['train', 'test'\\]"):
        prepare([str(tmp_path / "saved")], tmp_path / "out2", tokenizer, split="validation")


def test_add_bos_and_another_separator(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(DOCS[:5]))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.add_special_tokens({"bos_token": "<s>", "additional_special_tokens": ["<doc>"]})
    tok.save_pretrained(tmp_path / "tok")
    prepare([str(path)], tmp_path / "out", str(tmp_path / "tok"), num_proc=1, add_bos=True, separator="<doc>")
    tokens, starts = stream(tmp_path / "out")
    sep = tok.convert_tokens_to_ids("<doc>")
    assert tokens[starts].tolist() == [tok.bos_token_id] * 5
    assert tokens[[s - 1 for s in starts[1:]] + [len(tokens) - 1]].tolist() == [sep] * 5
    assert (tokens == sep).sum() == 5 and (tokens == tok.bos_token_id).sum() == 5


# Bad input: each a short error naming the value


def test_a_missing_path_is_an_error_naming_it(tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "data").mkdir()
    missing = str(tmp_path / "data" / "trian.jsonl")
    err = cli_error(capsys, missing, "--output", str(tmp_path / "out"), "--tokenizer", tokenizer)
    assert f"input path {missing!r} does not exist" in err


def test_a_mistyped_relative_path_is_not_looked_up_on_the_hub(
    tmp_path: Path, tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("data").mkdir()
    with pytest.raises(PrepareError, match="input path 'data/train' does not exist"):
        prepare(["data/train"], "out", tokenizer)


def test_a_hub_name_offline_is_one_short_error(tmp_path: Path, tokenizer: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-m", "datamodules.text.prepare", "someorg/no-such-dataset", "--output", str(tmp_path / "o")]
    done = subprocess.run(
        [*cmd, "--tokenizer", tokenizer], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "'someorg/no-such-dataset' is not a local path, and the HuggingFace Hub is offline here" in last
    assert "no request made" in last
    assert "Traceback" not in done.stderr


def test_a_missing_tokenizer_path_is_an_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "docs.jsonl").write_bytes(jsonl(DOCS))
    missing = str(tmp_path / "no" / "tokenizer")
    err = cli_error(capsys, str(tmp_path / "docs.jsonl"), "--output", str(tmp_path / "out"), "--tokenizer", missing)
    assert f"tokenizer path {missing!r} does not exist" in err


@pytest.mark.parametrize("content", [b"", b"\n\n"])
def test_an_empty_input_is_an_error(tmp_path: Path, tokenizer: str, content: bytes) -> None:
    (tmp_path / "docs.jsonl").write_bytes(content)
    with pytest.raises(PrepareError, match="no documents in the inputs"):
        prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer, num_proc=1)
    assert not (tmp_path / "out").exists()


def test_an_empty_directory_is_an_error(tmp_path: Path, tokenizer: str) -> None:
    (tmp_path / "in").mkdir()
    with pytest.raises(PrepareError, match="input directory .*in' holds no files"):
        prepare([str(tmp_path / "in")], tmp_path / "out", tokenizer)


@pytest.mark.parametrize(
    ("record", "problem"), [({"body": "x"}, "is missing"), ({"text": None}, "is null"), ({"text": 3}, "is a int")]
)
def test_a_row_without_text_names_file_and_line(tmp_path: Path, tokenizer: str, record: dict, problem: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(DOCS[:3]) + json.dumps(record).encode() + b"\n" + jsonl(DOCS[3:5]))
    with pytest.raises(PrepareError, match=f"docs.jsonl line 4: text field 'text' {problem}.* on_bad_row='skip'"):
        prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1)


def test_a_missing_text_field_names_the_fields_and_the_text_field_option(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "docs.jsonl").write_bytes(jsonl(DOCS, key="body"))
    python, command = errors_from_both(capsys, [str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer)
    assert "line 1: text field 'text' is missing (its fields: ['body']); name the text's field with" in python
    assert "text_field='NAME', or on_bad_row='skip' counts" in python and "--" not in python
    assert "with --text-field NAME, or --on-bad-row skip counts" in command


def test_a_null_text_names_the_option_that_skips_it(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "docs.jsonl").write_bytes(b'{"text": null}\n')
    python, command = errors_from_both(capsys, [str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer)
    assert python.endswith("text field 'text' is null; on_bad_row='skip' counts and skips such rows")
    assert command.endswith("text field 'text' is null; --on-bad-row skip counts and skips such rows")


def test_a_bad_number_on_the_command_line_names_its_flag(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "docs.jsonl").write_bytes(jsonl(DOCS))
    args = [str(tmp_path / "docs.jsonl"), "--output", str(tmp_path / "out"), "--tokenizer", tokenizer]
    assert cli_error(capsys, *args, "--num-proc", "-1").endswith("error: --num-proc must be a positive integer, got -1")
    with pytest.raises(PrepareError, match="^num_proc must be a positive integer, got -1$"):
        prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer, num_proc=-1)


def test_a_missing_column_names_the_text_field_option(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    datasets.Dataset.from_dict({"body": ["x"]}).to_parquet(tmp_path / "d.parquet")
    python, command = errors_from_both(capsys, [str(tmp_path / "d.parquet")], tmp_path / "out", tokenizer)
    assert python.endswith("has no column 'text'; columns are ['body']: name the text's column with text_field='NAME'")
    assert command.endswith("name the text's column with --text-field NAME")


def test_a_tokenizer_without_bos_names_the_add_bos_option(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "docs.jsonl").write_bytes(jsonl(DOCS))
    python, command = errors_from_both(
        capsys, [str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer, add_bos=True
    )
    assert python.endswith("has no BOS token; drop add_bos=True")
    assert command.endswith("has no BOS token; drop --add-bos")


def test_a_tokenizer_without_eos_names_the_separator_option(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "docs.jsonl").write_bytes(jsonl(DOCS))
    PreTrainedTokenizerFast(tokenizer_file=str(Path(tokenizer) / "tokenizer.json")).save_pretrained(tmp_path / "no_eos")
    python, command = errors_from_both(
        capsys, [str(tmp_path / "docs.jsonl")], tmp_path / "out", str(tmp_path / "no_eos")
    )
    assert python.endswith("has no EOS token to end documents: separator='TOKEN'")
    assert command.endswith("has no EOS token to end documents: --separator TOKEN")


def test_a_parquet_null_names_file_and_row(tmp_path: Path, tokenizer: str) -> None:
    datasets.Dataset.from_dict({"text": ["a", None, "b"]}).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(PrepareError, match="d.parquet row 1: text field 'text' is null"):
        prepare([str(tmp_path / "d.parquet")], tmp_path / "out", tokenizer, num_proc=1)


def test_skipping_bad_rows_counts_and_reports_them(
    tmp_path: Path, tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(DOCS[:3]) + b'{"text": null}\n{"other": 1}\n' + jsonl(DOCS[3:5]))
    with caplog.at_level("WARNING"):
        meta = prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1, on_bad_row="skip")
    assert meta.extra["bad_rows_skipped"] == 2 and meta.num_documents == 5
    assert "skipped 2 rows without text" in caplog.text and "docs.jsonl line 4" in caplog.text
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS[:5]


def test_non_utf8_bytes_name_the_file(tmp_path: Path, tokenizer: str) -> None:
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(PrepareError, match=r"bad.txt is not valid UTF-8 \(byte 3"):
        prepare([str(tmp_path / "bad.txt")], tmp_path / "out", tokenizer, num_proc=1)


def test_an_unknown_suffix_lists_the_accepted_ones(tmp_path: Path, tokenizer: str) -> None:
    (tmp_path / "docs.csv").write_text("text\nx")
    with pytest.raises(PrepareError, match=r"docs.csv' has an unknown suffix; accepted: .txt, .*\.parquet .*\.zst"):
        prepare([str(tmp_path / "docs.csv")], tmp_path / "out", tokenizer)


def test_unknown_text_field_is_reported(tmp_path: Path, tokenizer: str) -> None:
    datasets.Dataset.from_dict({"body": ["x"]}).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(PrepareError, match="has no column 'text'; columns are \\['body'\\]"):
        prepare([str(tmp_path / "d.parquet")], tmp_path / "out", tokenizer, num_proc=1)


# Output safety


def test_rerun_on_unchanged_input_is_a_no_op_and_an_edited_input_is_prepared_again(
    tmp_path: Path, tokenizer: str
) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(DOCS))
    prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before
    path.write_bytes(jsonl(DOCS[:10]))
    assert prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1).num_documents == 10


def test_an_output_of_other_inputs_is_refused_unless_overwrite(
    tmp_path: Path, tokenizer: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a.jsonl").write_bytes(jsonl(DOCS[:10]))
    (tmp_path / "b.jsonl").write_bytes(jsonl(DOCS[10:]))
    prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", tokenizer, num_proc=1)
    python, command = errors_from_both(capsys, [str(tmp_path / "b.jsonl")], tmp_path / "out", tokenizer)
    assert "out already holds shards of other inputs" in python
    assert python.endswith("pass overwrite=True to replace them, or choose another output")
    assert command.endswith("pass --overwrite to replace them, or choose another --output")
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS[:10]
    prepare([str(tmp_path / "b.jsonl")], tmp_path / "out", tokenizer, num_proc=1, overwrite=True)
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS[10:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_directory_of_other_files_is_refused_as_output(tmp_path: Path, tokenizer: str) -> None:
    (tmp_path / "a.jsonl").write_bytes(jsonl(DOCS))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match=r"out already holds files that are not a finished prepare output"):
        prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", tokenizer, num_proc=1)


def test_a_killed_run_leaves_no_output_and_the_next_run_finishes(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(DOCS * 1500))
    args = [sys.executable, "-m", "datamodules.text.prepare", str(path), "--output", str(tmp_path / "out")]
    args += ["--tokenizer", tokenizer, "--num-proc", "1", "--shard-tokens", "1000"]
    process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.partial-*/shard_00001.npy")) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert list(tmp_path.glob(".out.partial-*")), "the run finished before it could be killed"
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenShards(tmp_path / "out")
    meta = prepare([str(path)], tmp_path / "out", tokenizer, num_proc=1, shard_tokens=1000)
    assert meta.num_documents == len(DOCS) * 1500 and not list(tmp_path.glob(".out.partial-*"))


def _die(texts: list[str]) -> None:
    os._exit(9)  # a worker killed mid-batch, as the OOM killer would


def test_a_tokenizer_process_that_dies_fails_the_run_instead_of_hanging(
    tmp_path: Path, tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datamodules.text.prepare as prepare_module

    (tmp_path / "docs.jsonl").write_bytes(jsonl(DOCS * 50))
    monkeypatch.setattr(prepare_module, "_tokenize_in_worker", _die)
    with pytest.raises(PrepareError, match="a tokenizer process died"):
        prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer, num_proc=2)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


# Parts


def test_parts_prepared_in_parallel_train_on_the_same_windows_as_one_part(tmp_path: Path, tokenizer: str) -> None:
    for i in range(5):
        (tmp_path / f"in{i}.jsonl").write_bytes(jsonl(DOCS[i * 8 : (i + 1) * 8]))
    inputs = sorted(str(p) for p in tmp_path.glob("in*.jsonl"))
    prepare(inputs, tmp_path / "single", tokenizer, num_proc=1)
    base = [sys.executable, "-m", "datamodules.text.prepare", *inputs, "--output", str(tmp_path / "parts")]
    base += ["--tokenizer", tokenizer, "--num-proc", "1", "--num-parts", "2"]
    runs = [subprocess.Popen([*base, "--part-index", str(i)], cwd=REPO, stderr=subprocess.PIPE) for i in (0, 1)]
    assert [r.wait(timeout=120) for r in runs] == [0, 0], [r.stderr.read().decode()[-2000:] for r in runs]
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["part-00000", "part-00001"]
    assert stream(tmp_path / "parts")[0].tolist() == stream(tmp_path / "single")[0].tolist()
    assert stream(tmp_path / "parts")[1] == stream(tmp_path / "single")[1]

    def batches(directory: Path) -> list[list[list[int]]]:
        dm = TokenShardDataModule(directory, seq_len=16, batch_size=4, pack_sequences=True, seed=7)
        dm.setup("fit")
        return [b["input_ids"].tolist() + b["position_ids"].tolist() for b in dm.train_dataloader()]

    assert batches(tmp_path / "parts") == batches(tmp_path / "single")


def test_a_missing_part_is_refused_by_the_reader(tmp_path: Path, tokenizer: str) -> None:
    for i in range(3):
        (tmp_path / f"in{i}.jsonl").write_bytes(jsonl(DOCS[i * 10 : (i + 1) * 10]))
    inputs = sorted(str(p) for p in tmp_path.glob("in*.jsonl"))
    prepare(inputs, tmp_path / "parts", tokenizer, num_proc=1, num_parts=3, part_index=0)
    prepare(inputs, tmp_path / "parts", tokenizer, num_proc=1, num_parts=3, part_index=2)
    with pytest.raises(ValueError, match=r"holds 2 of 3 prepared parts; part\(s\) \[1\] are missing"):
        TokenShards(tmp_path / "parts")


def test_parts_prepared_with_one_tokenizer_from_two_paths_are_one_corpus(tmp_path: Path, tokenizer: str) -> None:
    for i in range(2):
        (tmp_path / f"in{i}.jsonl").write_bytes(jsonl(DOCS[i * 10 : (i + 1) * 10]))
    inputs = sorted(str(p) for p in tmp_path.glob("in*.jsonl"))
    copy = shutil.copytree(tokenizer, tmp_path / "copied-tokenizer")  # as on another machine
    for part, path in enumerate([tokenizer, str(copy)]):
        prepare(inputs, tmp_path / "parts", path, num_proc=1, num_parts=2, part_index=part)
    prepare(inputs, tmp_path / "single", tokenizer, num_proc=1)
    assert stream(tmp_path / "parts")[0].tolist() == stream(tmp_path / "single")[0].tolist()


def test_more_parts_than_input_files_is_refused(tmp_path: Path, tokenizer: str) -> None:
    (tmp_path / "a.jsonl").write_bytes(jsonl(DOCS))
    with pytest.raises(PrepareError, match="3 parts need at least 3 input files, got 1"):
        prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", tokenizer, num_parts=3, part_index=0)


def test_command_line_writes_shards_a_datamodule_trains_on(tmp_path: Path, tokenizer: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl(DOCS))
    main([str(path), "--output", str(tmp_path / "out"), "--tokenizer", tokenizer, "--num-proc", "1"])
    dm = TokenShardDataModule(tmp_path / "out", seq_len=16, batch_size=2, pack_sequences=True)
    dm.setup("fit")
    assert next(iter(dm.train_dataloader()))["position_ids"].shape == (2, 16)


def test_dtype_is_uint16_when_the_vocabulary_fits_else_uint32() -> None:
    assert smallest_token_dtype(65535) == "uint16"
    assert smallest_token_dtype(65536) == "uint32"


def test_empty_documents_are_counted_and_skipped_unless_kept(
    tmp_path: Path, tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl").write_bytes(jsonl([DOCS[0], "", DOCS[1], ""]))
    (tmp_path / "in" / "empty.txt").write_text("")
    inputs = [str(tmp_path / "in" / "docs.jsonl"), str(tmp_path / "in" / "empty.txt")]
    with caplog.at_level("INFO"):
        meta = prepare(inputs, tmp_path / "out", tokenizer, num_proc=1)
    assert meta.extra["empty_documents_skipped"] == 3 and meta.num_documents == 2
    assert "in 2 documents" in caplog.text and "(skipped 3 empty documents)" in caplog.text
    assert decoded_documents(tmp_path / "out", tokenizer) == DOCS[:2]
    kept = prepare(inputs, tmp_path / "kept", tokenizer, num_proc=1, keep_empty_documents=True)
    assert kept.num_documents == 5 and kept.extra["empty_documents_skipped"] == 0
    assert decoded_documents(tmp_path / "kept", tokenizer) == [DOCS[0], "", DOCS[1], "", ""]


def test_the_installed_command_shows_its_own_name(tmp_path: Path) -> None:
    command = Path(sys.executable).parent / "lm-datamodules-prepare"
    if not command.exists():
        pytest.skip("the package is not installed with its console scripts")
    shown = subprocess.run([str(command), "--help"], capture_output=True, text=True, check=True).stdout
    assert shown.startswith("usage: lm-datamodules-prepare ")


def test_a_prepared_shard_overwritten_with_the_same_size_is_refused_on_resume_by_name(
    tmp_path: Path, tokenizer: str
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.support import RecordingModel, quiet_trainer

    (tmp_path / "docs.jsonl").write_bytes(jsonl(DOCS))
    meta = prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer, num_proc=1, shard_tokens=500)
    assert len(meta.shards) > 2 and all(info.edges for info in meta.shards)

    def fit(steps: int, resume: Path | None = None) -> None:
        dm = TokenShardDataModule(tmp_path / "out", seq_len=8, batch_size=2)
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        quiet_trainer(max_steps=steps, callbacks=[checkpoint]).fit(RecordingModel(), datamodule=dm, ckpt_path=resume)

    fit(2)
    shard = tmp_path / "out" / meta.shards[1].file
    data = bytearray(shard.read_bytes())
    data[-2:] = bytes([data[-2] ^ 1, data[-1]])  # one token of the last 4 KB, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=rf"changed since they were prepared: {meta.shards[1].file} \(its first or last"
    ):
        fit(4, resume=next((tmp_path / "ckpt").glob("*step=2.ckpt")))
    shard.write_bytes(bytes(data[:-2]) + bytes([data[-2] ^ 1, data[-1]]))  # restored: it resumes
    fit(4, resume=next((tmp_path / "ckpt").glob("*step=2.ckpt")))
