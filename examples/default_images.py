"""The embedded default image-text corpus: pictures of coloured shapes with their captions, drawn
locally (an ``imagefolder`` with ``metadata.jsonl``), and a tokenizer for them."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

from PIL import Image, ImageDraw
from transformers import PreTrainedTokenizerFast

from examples.default_corpus import byte_level_bpe

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 205, 40)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "grey": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
PROMPT = "What is in the picture?"
SPECIAL_TOKENS = {"eos_token": "<eos>", "pad_token": "<pad>", "image_token": "<image>"}


def draw_shape(shape: str, color: str, background: str, size: tuple[int, int], rng: random.Random) -> Image.Image:
    """One picture: ``shape`` in ``color`` on ``background``, at a random place and scale."""
    image = Image.new("RGB", size, BACKGROUNDS[background])
    w, h = size
    side = rng.randint(min(w, h) // 3, min(w, h) * 2 // 3)
    x, y = rng.randint(0, w - side), rng.randint(0, h - side)
    box = (x, y, x + side, y + side)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=COLORS[color])
    return image


def write_shape_images(directory: Path, count: int, size: tuple[int, int] = (96, 72), seed: int = 0) -> Path:
    """``count`` pictures (PNG and JPEG in turn) and their ``metadata.jsonl`` (``text``, ``prompt``)."""
    if (directory / "metadata.jsonl").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        shape, color, background = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.choice(list(BACKGROUNDS))
        name = f"{i:05d}.{'png' if i % 2 else 'jpg'}"
        draw_shape(shape, color, background, size, rng).save(directory / name)
        rows.append({"file_name": name, "text": f"a {color} {shape} on a {background} background", "prompt": PROMPT})
    (directory / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def train_caption_tokenizer(texts: list[str], directory: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer of ``texts`` with EOS, pad and image tokens, saved as a
    ``PreTrainedTokenizerFast``."""
    if (directory / "tokenizer.json").exists():
        return directory
    tokenizer, trainer = byte_level_bpe(vocab_size, list(SPECIAL_TOKENS.values()))
    tokenizer.train_from_iterator(texts, trainer)
    image_token = SPECIAL_TOKENS["image_token"]
    specials = {k: v for k, v in SPECIAL_TOKENS.items() if k != "image_token"}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, **specials, extra_special_tokens={"image_token": image_token}
    )
    fast.save_pretrained(directory)
    return directory


def write_tar_shards(folder: Path, out: Path, shards: int, prefix: str = "") -> list[Path]:
    """The imagefolder ``folder``'s rows as WebDataset tar shards ``out/{prefix}00000.tar``, ...: each
    sample its image under its own extension, ``.txt`` (the ``text``) and, when the rows hold more,
    ``.json`` (the rest, e.g. ``prompt``). Kept if they are there already."""
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    per = -(-len(rows) // shards)
    paths = [out / f"{prefix}{i:05d}.tar" for i in range(shards)]
    if all(p.exists() for p in paths):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    for number, path in enumerate(paths):
        with tarfile.open(path, "w") as tar:
            for row in rows[number * per : (number + 1) * per]:
                key, extension = row["file_name"].rsplit(".", 1)
                members = [(f"{key}.{extension}", (folder / row["file_name"]).read_bytes())]
                members.append((f"{key}.txt", row["text"].encode()))
                rest = {k: v for k, v in row.items() if k not in ("file_name", "text")}
                if rest:
                    members.append((f"{key}.json", json.dumps(rest).encode()))
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return paths


def write_shape_documents(images: Path, out: Path, count: int, seed: int = 0) -> Path:
    """``count`` interleaved documents (OBELICS rows: ``texts`` and ``images`` lists, one set at each
    position) of 1 to 4 of ``images``' pictures, each followed by its caption, saved with
    ``save_to_disk``; the pictures are held in the rows (no path to break when the folder moves)."""
    import datasets

    if (out / "dataset_info.json").exists():
        return out
    rows = [json.loads(line) for line in (images / "metadata.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    texts, pictures = [], []
    for _ in range(count):
        doc_texts, doc_images = ["a page of shapes:"], [None]
        for row in rng.sample(rows, rng.randint(1, 4)):
            doc_texts += [None, row["text"]]
            doc_images += [{"bytes": (images / row["file_name"]).read_bytes(), "path": None}, None]
        texts.append(doc_texts)
        pictures.append(doc_images)
    features = datasets.Features(
        {"texts": datasets.Sequence(datasets.Value("string")), "images": datasets.Sequence(datasets.Image())}
    )
    datasets.Dataset.from_dict({"texts": texts, "images": pictures}, features=features).save_to_disk(str(out))
    return out


def build_default_images(workdir: Path, count: int = 2000) -> tuple[Path, Path]:
    """The quickstart's image folder (also as 4 WebDataset tar shards in ``shapes_shards``, and as
    interleaved documents in ``shape_documents``) and its tokenizer, under ``workdir``."""
    images = write_shape_images(workdir / "shapes", count)
    write_tar_shards(images, workdir / "shapes_shards", 4, prefix="shapes-")
    write_shape_documents(images, workdir / "shape_documents", count // 2)
    rows = [json.loads(line) for line in (images / "metadata.jsonl").read_text().splitlines()]
    texts = [f"{r['prompt']} {r['text']}" for r in rows] + ["a page of shapes:"]
    tokenizer = train_caption_tokenizer(texts, workdir / "caption_tokenizer")
    return images, tokenizer
