"""Interleaved documents per second out of ``ImageTextDataModule(layout="obelics")`` against a
``transformers`` processor's own call in a plain ``DataLoader``, on the same documents in one run.

Documents: ``--documents`` OBELICS rows, each 1 to 6 photo-like 640x480 JPEGs (drawn from a pool of
``--distinct-images``) between paragraphs of 40 to 120 words, saved with ``save_to_disk`` (images in
the rows). Both sides make model-ready inputs of one shape: 224-pixel images and 64 placeholders an
image (a LLaVA processor made from a config: CLIP's image processor, patch 28, our tokenizer), the
document rendered with the image token at each image's place, tokenized and widened.

- ours: the DataModule's ``train_dataloader()``, images through our resize (PIL ``draft()`` where a
  JPEG allows), uint8 out of the workers, normalized in the main process (``on_after_batch_transfer``,
  timed: what a CPU run pays; on a GPU it is the device's);
- the processor: a map-style ``Dataset`` whose ``__getitem__`` decodes the row's images with PIL and
  calls ``processor(text=..., images=...)``, batches padded to ``max_text_len``, in a ``DataLoader``.

Each at ``num_workers`` 0 and 2, alternating rounds, medians; torch on one thread a process:
``python -m benchmarks.interleaved``. Packing documents by a token budget is not built yet: this
measures one document a row.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import time
from pathlib import Path
from typing import Any

import datasets
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

from benchmarks.common import add_run_arguments, data_directory, report, results_directory
from benchmarks.image_text import photo
from benchmarks.loader_throughput import endless
from datamodules import ImageTextDataModule
from examples.default_images import train_caption_tokenizer

IMAGE_TOKEN, IMAGE_SIZE, PATCH, MAX_TEXT_LEN, BATCH = "<image>", 224, 28, 2048, 8
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
WORDS = "the a picture of shows near over under blue red green sky tree house road river city page text".split()
COLUMNS = ["loader", "num_workers", "documents/s", "images/s", "x processor", "note"]
GOAL = 1.5


def write_documents(directory: Path, count: int, distinct: int, seed: int = 0) -> tuple[Path, Path, int]:
    """The saved OBELICS rows, a tokenizer of their words, and the images they hold in all."""
    rng = random.Random(seed)
    pool = []
    for i in range(distinct):
        buffer = io.BytesIO()
        photo(i, (640, 480)).save(buffer, "JPEG", quality=90)
        pool.append(buffer.getvalue())
    texts, images, total = [], [], 0
    for _ in range(count):
        doc_texts, doc_images = [], []
        for _ in range(rng.randint(1, 6)):
            paragraph = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
            doc_texts += [paragraph, None]
            doc_images += [None, {"bytes": pool[rng.randrange(distinct)], "path": None}]
            total += 1
        texts.append(doc_texts)
        images.append(doc_images)
    features = datasets.Features(
        {"texts": datasets.Sequence(datasets.Value("string")), "images": datasets.Sequence(datasets.Image())}
    )
    datasets.Dataset.from_dict({"texts": texts, "images": images}, features=features).save_to_disk(directory / "docs")
    tokenizer = train_caption_tokenizer([" ".join(WORDS)] * 10, directory / "tokenizer")
    return directory / "docs", tokenizer, total


def llava(directory: Path, tokenizer: Path) -> Path:
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        ),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer),
        patch_size=PATCH,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
    )
    processor.save_pretrained(directory / "processor")
    return directory / "processor"


def rendered(texts: list[str | None]) -> str:
    return "".join(IMAGE_TOKEN if text is None else text for text in texts)


class ProcessorDocuments(Dataset):
    """The plain way: each document decoded and processed by the processor's own call."""

    def __init__(self, path: Path, processor: Path) -> None:
        self.rows = datasets.load_from_disk(str(path)).cast_column(
            "images", datasets.Sequence(datasets.Image(decode=False))
        )
        self.processor_path, self.processor = processor, None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.processor is None:
            self.processor = LlavaProcessor.from_pretrained(self.processor_path)
        row = self.rows[i]
        images = [Image.open(io.BytesIO(v["bytes"])).convert("RGB") for v in row["images"] if v is not None]
        out = self.processor(text=rendered(row["texts"]), images=images, return_tensors="pt")
        return {"input_ids": out["input_ids"][0][:MAX_TEXT_LEN], "pixel_values": out["pixel_values"]}


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(items), MAX_TEXT_LEN, dtype=torch.int64)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
    return {"input_ids": ids, "pixel_values": torch.cat([item["pixel_values"] for item in items])}


