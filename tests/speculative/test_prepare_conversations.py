"""Conversations to training rows: chat template, assistant-only loss mask, formats, truncation, safety.

The reference is a hand rendering: a word-level tokenizer (one token per word or marker) and a chat
template whose rendering of a turn is ``<|role|> words <|end|>``, so the expected ids and mask are
written out turn by turn.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import datasets
import pytest

from datamodules import HiddenStatesDataModule
from datamodules.speculative.generate import generate_hidden_states
from datamodules.speculative.prepare_conversations import (
    ConversationError,
    ConversationTokenizer,
    main,
    messages_of,
    prepare_conversations,
)
from examples.tiny_draft import TinyDraft
from tests.speculative.chat_data import MARKED, PLAIN, SHAREGPT, by_hand, chat_tokenizer, random_chats
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
    with pytest.raises(ConversationError, match="prepared from other inputs or settings; pass --overwrite"):
        prepare_conversations(inputs, tokenizer, out, max_len=5)
    assert prepare_conversations(inputs, tokenizer, out, max_len=5, overwrite=True)["truncated"] >= 1
    assert not list(tmp_path.glob(".*partial*"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.jsonl"], "no such input file 'missing.jsonl'"),
        (["{sharegpt}", "--chat-template", "missing.jinja"], "No such file or directory"),
    ],
)
def test_bad_input_is_one_line(
    inputs: list[str], tokenizer: str, tmp_path: Path, argv: list[str], message: str, capsys
) -> None:
    argv = [a.format(sharegpt=inputs[0]) for a in argv]
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--tokenizer", tokenizer, "--output", str(tmp_path / "out")])


def test_an_unknown_role_is_named(tokenizer: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [{"from": "robot", "value": "hi"}]}) + "\n")
    with pytest.raises(ConversationError, match=r"unknown role 'robot'; accepted: \['assistant', 'gpt'"):
        prepare_conversations([str(bad)], tokenizer, str(tmp_path / "out"))


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
