"""The documentation keeps its promises: every Python block marked runnable in README.md and docs/ runs,
and every relative link in them leads to a file that exists.

A runnable block is a fenced ``python`` block on the line after ``<!-- runnable -->``. It runs in a folder
holding the quickstart's inputs at a small size (the names the examples use: ``shards/``, ``tokenizer/``,
``shapes/``, ...), built once for this module, each block in a namespace of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from datamodules.text.prepare import prepare
from examples.default_chats import write_default_chats
from examples.default_conversations import build_default_conversations
from examples.default_corpus import train_tokenizer, write_pydoc_topics
from examples.default_images import build_default_images
from examples.default_videos import build_default_videos

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def runnable_blocks() -> list:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for found in RUNNABLE.finditer(text):
            line = text.count("\n", 0, found.start()) + 3  # the block's first line of code
            blocks.append(pytest.param(found[1], id=f"{page.relative_to(ROOT)}:{line}"))
    return blocks


@pytest.fixture(scope="module")
def example_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the examples read: ``pydoc_topics/`` and ``tokenizer/``; token shards of the topics in
    ``shards/``, of halves of them in ``web/`` and ``code/``; ``docs.jsonl``; ``shapes/`` (an imagefolder),
    ``shapes_shards/`` (WebDataset) and ``caption_tokenizer/``; ``moving_shapes/`` (clips) and
    ``video_tokenizer/``; ``conversations/`` (rows with hidden states); ``chats.jsonl``."""
    root = tmp_path_factory.mktemp("docs-examples")
    topics = write_pydoc_topics(root / "pydoc_topics")
    tokenizer = str(train_tokenizer(topics, root / "tokenizer"))
    for name, files in {"shards": topics, "web": topics[::2], "code": topics[1::2]}.items():
        prepare([str(f) for f in files], root / name, tokenizer, num_proc=1)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f.read_text()}) + "\n" for f in topics))
    build_default_images(root, count=64)
    build_default_videos(root, count=8)
    build_default_conversations(root, topics, Path(tokenizer), count=32)
    write_default_chats(root / "chats.jsonl", topics, count=64)
    return root


@pytest.mark.parametrize("code", runnable_blocks())
def test_runnable_example(code: str, example_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(example_data)
    exec(compile(code, "<example>", "exec"), {"__name__": "__main__"})


def test_there_are_runnable_examples() -> None:
    assert len(runnable_blocks()) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_lead_to_files(page: Path) -> None:
    prose = FENCED.sub("", page.read_text())
    targets = [target.split("#")[0] for target in LINK.findall(prose) if "://" not in target]
    missing = [target for target in targets if target and not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