def rate(batches: Any, warmup: int, seconds: float, per_batch: Any) -> tuple[float, float]:
    """Documents/s and images/s over ``seconds`` after ``warmup`` batches."""
    for _ in range(warmup):
        next(batches)
    documents = images = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = per_batch(next(batches))
        documents += len(batch["input_ids"])
        images += len(batch["pixel_values"])
    elapsed = time.perf_counter() - start
    return documents / elapsed, images / elapsed


def measure_ours(path: Path, tokenizer: Path, workers: int, warmup: int, seconds: float) -> tuple[float, float]:
    dm = ImageTextDataModule(
        str(path), tokenizer=str(tokenizer), layout="obelics", text_field="texts", image_field="images",
        image_token=IMAGE_TOKEN, num_image_tokens=NUM_IMAGE_TOKENS, image_size=IMAGE_SIZE, max_images=8,
        max_text_len=MAX_TEXT_LEN, batch_size=BATCH, num_workers=workers, separator="",
    )  # fmt: skip
    dm.setup("fit")
    return rate(endless(dm.train_dataloader), warmup, seconds, lambda b: dm.on_after_batch_transfer(b, 0))


def measure_ours_processor(
    path: Path, processor: Path, workers: int, warmup: int, seconds: float
) -> tuple[float, float]:
    """Ours with the processor making the pixels (its image processor on a document's decoded images)."""
    dm = ImageTextDataModule(
        str(path), processor=str(processor), layout="obelics", text_field="texts", image_field="images",
        max_images=8, max_text_len=MAX_TEXT_LEN, batch_size=BATCH, num_workers=workers, separator="",
    )  # fmt: skip
    dm.setup("fit")
    return rate(endless(dm.train_dataloader), warmup, seconds, lambda b: dm.on_after_batch_transfer(b, 0))


def measure_processor(path: Path, processor: Path, workers: int, warmup: int, seconds: float) -> tuple[float, float]:
    loader = lambda: DataLoader(  # noqa: E731
        ProcessorDocuments(path, processor), batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=collate
    )
    return rate(endless(loader), warmup, seconds, lambda b: b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=600)
    parser.add_argument("--distinct-images", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0, help="timed per measurement")
    parser.add_argument("--warmup", type=int, default=4, help="untimed batches first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.documents, args.distinct_images, args.seconds, args.warmup, args.rounds = 24, 6, 1.0, 1, 1
    torch.set_num_threads(1)
    started = time.perf_counter()
    with data_directory(args.data_dir) as directory:
        path, tokenizer, images = write_documents(directory, args.documents, args.distinct_images)
        processor = llava(directory, tokenizer)
        print(f"{args.documents} documents, {images} images; measuring", flush=True)
        runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for round_ in range(args.rounds):
            for workers in args.workers:
                contenders = [
                    ("ours", measure_ours, tokenizer),
                    ("ours, processor's pixels", measure_ours_processor, processor),
                    ("processor", measure_processor, processor),
                ]
                for name, measure, with_ in contenders[round_ % 3 :] + contenders[: round_ % 3]:
                    result = measure(path, with_, workers, args.warmup, args.seconds)
                    runs.setdefault((name, workers), []).append(result)
                    print(f"round {round_}: {name}, {workers} workers: {result[0]:.1f} documents/s", flush=True)
    rows, checks = [], {}
    for workers in args.workers:
        theirs = statistics.median(d for d, _ in runs["processor", workers])
        notes = {
            "ours": "our resize (PIL draft where a JPEG allows), uint8 from the workers, normalized in-process",
            "ours, processor's pixels": "the processor's image processor on a document's images: its pixels",
            "processor": "processor(text=..., images=...) in a map-style Dataset",
        }
        for name, note in notes.items():
            docs = statistics.median(d for d, _ in runs[name, workers])
            imgs = statistics.median(i for _, i in runs[name, workers])
            rows.append({"loader": name, "num_workers": workers, "documents/s": docs, "images/s": imgs,
                         "x processor": docs / theirs, "note": note})  # fmt: skip
        if workers == 2:
            ours = statistics.median(d for d, _ in runs["ours", 2])
            checks[f"ours at 2 workers at least {GOAL}x the processor in a plain DataLoader"] = ours / theirs >= GOAL
    report(
        "interleaved",
        {
            f"Interleaved documents (1-6 JPEGs 640x480 each, to {IMAGE_SIZE} px, {NUM_IMAGE_TOKENS} placeholders an "
            f"image, rows of {MAX_TEXT_LEN} tokens, batch {BATCH}; medians of {args.rounds} rounds)": (COLUMNS, rows)
        },
        config={
            "documents": args.documents,
            "images": images,
            "distinct images": args.distinct_images,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "quick": args.quick,
            "wall s": round(time.perf_counter() - started),
        },  # fmt: skip
        checks=checks,
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
