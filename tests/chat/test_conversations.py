"""ConversationDataModule: chat fine-tuning rows checked against a hand rendering, every conversation once
per pass, exact and elastic resume, mixtures with phases, and packing that does not leak attention.

Conversations render with the word-level tokenizer and ``<|role|> words <|end|>`` template of
``chat_data.py``, so each conversation's ids and assistant mask are written out by hand.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import LlamaConfig, LlamaForCausalLM

from datamodules import ConversationDataModule, ConversationSource, MixtureComponent, MixtureDataModule, PhaseScheduler
from tests.chat.chat_data import (
    MARKED,
    MARKERS,
    PLAIN,
    ROLE,
    SHAREGPT,
    WORDS,
    by_hand,
    chat_tokenizer,
    random_chats,
    write_sharegpt,
)
from tests.distributed_support import train_record
from tests.support import RecordingModel, quiet_trainer, row_digest

ROW = 48  # tokens per packed row


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def chats() -> list[list[tuple[str, str]]]:
    return SHAREGPT[:3] + random_chats(80, words=(1, 5))  # at most 42 tokens: none truncated


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory: pytest.TempPathFactory, chats) -> str:
    return write_sharegpt(tmp_path_factory.mktemp("chats") / "chats.jsonl", chats)


def datamodule(chat_file: str, tokenizer: str, cache: Path, **kw: object) -> ConversationDataModule:
    dm = ConversationDataModule(chat_file, total_seq_len=ROW, tokenizer=tokenizer, cache_dir=str(cache), **kw)
    dm.prepare_data()
    return dm


def epoch_batches(dm: ConversationDataModule) -> list[dict]:
    dm.setup("fit")
    return list(dm.train_dataloader())


def conversations_of(batch: dict, row: int) -> list[tuple[list[int], list[int], list[int]]]:
    """``(ids, labels, positions)`` of each conversation of a packed row, in order."""
    documents = batch["document_ids"][row]
    out = []
    for d in range(int(documents.max()) + 1):
        at = documents == d
        out.append(tuple(batch[k][row][at].tolist() for k in ("input_ids", "labels", "position_ids")))
    return out


@pytest.mark.parametrize("template", ["plain", "marked"])
def test_labels_are_the_next_assistant_token_checked_token_by_token_and_never_cross_a_conversation(
    tmp_path: Path, chats, chat_file: str, template: str
) -> None:
    tokenizer = chat_tokenizer(tmp_path / "tokenizer", PLAIN if template == "plain" else MARKED)
    by_ids = {tuple(by_hand(turns, tokenizer)[0]): by_hand(turns, tokenizer) for turns in chats}
    dm = datamodule(chat_file, tokenizer, tmp_path / "cache", batch_size=2)
    seen = []
    for batch in epoch_batches(dm):
        for row in range(batch["input_ids"].shape[0]):
            filled = int((batch["document_ids"][row] >= 0).sum())
            assert (batch["labels"][row, filled:] == -100).all() and (batch["input_ids"][row, filled:] == 0).all()
            for ids, labels, positions in conversations_of(batch, row):
                expected_ids, mask = by_ids[tuple(ids)]
                expected = [expected_ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
                assert labels == expected and positions == list(range(len(ids)))
                seen.append(tuple(ids))
    # One pass here: the packed rows of an epoch hold each conversation once.
    assert len(seen) == len(set(seen)) <= len(by_ids)


def test_cu_seqlens_are_the_flattened_offsets_of_conversations_and_padding(
    chat_file: str, tokenizer: str, tmp_path: Path
) -> None:
    dm = datamodule(chat_file, tokenizer, tmp_path / "cache", batch_size=3)
    for batch in epoch_batches(dm)[:5]:
        documents = batch["document_ids"].flatten()
        starts = [0] + [i for i in range(1, len(documents)) if documents[i] != documents[i - 1] or i % ROW == 0]
        expected = [*starts, len(documents)]
        count = batch["num_sequences"]
        assert batch["cu_seqlens"][: count + 1].tolist() == expected
        assert (batch["cu_seqlens"][count:] == len(documents)).all() and batch["cu_seqlens"].dtype == torch.int32
        assert batch["max_seqlen"] == int(np.diff(expected).max())


def test_train_on_prompt_and_system_prompt(chat_file: str, tokenizer: str, tmp_path: Path) -> None:
    dm = datamodule(chat_file, tokenizer, tmp_path / "cache", train_on_prompt=True, system_prompt="be brief")
    system, end = 1 + MARKERS.index("<|system|>"), 1 + MARKERS.index("<|end|>")
    for ids, labels, _ in conversations_of(epoch_batches(dm)[0], 0):
        assert ids[:4] == [system, 5 + WORDS.index("be"), 5 + WORDS.index("brief"), end]
        assert labels == [*ids[1:], -100]  # every next token of the conversation


def test_a_longer_conversation_is_truncated_or_dropped_and_counted(tokenizer: str, tmp_path: Path) -> None:
    chat_file = write_sharegpt(tmp_path / "long.jsonl", [[("human", "hi"), ("gpt", " ".join(WORDS))], *SHAREGPT[1:3]])
    cut = datamodule(chat_file, tokenizer, tmp_path / "cache", max_length=10)
    lengths = [
        len(ids)
        for batch in epoch_batches(cut)
        for r in range(len(batch["input_ids"]))
        for ids, _, _ in conversations_of(batch, r)
    ]
    assert max(lengths) == 10 and cut._train.packed.truncated == 1
    dropped = datamodule(chat_file, tokenizer, tmp_path / "cache", max_length=10, over_long="drop")
    dropped.setup("fit")
    assert dropped._train.packed.dropped == 1 and dropped.packing()["conversations"] == 2


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tokenizer": None}, "give a tokenizer with a chat template"),
        ({"max_length": 64}, "max_length=64 is longer than a row"),
        ({"over_long": "cut"}, "over_long must be one of"),
        ({"attention_mask": "2d"}, "attention_mask must be one of"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "leave no training data"),
    ],
)
def test_bad_settings_are_refused_with_the_value(chat_file: str, tokenizer: str, tmp_path: Path, kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        datamodule(chat_file, kw.pop("tokenizer", tokenizer), tmp_path / "cache", **kw).setup("fit")


def test_a_chat_template_is_given_as_its_text_or_as_a_file_and_a_mistyped_file_is_refused(
    chat_file: str, chats, tmp_path: Path
) -> None:
    bare = chat_tokenizer(tmp_path / "bare", template="")
    long = PLAIN + "{# " + "a template longer than a file name may be " * 8 + "#}"
    (tmp_path / "chat.jinja").write_text(long)
    expected = {tuple(by_hand(turns, bare)[0]) for turns in chats}
    for template in (long, str(tmp_path / "chat.jinja")):
        dm = datamodule(chat_file, bare, tmp_path / "cache", chat_template=template)
        seen = {
            tuple(ids)
            for b in epoch_batches(dm)
            for r in range(len(b["input_ids"]))
            for ids, _, _ in conversations_of(b, r)
        }
        assert seen == expected
    with pytest.raises(ValueError, match=r"chat_template '.*/chat.jinj' is no file, nor a Jinja template"):
        ConversationDataModule(chat_file, total_seq_len=ROW, tokenizer=bare, chat_template=str(tmp_path / "chat.jinj"))


def test_a_tokenizer_without_a_chat_template_names_the_keyword(chat_file: str, tmp_path: Path) -> None:
    bare = chat_tokenizer(tmp_path / "bare", template="")
    with pytest.raises(ValueError, match=r"has no chat template; give one with chat_template \("):
        datamodule(chat_file, bare, tmp_path / "cache")


def test_a_prepared_folder_is_read_as_it_is_and_validation_is_held_out(
    chat_file: str, tokenizer: str, tmp_path: Path
) -> None:
    dm = datamodule(chat_file, tokenizer, tmp_path / "cache", val_fraction=0.2)
    dm.setup("fit")
    prepared = str(dm.source.cache_path(None))
    again = ConversationDataModule(prepared, total_seq_len=ROW, val_fraction=0.2)  # no tokenizer needed
    again.setup("fit")
    assert again._train.fingerprint == dm._train.fingerprint
    train = {
        tuple(ids)
        for b in epoch_batches(dm)
        for r in range(len(b["input_ids"]))
        for ids, _, _ in conversations_of(b, r)
    }
    held = {
        tuple(ids)
        for b in dm.val_dataloader()
        for r in range(len(b["input_ids"]))
        for ids, _, _ in conversations_of(b, r)
    }
    assert held and not train & held


def fit(
    dm: ConversationDataModule, max_steps: int, ckpt_dir: Path | None = None, resume: Path | None = None
) -> list[dict]:
    model = RecordingModel()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1)] if ckpt_dir else []
    quiet_trainer(max_steps=max_steps, callbacks=callbacks).fit(model, datamodule=dm, ckpt_path=resume)
    return model.records


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_run_trains_the_same_rows_as_an_uninterrupted_one(
    chat_file: str, tokenizer: str, tmp_path: Path, workers: int
) -> None:
    make = lambda: datamodule(chat_file, tokenizer, tmp_path / "cache", batch_size=2, num_workers=workers)  # noqa: E731
    whole = fit(make(), 20)  # past a pass: rows are packed afresh
    fit(make(), 6, ckpt_dir=tmp_path / "ckpt")
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=4.ckpt")
    resumed = fit(make(), 20, resume=checkpoint)
    assert [r["digest"] for r in resumed] == [r["digest"] for r in whole[4:]]


def planned(dm: ConversationDataModule, positions: int) -> Counter:
    """Digests of the conversations the plan puts at positions ``[0, positions)``."""
    dm.setup("fit")
    dm.train_dataloader()
    _, indices, passes = dm.plan.locate_in_passes(np.arange(positions))
    span, tokens = dm._train.packed_rows(indices, passes)
    return Counter(row_digest(torch.tensor(tokens[row]["input_ids"])) for rows in span for row in rows)


def train_ddp(chat_file: str, tokenizer: str, root: Path, devices: int, **kw: object):
    args = ["--conversations", chat_file, "--tokenizer", tokenizer, "--cache-dir", str(root.parent / "cache")]
    args += ["--seq-len", str(ROW), "--batch-size", "2", "--workers", "2", "--devices", str(devices)]
    args += ["--strategy", "ddp" if devices > 1 else "auto"]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return train_record(args, root)


def test_two_ddp_ranks_with_two_workers_train_each_conversation_once_per_pass_and_resume_on_one(
    chat_file: str, tokenizer: str, chats, tmp_path: Path
) -> None:
    reference = datamodule(chat_file, tokenizer, tmp_path / "cache")
    reference.setup("fit")
    rows = len(reference._train)
    one_pass = planned(reference, rows)
    assert sum(one_pass.values()) == len(one_pass) == reference.packing()["conversations"]  # each once per pass
    run = train_ddp(chat_file, tokenizer, tmp_path / "two", devices=2, max_epochs=1)
    steps = rows // 4
    assert len(run.records(0)) == len(run.records(1)) == steps
    assert Counter(run.rows(0) + run.rows(1)) == planned(reference, steps * 4)
    # Elastic: 2 ranks to step 3, then 1 rank to the epoch's end: each planned position trained once.
    stopped = train_ddp(chat_file, tokenizer, tmp_path / "stop", devices=2, max_steps=4, every_n_steps=3)
    resumed = train_ddp(chat_file, tokenizer, tmp_path / "one", devices=1, max_epochs=1, resume=stopped.checkpoint(3))
    trained = stopped.rows(0, before_step=3) + stopped.rows(1, before_step=3) + resumed.rows(0)
    assert Counter(trained) == planned(reference, resumed.info(0)["positions_consumed"])


def test_conversation_sources_mix_by_weight_and_follow_a_phase(tokenizer: str, tmp_path: Path) -> None:
    files = {
        name: write_sharegpt(tmp_path / f"{name}.jsonl", random_chats(60, seed=i, words=(1, 5)))
        for i, name in enumerate("ab")
    }
    sources = [
        MixtureComponent(name, 0.5, ConversationSource(path, tokenizer, cache_dir=str(tmp_path / "cache")))
        for name, path in files.items()
    ]
    dm = MixtureDataModule(sources, seq_len=ROW, batch_size=4)
    phase = PhaseScheduler([{"start_step": 5, "dataset_weights": {"a": 1.0, "b": 0.0}}])
    fit_model = RecordingModel()
    quiet_trainer(max_steps=10, callbacks=[phase]).fit(fit_model, datamodule=dm)
    names = {row_digest(torch.tensor(ids)): name for name, path in files.items() for ids in _prepared_ids(dm, name)}
    per_step = [Counter(names[d] for d in r["rows"]) for r in fit_model.records]
    assert all(c["b"] > 0 for c in per_step[:5]) and all(c["b"] == 0 and c["a"] > 0 for c in per_step[5:])


def _prepared_ids(dm: MixtureDataModule, name: str) -> list[list[int]]:
    import datasets

    (component,) = [c for c in dm.components if c.name == name]
    return datasets.load_from_disk(str(component.source.cache_path(None)))["input_ids"]


class PackedVersusSeparate(LightningModule):
    """A tiny random Llama; each step records the loss of the packed rows (``position_ids``, no
    attention mask, or the batch's block mask) and the loss of their conversations run one by one."""

    def __init__(self, vocab_size: int, use_mask: bool) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=ROW, attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(0)
        self.llama = LlamaForCausalLM(config)
        self.use_mask = use_mask
        self.losses: list[tuple[float, float]] = []

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        mask = batch["attention_mask"] if self.use_mask else None
        # No cache: with one, transformers does not look for packed sequences in the position ids.
        ids, positions = batch["input_ids"], batch["position_ids"]
        logits = self.llama(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
        packed = self._loss(logits, batch["labels"])
        with torch.no_grad():
            separate = torch.zeros(())
            for row in range(batch["input_ids"].shape[0]):
                for ids, labels, _ in conversations_of(batch, row):
                    alone = self.llama(input_ids=torch.tensor([ids]), use_cache=False).logits
                    separate += self._loss(alone, torch.tensor([labels]))
        self.losses.append((packed.item(), separate.item()))
        return packed / (batch["labels"] != -100).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("attention_mask", ["none", "block"])
def test_a_tiny_llama_gives_the_same_loss_on_a_packed_row_as_on_its_conversations_one_by_one(
    chat_file: str, tokenizer: str, tmp_path: Path, attention_mask: str
) -> None:
    dm = datamodule(chat_file, tokenizer, tmp_path / "cache", batch_size=2, attention_mask=attention_mask)
    model = PackedVersusSeparate(vocab_size=5 + len(WORDS), use_mask=attention_mask == "block")
    quiet_trainer(max_steps=4).fit(model, datamodule=dm)
    assert len(model.losses) == 4
    for packed, separate in model.losses:
        assert packed == pytest.approx(separate, rel=1e-5)


def test_validation_and_test_splits_of_a_saved_datasetdict(tokenizer: str, tmp_path: Path) -> None:
    import datasets

    def split(chats: list) -> datasets.Dataset:
        return datasets.Dataset.from_list(
            [{"messages": [{"role": ROLE.get(r, r), "content": t} for r, t in c]} for c in chats]
        )

    parts = {"train": random_chats(30, seed=1, words=(1, 5)), "validation": random_chats(7, seed=2, words=(1, 5))}
    parts["test"] = random_chats(5, seed=3, words=(1, 5))
    datasets.DatasetDict({name: split(chats) for name, chats in parts.items()}).save_to_disk(str(tmp_path / "dict"))
    dm = datamodule(str(tmp_path / "dict"), tokenizer, tmp_path / "cache", val_split="validation", test_split="test")
    dm.setup("fit")

    def held(loader) -> Counter:
        return Counter(
            tuple(ids) for b in loader for r in range(len(b["input_ids"])) for ids, _, _ in conversations_of(b, r)
        )

    expected = {name: Counter(tuple(by_hand(c, tokenizer)[0]) for c in chats) for name, chats in parts.items()}
    assert held(dm.val_dataloader()) == expected["validation"]
    assert held(dm.test_dataloader()) == expected["test"]
    assert (
        sum(held(epoch_batches(dm)).values()) <= len(parts["train"])
        and not held(epoch_batches(dm)) & expected["validation"]
    )


def test_a_prepared_folder_whose_rows_disagree_with_seq_len_is_refused_naming_the_row(tmp_path: Path) -> None:
    import datasets

    rows = {"input_ids": [[5, 6, 7], [5, 6, 7, 8]], "loss_mask": [[0, 1, 1], [0, 1, 1]], "seq_len": [3, 4]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "prepared"))
    with pytest.raises(ValueError, match=r"row 1 has seq_len 4 but 3 loss_mask \(1 such rows\)"):
        ConversationDataModule(str(tmp_path / "prepared"), total_seq_len=ROW).setup("fit")
