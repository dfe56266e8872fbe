"""HFTextDataModule / HFTextSource: a HuggingFace dataset tokenized once into the token-shard cache."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from datamodules import HFTextDataModule, HFTextSource, MixtureComponent, MixtureDataModule, TokenShards
from datamodules.text.prepare import prepare
from datamodules.text.prepare_inputs import PrepareError
from examples.default_corpus import train_tokenizer
from tests.support import RecordingModel, all_tokens, fit_records, quiet_trainer

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 7 + 1) for i in range(60)]
SEQ_LEN, BATCH = 8, 4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tok")
    (root / "corpus.txt").write_text("\n".join(DOCS))
    return str(train_tokenizer([root / "corpus.txt"], root / "tokenizer", vocab_size=300))


def jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))
    return path


def make_dm(tmp_path: Path, tokenizer: str, **kwargs) -> HFTextDataModule:
    data = kwargs.pop("data_files", None) or str(tmp_path / "docs.jsonl")
    if not (tmp_path / "docs.jsonl").exists():
        jsonl(tmp_path / "docs.jsonl", DOCS)
    options = {"data_files": data, "cache_dir": str(tmp_path / "cache"), "seq_len": SEQ_LEN, "batch_size": BATCH}
    return HFTextDataModule(kwargs.pop("path", "json"), tokenizer, **{**options, "num_proc": 1, **kwargs})


def stream(directory: Path) -> list[int]:
    return all_tokens(TokenShards(directory)).tolist()


def test_eager_tokens_equal_the_prepare_command_on_the_same_documents(tmp_path: Path, tokenizer: str) -> None:
    dm = make_dm(tmp_path, tokenizer)
    dm.prepare_data()
    dm.setup("fit")
    prepare([str(tmp_path / "docs.jsonl")], tmp_path / "reference", tokenizer, num_proc=1)
    assert stream(dm.source.cache_path("train")) == stream(tmp_path / "reference")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (BATCH, SEQ_LEN)


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_parquet_and_saved_datasets_give_the_same_tokens_as_jsonl(tmp_path: Path, tokenizer: str, kind: str) -> None:
    reference = make_dm(tmp_path, tokenizer)
    reference.prepare_data()
    if kind == "parquet":
        datasets.Dataset.from_dict({"text": DOCS}).to_parquet(tmp_path / "docs.parquet")
        dm = make_dm(tmp_path, tokenizer, path="parquet", data_files=str(tmp_path / "docs.parquet"))
    else:
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(tmp_path / "saved")
        dm = make_dm(tmp_path, tokenizer, path=str(tmp_path / "saved"))
    dm.prepare_data()
    assert stream(dm.source.cache_path("train")) == stream(reference.source.cache_path("train"))


def test_a_second_prepare_data_hits_the_cache_and_changed_inputs_or_tokenizer_miss_it(
    tmp_path: Path, tokenizer: str
) -> None:
    dm = make_dm(tmp_path, tokenizer)
    dm.prepare_data()
    cache = dm.source.cache_path("train")
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    make_dm(tmp_path, tokenizer, data_files=str(tmp_path / "docs.jsonl")).prepare_data()
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    jsonl(tmp_path / "docs.jsonl", DOCS[:30])
    edited = make_dm(tmp_path, tokenizer, data_files=str(tmp_path / "docs.jsonl"))
    assert edited.source.cache_path("train") != cache
    edited.prepare_data()
    assert len(TokenShards(edited.source.cache_path("train")).document_starts) == 30
    other = AutoTokenizer.from_pretrained(tokenizer)
    other.save_pretrained(tmp_path / "other_tokenizer")
    (tmp_path / "other_tokenizer" / "tokenizer.json").write_text(
        (Path(tokenizer) / "tokenizer.json").read_text().replace('"fox"', '"fox" ')
    )
    retokenized = make_dm(tmp_path, str(tmp_path / "other_tokenizer"), data_files=str(tmp_path / "docs.jsonl"))
    assert retokenized.source.cache_path("train") not in (cache, edited.source.cache_path("train"))


def test_setup_without_prepare_data_names_the_missing_cache(tmp_path: Path, tokenizer: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenized cache of 'json' split 'train' .*prepare_data\(\)"):
        make_dm(tmp_path, tokenizer).setup("fit")


def test_a_validation_split_is_tokenized_in_setup_and_evaluated_once(tmp_path: Path, tokenizer: str) -> None:
    files = {
        "train": str(jsonl(tmp_path / "train.jsonl", DOCS[:50])),
        "test": str(jsonl(tmp_path / "t.jsonl", DOCS[50:])),
    }
    dm = HFTextDataModule(
        "json", tokenizer, SEQ_LEN, BATCH, data_files=files, val_split="test", cache_dir=str(tmp_path / "c"), num_proc=1
    )
    dm.prepare_data()
    assert [p.name.split("-")[2] for p in (tmp_path / "c").iterdir()] == ["train"]  # nothing cached for "test"
    dm.setup("fit")
    prepare([files["test"]], tmp_path / "reference", tokenizer, num_proc=1)
    (_, val), reference = dm._vals[0], stream(tmp_path / "reference")
    assert all_tokens(val.shards).tolist() == reference
    rows = sum(int((b["labels"] != -100).any(dim=1).sum()) for b in dm.val_dataloader())
    assert rows == (len(reference) - 1) // SEQ_LEN


def fit(dm: HFTextDataModule, max_steps: int, ckpt_dir: Path | None = None, resume: Path | None = None) -> list[dict]:
    return fit_records(dm, max_steps, ckpt_dir, resume)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_through_fit_trains_identical_batches(tmp_path: Path, tokenizer: str, workers: int) -> None:
    def dm() -> HFTextDataModule:
        return make_dm(tmp_path, tokenizer, data_files=str(jsonl(tmp_path / "docs.jsonl", DOCS)), num_workers=workers)

    uninterrupted = fit(dm(), 40)
    stopped = fit(dm(), 5, ckpt_dir=tmp_path / "ckpt")
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=3.ckpt")
    resumed = fit(dm(), 40, resume=checkpoint)
    assert stopped[:3] + resumed == uninterrupted  # 40 steps: across two epoch boundaries


def test_an_hf_source_in_a_mixture_keeps_the_exact_counts_of_every_batch(tmp_path: Path, tokenizer: str) -> None:
    a = HFTextSource("json", tokenizer, data_files=str(jsonl(tmp_path / "a.jsonl", DOCS[:30])), cache_dir=str(tmp_path))
    b = HFTextSource(
        "json",
        tokenizer,
        data_files=str(jsonl(tmp_path / "b.jsonl", [d.upper() for d in DOCS])),
        cache_dir=str(tmp_path),
    )
    dm = MixtureDataModule([MixtureComponent("a", 0.7, a), MixtureComponent("b", 0.3, b)], SEQ_LEN, batch_size=10)
    dm.prepare_data()
    dm.setup("fit")
    windows = {}  # b's text is upper case, so no window of b is also one of a
    for name, source in (("a", a), ("b", b)):
        train, _ = source.build(SEQ_LEN, False)
        windows[name] = {tuple(row) for row in train.fetch(np.arange(len(train)))["tokens"][:, :-1].tolist()}
    expected = (7, 3)  # 0.7 and 0.3 of every global batch of 10
    for batch in dm.train_dataloader():
        rows = [tuple(r) for r in batch["input_ids"].tolist()]
        assert (sum(r in windows["a"] for r in rows), sum(r in windows["b"] for r in rows)) == expected


# Bad input: each a clear error at prepare_data


def test_a_text_field_that_is_not_a_column_lists_the_columns(tmp_path: Path, tokenizer: str) -> None:
    dm = make_dm(tmp_path, tokenizer, data_files=str(jsonl(tmp_path / "d.jsonl", DOCS, key="body")))
    with pytest.raises(PrepareError, match=r"has no column 'text'; columns are \['body'\]"):
        dm.prepare_data()


def test_a_null_text_names_the_row(tmp_path: Path, tokenizer: str) -> None:
    datasets.Dataset.from_dict({"text": ["a", "b", None, "c"]}).save_to_disk(tmp_path / "saved")
    with pytest.raises(PrepareError, match=r"saved row 2: text field 'text' is null"):
        make_dm(tmp_path, tokenizer, path=str(tmp_path / "saved")).prepare_data()


def test_an_empty_split_is_an_error(tmp_path: Path, tokenizer: str) -> None:
    files = {"train": str(jsonl(tmp_path / "train.jsonl", DOCS)), "test": str(jsonl(tmp_path / "test.jsonl", []))}
    dm = make_dm(tmp_path, tokenizer, data_files=files, split="test")
    with pytest.raises(PrepareError, match=r"no documents in the inputs: split 'test' of 'json'"):
        dm.prepare_data()


def test_a_tokenizer_without_eos_is_an_error(tmp_path: Path, tokenizer: str) -> None:
    no_eos = PreTrainedTokenizerFast(tokenizer_file=str(Path(tokenizer) / "tokenizer.json"))
    no_eos.save_pretrained(tmp_path / "no_eos")
    # HFTextDataModule has no separator option to offer (the prepare command's --separator).
    with pytest.raises(PrepareError, match=r"tokenizer .*no_eos' has no EOS token to end documents: use a tokenizer"):
        make_dm(tmp_path, str(tmp_path / "no_eos")).prepare_data()


def test_a_tokenizer_without_bos_names_the_add_bos_argument(tmp_path: Path, tokenizer: str) -> None:
    with pytest.raises(PrepareError, match=r"tokenizer .* has no BOS token; drop add_bos=True$"):
        make_dm(tmp_path, tokenizer, add_bos=True).prepare_data()


def test_a_hub_name_that_cannot_be_reached_is_one_short_error(
    tmp_path: Path, tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dm = HFTextDataModule("someorg/no-such-dataset", tokenizer, SEQ_LEN, BATCH, cache_dir=str(tmp_path), num_proc=1)
    with pytest.raises(PrepareError) as refused:
        dm.prepare_data()
    assert "'someorg/no-such-dataset' is not a local path, and the HuggingFace Hub is offline here" in str(
        refused.value
    )
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("streaming", [False, True], ids=["eager", "streaming"])
@pytest.mark.parametrize("splits", [{"val_split": "test"}, {"split": "no_such_split"}], ids=["val_split", "split"])
def test_a_split_a_saved_single_dataset_does_not_have_is_refused_through_fit(
    tmp_path: Path, tokenizer: str, streaming: bool, splits: dict
) -> None:
    """One saved ``Dataset`` has no named splits: asked for one, it must not answer with its own rows."""
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(tmp_path / "saved")
    options = {"streaming": True, "shuffle_rows": 4} if streaming else {}
    dm = make_dm(tmp_path, tokenizer, path=str(tmp_path / "saved"), data_files=None, **options, **splits)
    asked = next(iter(splits.values()))
    message = rf"saved holds one Dataset \(split 'train'\), not a DatasetDict of splits: split '{asked}' is not in it"
    with pytest.raises(Exception, match=message) as refused:
        quiet_trainer(max_steps=2).fit(RecordingModel(), datamodule=dm)
    assert isinstance(refused.value, (PrepareError, ValueError))


def test_a_val_split_naming_the_training_split_fails_at_construction(tmp_path: Path, tokenizer: str) -> None:
    with pytest.raises(ValueError, match="val_split 'train' is the training split: it would validate on the training"):
        make_dm(tmp_path, tokenizer, val_split="train")


def test_empty_texts_never_become_documents_of_only_eos_in_training(tmp_path: Path, tokenizer: str) -> None:
    texts = [d if i % 4 else "" for i, d in enumerate(DOCS)]
    dm = make_dm(tmp_path, tokenizer, data_files=str(jsonl(tmp_path / "gappy.jsonl", texts)), pack_sequences=True)
    model = RecordingModel()
    quiet_trainer(max_steps=3).fit(model, datamodule=dm)
    metadata = json.loads((dm.source.cache_path("train") / "metadata.json").read_text())
    assert metadata["extra"]["empty_documents_skipped"] == texts.count("")
    assert metadata["num_documents"] == len(texts) - texts.count("")
    eos = AutoTokenizer.from_pretrained(tokenizer).eos_token_id
    tokens = all_tokens(TokenShards(dm.source.cache_path("train")))
    assert not np.any((tokens[1:] == eos) & (tokens[:-1] == eos)) and tokens[0] != eos


def test_on_bad_row_skip_counts_and_skips_null_texts_as_the_error_suggests(tmp_path: Path, tokenizer: str) -> None:
    datasets.Dataset.from_dict({"text": ["a b", "c", None, "d e"]}).save_to_disk(tmp_path / "saved")
    with pytest.raises(PrepareError, match=r"saved row 2: text field 'text' is null; on_bad_row='skip' counts"):
        make_dm(tmp_path, tokenizer, path=str(tmp_path / "saved")).prepare_data()
    dm = make_dm(tmp_path, tokenizer, path=str(tmp_path / "saved"), on_bad_row="skip", seq_len=2, batch_size=1)
    dm.prepare_data()
    metadata = json.loads((dm.source.cache_path("train") / "metadata.json").read_text())
    assert metadata["extra"]["bad_rows_skipped"] == 1 and metadata["num_documents"] == 3
    with pytest.raises(ValueError, match="on_bad_row must be one of \\('raise', 'skip'\\), got 'ignore'"):
        make_dm(tmp_path, tokenizer, on_bad_row="ignore")


@pytest.mark.parametrize("streaming", [False, True], ids=["eager", "streaming"])
def test_a_test_split_is_evaluated_once_by_trainer_test(tmp_path: Path, tokenizer: str, streaming: bool) -> None:
    files = {
        "train": str(jsonl(tmp_path / "train.jsonl", DOCS[:40])),
        "validation": str(jsonl(tmp_path / "v.jsonl", DOCS[40:50])),
        "test": str(jsonl(tmp_path / "t.jsonl", DOCS[50:])),
    }
    options = {"streaming": True, "shuffle_rows": 8} if streaming else {}
    dm = make_dm(tmp_path, tokenizer, data_files=files, val_split="validation", test_split="test", **options)
    model, trainer = RecordingModel(), quiet_trainer(max_steps=2)
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm)
    prepare([files["test"]], tmp_path / "reference", tokenizer, num_proc=1)
    (_, test), reference = dm._held["test"][0], stream(tmp_path / "reference")
    assert all_tokens(test.shards).tolist() == reference
    assert len(model.test_rows) == (len(reference) - 1) // SEQ_LEN  # every window once (some texts repeat)


def test_a_data_files_pattern_that_matches_nothing_is_named_at_construction(tmp_path: Path, tokenizer: str) -> None:
    with pytest.raises(ValueError, match=r"^data_files pattern '.*nowhere/\*\.jsonl' matches no file$"):
        HFTextDataModule("json", tokenizer, SEQ_LEN, BATCH, data_files=str(tmp_path / "nowhere" / "*.jsonl"))
    with pytest.raises(ValueError, match=r"^tokenizer '\./no_tokenizer' does not exist$"):
        HFTextDataModule("json", "./no_tokenizer", SEQ_LEN, BATCH, data_files=str(jsonl(tmp_path / "d.jsonl", DOCS)))


@pytest.mark.parametrize("streaming", [False, True])
def test_local_files_are_loaded_without_a_network_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    # datasets' builders send a HEAD to their download counter on every load_dataset; without network (as
    # on many clusters) each load waited 10-30 s for it. Loading the user's own files asks nothing remote.
    import socket

    from datamodules.plan.hf_loading import load_split

    looked_up: list[str] = []
    real = socket.getaddrinfo

    def recording(host: str, *args: object, **kwargs: object) -> object:
        if host not in ("localhost", "::1") and not str(host).startswith("127."):
            looked_up.append(host)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", recording)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    loaded = load_split("json", "train", data_files=str(tmp_path / "docs.jsonl"), streaming=streaming)
    assert [row["text"] for row in loaded] == DOCS
    assert looked_up == []
