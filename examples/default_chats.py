"""The quickstart's chat fine-tuning data: ShareGPT conversations about the pydoc help topics (a user
asks about a topic, the assistant answers with its text, in one to three exchanges);
``configs/conversations.yaml`` renders them with a chat template of its own."""

from __future__ import annotations

import json
import random
from pathlib import Path

QUESTIONS = [
    "Tell me about {topic}.",
    "What is {topic} in Python?",
    "Explain {topic}, please.",
    "How does {topic} work?",
]
FOLLOW_UPS = ["Go on.", "And then?", "Tell me more."]


def write_default_chats(path: Path, topics: list[Path], count: int = 1000, seed: int = 0) -> Path:
    """``count`` conversations in ``path`` (JSON lines), kept when already there."""
    if path.exists():
        return path
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        topic = rng.choice(topics)
        words = topic.read_text().split()
        turns, at = [{"from": "human", "value": rng.choice(QUESTIONS).format(topic=topic.stem)}], 0
        for exchange in range(rng.randint(1, 3)):
            if exchange:
                turns.append({"from": "human", "value": rng.choice(FOLLOW_UPS)})
            size = rng.randint(10, 60)
            turns.append({"from": "gpt", "value": " ".join(words[at : at + size]) or "That is all."})
            at += size
        rows.append({"conversations": turns})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
