"""Conversations to training rows: chat template, assistant-only loss mask, formats, truncation, safety.

The reference is a hand rendering: a word-level tokenizer (one token per word or marker) and a chat
template whose rendering of a turn is ``<|role|> words <|end|>``, so the expected ids and mask are
written out turn by turn.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import datasets
import pytest
from transformers import PreTrainedTokenizerFast

from datamodules import HiddenStatesDataModule
from datamodules.chat.prepare_conversations import (
    ConversationError,
    ConversationTokenizer,
    main,
    messages_of,
    prepare_conversations,
)
from datamodules.speculative.generate import generate_hidden_states
from examples.tiny_draft import TinyDraft
from tests.chat.chat_data import (
    LISTS,
    MARKED,
    PLAIN,
    SHAREGPT,
    by_hand,
    chat_tokenizer,
    random_chats,
    write_rows,
)
from tests.speculative.speculative_data import HIDDEN, tiny_verifier
from tests.support import quiet_trainer

OPENAI = [
    [("user", "hi"), ("assistant", "one two three four five six seven eight")],  # truncated at 12 tokens
    [("system", "be brief"), ("user", "hi"), ("assistant", "fine thanks")],
]


@pytest.fixture(scope="module", params=["plain", "marked"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp(f"tokenizer_{request.param}")
    return chat_tokenizer(path, PLAIN if request.param == "plain" else MARKED)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("conversations")
    sharegpt, openai = root / "sharegpt.jsonl", root / "openai.json"
    rows = [{"conversations": [{"from": r, "value": t} for r, t in c]} for c in SHAREGPT]
    sharegpt.write_text("".join(json.dumps(row) + "\n" for row in rows))
    openai.write_text(json.dumps([{"messages": [{"role": r, "content": t} for r, t in c]} for c in OPENAI]))
    return [str(sharegpt), str(openai)]


def test_both_formats_render_with_the_assistant_mask_token_by_token(
    inputs: list[str], tokenizer: str, tmp_path: Path
) -> None:
    counts = prepare_conversations(inputs[:1], tokenizer, str(tmp_path / "a"))
    rows = datasets.load_from_disk(str(tmp_path / "a"))
    assert counts["dropped_no_assistant"] == 1 and counts["conversations"] == 3 == len(rows)
    for row, turns in zip(rows, SHAREGPT[:3], strict=True):
        assert (row["input_ids"], row["loss_mask"]) == by_hand(turns, tokenizer)
        assert row["seq_len"] == len(row["input_ids"])
    prepare_conversations(inputs[1:], tokenizer, str(tmp_path / "b"), max_len=12)
    rows = datasets.load_from_disk(str(tmp_path / "b"))
    ids, mask = by_hand(OPENAI[0], tokenizer)
    assert (rows[0]["input_ids"], rows[0]["loss_mask"], rows[0]["seq_len"]) == (ids[:12], mask[:12], 12)
    assert (rows[1]["input_ids"], rows[1]["loss_mask"]) == by_hand(OPENAI[1], tokenizer)


def test_a_rerun_returns_at_once_and_another_corpus_is_refused_unless_overwritten(
    inputs: list[str], tokenizer: str, tmp_path: Path
) -> None:
    out = str(tmp_path / "out")
    first = prepare_conversations(inputs, tokenizer, out, num_proc=2)
    assert prepare_conversations(inputs, tokenizer, out) == first
    with pytest.raises(ConversationError, match="prepared from other inputs or settings; pass overwrite=True"):
        prepare_conversations(inputs, tokenizer, out, max_len=5)
    assert prepare_conversations(inputs, tokenizer, out, max_len=5, overwrite=True)["truncated"] >= 1
    assert not list(tmp_path.glob(".*partial*"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.jsonl"], "no such input file 'missing.jsonl'"),
        (["{sharegpt}", "--chat-template", "missing.jinja"], r"--chat-template 'missing.jinja' is no file, nor a"),
    ],
)
def test_bad_input_is_one_line(
    inputs: list[str], tokenizer: str, tmp_path: Path, argv: list[str], message: str, capsys
) -> None:
    argv = [a.format(sharegpt=inputs[0]) for a in argv]
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--tokenizer", tokenizer, "--output", str(tmp_path / "out")])


def chat(*turns: tuple[str, object]) -> dict:
    """An OpenAI row of ``(role, content)`` turns."""
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


GOOD = chat(("user", "hi"), ("assistant", "fine"))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ([{"type": "text", "text": "two"}, {"type": "text", "text": "three"}], "two\nthree"),  # OpenAI's parts
        (["two", "three"], "two\nthree"),
        ([{"type": "output_text", "text": "two three"}], "two three"),  # the responses API's
    ],
)
def test_content_parts_train_as_their_texts_joined_by_a_newline(
    tokenizer: str, tmp_path: Path, content: list, expected: str
) -> None:
    data = write_rows(
        tmp_path / "parts.jsonl", [GOOD, chat(("user", [{"type": "text", "text": "hi"}]), ("assistant", content))]
    )
    prepare_conversations(data, tokenizer, str(tmp_path / "out"))
    rows = datasets.load_from_disk(str(tmp_path / "out"))
    assert (rows[1]["input_ids"], rows[1]["loss_mask"]) == by_hand(
        [("user", "hi"), ("assistant", "two three")], tokenizer
    )
    # The newline is vLLM's join for a template of text contents (the word-level tokenizer splits on it too).
    assert messages_of(chat(("assistant", content)))[0]["content"] == expected


def test_a_part_that_is_not_text_is_refused_naming_the_row_unless_the_template_renders_lists(tmp_path: Path) -> None:
    picture = chat(("user", [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "a.png"}}]),
                   ("assistant", "fine"))  # fmt: skip
    data = write_rows(tmp_path / "pictures.jsonl", [GOOD, picture])
    with pytest.raises(
        ConversationError, match=r"pictures.jsonl row 1: a content part of type 'image_url' is not text"
    ):
        prepare_conversations(data, chat_tokenizer(tmp_path / "plain", PLAIN), str(tmp_path / "plain_out"))
    lists = chat_tokenizer(tmp_path / "lists", LISTS)
    prepare_conversations(data, lists, str(tmp_path / "out"))
    row = datasets.load_from_disk(str(tmp_path / "out"))[1]
    tokens = PreTrainedTokenizerFast.from_pretrained(lists).convert_ids_to_tokens(row["input_ids"])
    assert tokens == ["<|user|>", "hi", "<unk>", "<|end|>", "<|assistant|>", "fine", "<|end|>"]  # <|image_url|>
    assert row["loss_mask"] == [0, 0, 0, 0, 0, 1, 1]


def test_a_turn_without_content_leaves_its_conversation_out_counted_and_warned(
    tokenizer: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}
    data = write_rows(tmp_path / "nulls.jsonl", [GOOD, chat(("user", "hi"), ("assistant", None)), missing, GOOD])
    with caplog.at_level(logging.WARNING):
        counts = prepare_conversations(data, tokenizer, str(tmp_path / "out"))
    assert counts["conversations"] == 2 and counts["dropped_no_content"] == 2 and counts["dropped_no_assistant"] == 0
    assert [r["input_ids"] for r in datasets.load_from_disk(str(tmp_path / "out"))] == [by_hand(
        [("user", "hi"), ("assistant", "fine")], tokenizer)[0]] * 2  # fmt: skip
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "2 conversations left out" in warning and "the first: " + data + " row 1" in warning


def test_no_conversation_left_is_one_error_with_the_counts(tokenizer: str, tmp_path: Path) -> None:
    data = write_rows(tmp_path / "none.jsonl", [chat(("user", "hi")), chat(("user", "hi"), ("assistant", None))])
    with pytest.raises(
        ConversationError,
        match=r"none.jsonl is left to train on: 1 without an assistant token, 1 with a turn whose content is null",
    ):
        prepare_conversations(data, tokenizer, str(tmp_path / "out"))


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (chat(("robot", "hi")), r"row 1: turn 0: unknown role 'robot'; accepted: \['assistant', 'gpt'"),
        (
            {"messages": [{"from": "human", "value": "hi"}]},
            r"row 1: turn 0 has no 'role': it has \['from', 'value'\]; ShareGPT turns .* go in 'conversations'",
        ),
        (chat(("user", 5), ("assistant", "fine")), "row 1: content must be text or a list of content parts, got 5"),
        ({"text": "hi"}, r"row 1: the row has neither 'messages' nor 'conversations': it has \['text'\]"),
    ],
)
def test_a_malformed_row_is_refused_naming_the_file_and_the_row(
    tokenizer: str, tmp_path: Path, row: dict, message: str
) -> None:
    data = write_rows(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(ConversationError, match="bad.jsonl " + message):
        prepare_conversations(data, tokenizer, str(tmp_path / "out"))


def test_a_malformed_json_line_is_named_by_file_and_line(tokenizer: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD)[:-1] + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ConversationError, match=r"bad.jsonl line 2 is not JSON: .* \(column \d+\)"):
        prepare_conversations(str(bad), tokenizer, str(tmp_path / "out"))


def test_a_message_names_the_option_of_the_interface_that_raised_it(
    inputs: list[str], tokenizer: str, tmp_path: Path
) -> None:
    bare = chat_tokenizer(tmp_path / "bare", template="")
    with pytest.raises(ConversationError, match=r"has no chat template; give one with chat_template \("):
        prepare_conversations(inputs, bare, str(tmp_path / "a"))
    with pytest.raises(SystemExit, match=r"has no chat template; give one with --chat-template \("):
        main([*inputs, "--tokenizer", bare, "--output", str(tmp_path / "a")])
    prepare_conversations(inputs, tokenizer, str(tmp_path / "b"))
    with pytest.raises(ConversationError, match="pass overwrite=True to replace them"):
        prepare_conversations(inputs, tokenizer, str(tmp_path / "b"), max_len=5)
    with pytest.raises(SystemExit, match="pass --overwrite to replace them"):
        main([*inputs, "--tokenizer", tokenizer, "--output", str(tmp_path / "b"), "--max-len", "5"])
    with pytest.raises(SystemExit, match="--max-len must be a positive integer, got 0"):
        main([*inputs, "--tokenizer", tokenizer, "--output", str(tmp_path / "c"), "--max-len", "0"])


def test_prepared_conversations_generate_states_and_train_a_draft(
    inputs: list[str], tokenizer: str, tmp_path: Path
) -> None:
    out = tmp_path / "rows"
    prepare_conversations(inputs, tokenizer, str(out))
    generate_hidden_states(str(out), tiny_verifier(), layers=[1, 2, 3], batch_size=4)
    dm = HiddenStatesDataModule(str(out), total_seq_len=32, train_ratio=0.8, dtype="float32")
    model = TinyDraft(vocab_size=101, verifier_hidden_size=HIDDEN, aux_layers=2)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3 and not dm.bad_samples.reasons


# Templates the per-role-sequence scaffold must agree with, rendering every prefix being the reference:
# the plain one; one trimming contents (not written verbatim); one marking the final turn (loop.last);
# one whose output depends on a content's words.
SCAFFOLD_TEMPLATES = {
    "plain": PLAIN,
    "trimmed": PLAIN.replace("{{ m['content'] }}", "{{ m['content'] | trim }}"),
    "last turn": PLAIN.replace("<|end|> {% endfor %}", "<|end|> {% if loop.last %}<|end|> {% endif %}{% endfor %}"),
    "by content": PLAIN.replace(
        "{{ m['content'] }}", "{{ m['content'] }}{% if 'bye' in m['content'] %} bye{% endif %}"
    ),
}


@pytest.mark.parametrize("template", SCAFFOLD_TEMPLATES)
def test_the_masks_from_a_scaffold_are_those_of_rendering_every_prefix(template: str, tmp_path: Path) -> None:
    tokenizer = ConversationTokenizer(chat_tokenizer(tmp_path, SCAFFOLD_TEMPLATES[template]))
    chats = [messages_of({"conversations": [{"from": r, "value": t} for r, t in chat]}) for chat in random_chats(200)]
    chats += [[{"role": "user", "content": " hi "}, {"role": "assistant", "content": " fine  "}]]  # trimmed away
    chats += [[{"role": r, "content": "hi"} for r in ("assistant", "user", "assistant")]]  # opens with the assistant
    fast = tokenizer(chats)
    slow = ConversationTokenizer(chat_tokenizer(tmp_path / "slow", SCAFFOLD_TEMPLATES[template]))
    slow._scaffolds = defaultdict(lambda: None)  # every conversation rendered prefix by prefix
    assert fast == slow(chats)
    assert sum(m for _, mask in fast for m in mask) > 0
    if template in ("plain", "last turn"):  # templates that write contents verbatim take the scaffold
        assert all(scaffold is not None for scaffold in tokenizer._scaffolds.values())
