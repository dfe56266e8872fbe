"""The embedded default corpus: Python's own standard library source and its pydoc topic texts.

Both ship with every Python, so the quickstart needs no download; a byte-level BPE tokenizer is
trained on them in seconds with ``tokenizers``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, without its test suites and third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts))


def write_pydoc_topics(directory: Path) -> list[Path]:
    """Each pydoc help topic as one ``.txt`` document."""
    from pydoc_data.topics import topics

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in sorted(topics.items()):
        path = directory / f"{name}.txt"
        if not path.exists():
            path.write_text(text)
        paths.append(path)
    return paths


def byte_level_bpe(vocab_size: int, special_tokens: list[str]) -> tuple[Tokenizer, trainers.BpeTrainer]:
    """An untrained byte-level BPE tokenizer and its trainer (``special_tokens`` first in the vocabulary)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    return tokenizer, trainer


def train_tokenizer(files: list[Path], directory: Path, vocab_size: int = 4096) -> Path:
    """A byte-level BPE tokenizer trained on ``files``, saved as a ``PreTrainedTokenizerFast``."""
    if (directory / "tokenizer.json").exists():
        return directory
    tokenizer, trainer = byte_level_bpe(vocab_size, [EOS])
    tokenizer.train([str(f) for f in files], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(directory)
    return directory
