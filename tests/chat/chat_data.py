"""Chats whose rendering is written out by hand: a word-level tokenizer (one token per word or marker)
and a chat template rendering a turn as ``<|role|> words <|end|>``, with or without ``{% generation %}``."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = "be brief hi there hello you how are fine thanks bye one two three four five six seven eight".split()
PLAIN = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} "
    "<|end|>{% endgeneration %} {% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
# A template that renders a content given as a list of parts, as multimodal templates do: each text part's
# text, and any other part as ``<|its type|>``.
LISTS = PLAIN.replace(
    "{{ m['content'] }}",
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }} {% else %}<|{{ p['type'] }}|> {% endif %}{% endfor %}{% endif %}",
)
SHAREGPT = [
    [("system", "be brief"), ("human", "hi there"), ("gpt", "hello you"), ("human", "how are you"), ("gpt", "fine")],
    [("gpt", "hello"), ("human", "hi"), ("gpt", "bye")],  # opens with an assistant turn
    [("human", "hi"), ("gpt", "hello"), ("human", "bye")],  # ends with a user turn
    [("human", "hi there")],  # no assistant turn: dropped
]
ROLE = {"human": "user", "gpt": "assistant"}


def chat_tokenizer(directory: Path, template: str = PLAIN) -> str:
    """The word-level tokenizer with ``template``, saved in ``directory``."""
    vocab = {token: i for i, token in enumerate(["<unk>", *MARKERS, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", additional_special_tokens=MARKERS)
    fast.chat_template = template
    fast.save_pretrained(directory)
    return str(directory)


def by_hand(turns: list[tuple[str, str]], tokenizer: str) -> tuple[list[int], list[int]]:
    """Ids and mask of the rendering, turn by turn: an assistant turn's words and its <|end|> take loss."""
    vocab = PreTrainedTokenizerFast.from_pretrained(tokenizer).get_vocab()
    ids, mask = [], []
    for role, text in turns:
        role = ROLE.get(role, role)
        words = [f"<|{role}|>", *text.split(), "<|end|>"]
        ids += [vocab[w] for w in words]
        mask += [0] + [int(role == "assistant")] * (len(words) - 1)
    return ids, mask


def random_chats(count: int, seed: int = 0, words: tuple[int, int] = (1, 8)) -> list[list[tuple[str, str]]]:
    """``count`` ShareGPT conversations of 2-6 turns, alternating human and gpt, of random words."""
    rng = random.Random(seed)
    return [
        [
            ("human" if j % 2 == 0 else "gpt", " ".join(rng.choices(WORDS, k=rng.randint(*words))))
            for j in range(rng.randint(2, 6))
        ]
        for _ in range(count)
    ]


def write_rows(path: Path, rows: list[dict]) -> str:
    """``rows`` as a JSON-lines file."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_sharegpt(path: Path, chats: list[list[tuple[str, str]]]) -> str:
    return write_rows(path, [{"conversations": [{"from": r, "value": t} for r, t in chat]} for chat in chats])
