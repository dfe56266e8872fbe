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
``python -m benchmarks.interleaved``.

Packing (second table): ``--packed-documents`` documents with OBELICS's averages (816 text tokens and
2.5 images a document: lognormal text lengths, geometric image counts, at most 30 images), packed
into rows of ``--row-tokens`` tokens, for three image-token rules: 64 a 224-pixel image (LLaVA, patch
28, as above), 576 (LLaVA-1.5, 336 pixels, patch 14), and Qwen2-VL's dynamic count (its own
``smart_resize`` of web-like image sizes, a token per 28 x 28 pixels). Ours packs the documents'
lengths counting each image's tokens (``PackedRows``, as ``InterleavedRows`` does); against packing
by text length alone (the rows then overflow: the share of rows over budget and of tokens a model
would have to cut) and one document a row. Documents longer than a row alone are left out of all
three (counted). The same packing of the real pipeline on the documents above
(``ImageTextDataModule(pack_sequences=True)``) is reported beside it.
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
import numpy as np
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


PACKING_COLUMNS = ["image tokens", "packing", "rows", "token efficiency", "room left empty", "rows over budget",
                   "tokens over budget"]  # fmt: skip
PACKING_GOAL = 0.98


def obelics_like(count: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Text tokens of ``count`` documents and each one's image sizes ``[images, 2]`` (height, width)."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    text = np.maximum(1, rng.lognormal(np.log(816) - sigma**2 / 2, sigma, count)).astype(np.int64)
    images = np.minimum(rng.geometric(1 / 3.5, count) - 1, 30)
    widths = np.clip(rng.lognormal(np.log(800), 0.5, images.sum()), 64, 4000)
    heights = np.clip(widths / rng.uniform(0.5, 2.0, images.sum()), 64, 4000)
    sizes = np.stack([heights, widths], axis=1).astype(np.int64)
    return text, np.split(sizes, np.cumsum(images)[:-1])


def image_tokens(rule: str, sizes: np.ndarray) -> int:
    """Tokens of a document's images under ``rule``."""
    if rule == "qwen2-vl":
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        return sum(h * w // 28**2 for h, w in (smart_resize(int(a), int(b)) for a, b in sizes))
    return int(rule) * len(sizes)


def packing_rows(lengths: np.ndarray, by: np.ndarray, row_tokens: int, rule: str, name: str) -> dict[str, Any]:
    """Rows packed by the lengths ``by``, measured by the documents' true ``lengths``."""
    from datamodules.plan.multipack import PackedRows

    packed = PackedRows(by, row_tokens, seed=0)
    samples, offsets = packed._pack(0)
    tokens = np.add.reduceat(lengths[samples], offsets[:-1])
    over = np.maximum(tokens - row_tokens, 0)
    return {
        "image tokens": rule,
        "packing": name,
        "rows": len(packed),
        "token efficiency": float(np.minimum(tokens, row_tokens).sum() / (len(packed) * row_tokens)),
        "room left empty": float(np.maximum(row_tokens - tokens, 0).sum() / (len(packed) * row_tokens)),
        "rows over budget": float((over > 0).mean()),
        "tokens over budget": float(over.sum() / tokens.sum()),
    }


def packing_table(count: int, row_tokens: int) -> tuple[list[dict[str, Any]], dict[str, bool], int]:
    text, sizes = obelics_like(count)
    rows, checks, left_out = [], {}, 0
    for rule in ("64", "576", "qwen2-vl"):
        vision = np.array([image_tokens(rule, s) for s in sizes], dtype=np.int64)
        lengths = text + vision + 1  # EOS
        fits = lengths <= row_tokens
        left_out = max(left_out, int((~fits).sum()))
        ours = packing_rows(lengths[fits], lengths[fits], row_tokens, rule, "ours: text and image tokens")
        rows.append(ours)
        rows.append(packing_rows(lengths[fits], np.minimum(text[fits] + 1, row_tokens), row_tokens, rule,
                                 "text length alone"))  # fmt: skip
        mean = int(round(vision.mean()))
        estimate = np.clip(text[fits] + 1 + mean, 1, row_tokens)
        rows.append(packing_rows(lengths[fits], estimate, row_tokens, rule, f"text + the mean {mean} image tokens"))
        alone = lengths[fits]
        rows.append({"image tokens": rule, "packing": "one document a row", "rows": len(alone),
                     "token efficiency": float(alone.sum() / (len(alone) * row_tokens)),
                     "room left empty": float(1 - alone.sum() / (len(alone) * row_tokens)),
                     "rows over budget": 0.0, "tokens over budget": 0.0})  # fmt: skip
        checks[f"{rule} image tokens: ours at least {PACKING_GOAL} of row capacity, no row over budget"] = (
            ours["token efficiency"] >= PACKING_GOAL and ours["rows over budget"] == 0
        )
    return rows, checks, left_out


def pipeline_packing(path: Path, tokenizer: Path, row_tokens: int) -> dict[str, Any]:
    """Our DataModule's packed rows of the benchmark's documents: their efficiency over a pass."""
    dm = ImageTextDataModule(
        str(path), tokenizer=str(tokenizer), layout="obelics", text_field="texts", image_field="images",
        image_token=IMAGE_TOKEN, num_image_tokens=NUM_IMAGE_TOKENS, image_size=IMAGE_SIZE, max_images=8,
        max_text_len=row_tokens, batch_size=1, separator="", pack_sequences=True,
    )  # fmt: skip
    dm.setup("fit")
    train = dm._train
    rows = np.zeros((len(train), 1, 2), dtype=np.int64)
    rows[:, 0, 1] = np.arange(len(train))
    report_ = train.packed.report(rows)
    return {"image tokens": str(NUM_IMAGE_TOKENS), "packing": f"ours, the pipeline on the {len(train.kept)} "
            "documents above", "rows": report_.rows, "token efficiency": report_.token_efficiency,
            "room left empty": 1 - report_.token_efficiency, "rows over budget": 0.0,
            "tokens over budget": 0.0}  # fmt: skip


SCALE_COLUMNS = ["what", "here", "at 1,024 ranks (128 nodes x 8), OBELICS's 141M documents"]
OBELICS_DOCUMENTS, RANKS_PER_NODE = 141_000_000, 8


def packing_scale(path: Path, tokenizer: Path, row_tokens: int, cache: Path) -> list[dict[str, Any]]:
    """What packing costs at setup, measured in this process with a node cache of its own: the first
    setup (the measure) and the next (mapping), the node's bytes a document, a process's own bytes a
    document, and what ranks exchange; projected to a 1,024-rank job."""
    import os
    import tempfile

    from datamodules.storage.node_arrays import is_mapped

    cache.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(dir=cache))  # empty, even in a --data-dir kept from a run before
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    times, dm = [], None
    for _ in range(2):
        dm = ImageTextDataModule(
            str(path), tokenizer=str(tokenizer), layout="obelics", text_field="texts", image_field="images",
            image_token=IMAGE_TOKEN, num_image_tokens=NUM_IMAGE_TOKENS, image_size=IMAGE_SIZE, max_images=8,
            max_text_len=row_tokens, batch_size=1, separator="", pack_sequences=True,
        )  # fmt: skip
        start = time.perf_counter()
        dm.setup("fit")
        times.append(time.perf_counter() - start)
    train = dm._train
    train.packed.row(0, 0)  # the first pass's packing, as the loader maps it
    documents = len(train.split)
    node_bytes = sum(f.stat().st_size for f in (cache / "datamodules").rglob("*.npy"))
    if before is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = before
    tables = [train.kept, train.lengths, train.images]
    own = sum(a.nbytes for a in tables if not is_mapped(a))
    rate = documents / times[0]
    hours = OBELICS_DOCUMENTS / (rate * RANKS_PER_NODE) / 3600
    return [
        {"what": "first setup (measure, on this 2-core machine)", "here": f"{times[0]:.2f} s, {rate:,.0f} documents/s",
         "at 1,024 ranks (128 nodes x 8), OBELICS's 141M documents":
             f"{hours:.1f} h a node, its 8 ranks sharing the chunks (the same on every node), once"},
        {"what": "next setup (mapping the node's arrays)", "here": f"{times[1]:.3f} s",
         "at 1,024 ranks (128 nodes x 8), OBELICS's 141M documents": "the same: O(chunks) files mapped"},
        {"what": "node cache bytes a document (measure, kept tables, a pass's packing)",
         "here": f"{node_bytes / documents:.1f}",
         "at 1,024 ranks (128 nodes x 8), OBELICS's 141M documents":
             f"{node_bytes / documents * OBELICS_DOCUMENTS / 2**30:.1f} GiB a node, shared by its processes"},
        {"what": "a process's own bytes a document", "here": f"{own / documents:.1f}",
         "at 1,024 ranks (128 nodes x 8), OBELICS's 141M documents": f"{own / documents * OBELICS_DOCUMENTS:,.0f}"},
        {"what": "bytes exchanged between ranks for packing", "here": "0",
         "at 1,024 ranks (128 nodes x 8), OBELICS's 141M documents": "0 (every process computes the same packing)"},
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=600)
    parser.add_argument("--distinct-images", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0, help="timed per measurement")
    parser.add_argument("--warmup", type=int, default=4, help="untimed batches first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--packed-documents", type=int, default=200_000, help="OBELICS-like documents packed")
    parser.add_argument("--row-tokens", type=int, default=8192, help="tokens a packed row")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.documents, args.distinct_images, args.seconds, args.warmup, args.rounds = 24, 6, 1.0, 1, 1
        args.packed_documents = 2000
    torch.set_num_threads(1)
    started = time.perf_counter()
    with data_directory(args.data_dir) as directory:
        path, tokenizer, images = write_documents(directory, args.documents, args.distinct_images)
        processor = llava(directory, tokenizer)
        print(f"packing {args.packed_documents} OBELICS-like documents", flush=True)
        packing, packing_checks, left_out = packing_table(args.packed_documents, args.row_tokens)
        packing.append(pipeline_packing(path, tokenizer, args.row_tokens))
        scale = packing_scale(path, tokenizer, args.row_tokens, directory / "node_cache")
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
            f"image, rows of {MAX_TEXT_LEN} tokens, batch {BATCH}; medians of {args.rounds} rounds)": (COLUMNS, rows),
            f"Packing {args.packed_documents} OBELICS-like documents into rows of {args.row_tokens} tokens "
            f"({left_out} longer than a row alone left out)": (PACKING_COLUMNS, packing),
            f"Packing's setup and memory, the {args.documents} documents above in rows of {args.row_tokens} tokens; "
            "projected linearly": (SCALE_COLUMNS, scale),
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
        checks={**checks, **packing_checks},
        results_dir=results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
