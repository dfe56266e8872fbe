"""Images per second out of ``ImageTextDataModule``'s train loader against the decoders alone and a
plain torchvision loader, on the same 1080p JPEGs in one run.

Floors, one process, no loader: the fastest decode-plus-resize available here (PIL full decode, PIL
``draft()`` (reduced DCT scale), ``torchvision.io.decode_jpeg``; each then shorter side to
``--image-size`` and a center crop). The plain loader: a ``Dataset`` over the files doing PIL decode,
``transforms.Resize``/``CenterCrop``/``ToTensor``/``Normalize``, in a ``DataLoader``. Ours: the
DataModule's ``train_dataloader()`` (captions tokenized, labels built, uint8 pixels as they go to
the device, where ``on_after_batch_transfer`` normalizes them). Each at ``num_workers`` 0 and 2,
alternating rounds, medians; torch on one thread per process, so "per core" means what it says:
``python -m benchmarks.image_text``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.io import decode_jpeg
from torchvision.transforms import v2

from benchmarks.common import (
    add_run_arguments,
    data_directory,
    in_processes_at_once,
    report,
    results_directory,
    warm_page_cache,
)
from benchmarks.loader_throughput import endless, throughput
from examples.default_images import COLORS, train_caption_tokenizer


def photo(i: int, size: tuple[int, int]) -> Image.Image:
    """A photo-like picture: a smooth two-colour gradient, a few soft shapes, mild sensor noise."""
    rng = np.random.default_rng(i)
    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    t = (x / w * rng.uniform(0.3, 1) + y / h * rng.uniform(0.3, 1))[..., None] / 2
    pixels = a * (1 - t) + b * t + rng.normal(0, 4, (h, w, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(h / 20, h / 4)
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=tuple(int(v) for v in rng.uniform(0, 255, 3)))
    return image


def write_photos(directory: Path, count: int, distinct: int, size: tuple[int, int], link: bool = True) -> Path:
    """An imagefolder of ``count`` JPEGs (quality 90) with captions, kept if it is already there.

    Only ``distinct`` pictures are drawn (a 1080p picture takes half a second); file ``i`` is a hard
    link to picture ``i % distinct`` (``link=False``: a copy, so reading the folder touches as many
    bytes as reading the same images from tar shards). The rows still make an epoch long enough that
    the loaders' pipeline drain at each epoch end does not weigh on the numbers."""
    if (directory / "metadata.jsonl").exists() and len(list(directory.glob("*.jpg"))) == count:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    rows = []
    for i in range(count):
        path = directory / f"{i:05d}.jpg"
        path.unlink(missing_ok=True)
        if i < distinct:
            photo(i, size).save(path, quality=90)
        elif link:
            os.link(directory / f"{i % distinct:05d}.jpg", path)
        else:
            shutil.copyfile(directory / f"{i % distinct:05d}.jpg", path)
        caption = f"a photo of {' and '.join(rng.sample(list(COLORS), 2))} circles on a gradient, number {i}"
        rows.append({"file_name": f"{i:05d}.jpg", "text": caption})
    (directory / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def resize_crop(image: torch.Tensor, size: int) -> torch.Tensor:
    return v2.functional.center_crop(v2.functional.resize(image, size, antialias=True), size)


def floors(size: int) -> dict[str, Callable[[bytes], Any]]:
    """Decode-plus-resize of one JPEG's bytes, three ways."""

    def pil_full(data: bytes) -> Any:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        scale = size / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BILINEAR)
        left, top = (image.width - size) // 2, (image.height - size) // 2
        return np.asarray(image.crop((left, top, left + size, top + size)))

    def pil_draft(data: bytes) -> Any:
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (size, size))
        return resize_crop(v2.functional.pil_to_tensor(image.convert("RGB")), size)

    def torchvision_decode(data: bytes) -> Any:
        return resize_crop(decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)), size)

    return {
        "PIL full decode + PIL resize": pil_full,
        "PIL draft() + torchvision uint8 resize": pil_draft,
        "torchvision.io.decode_jpeg + uint8 resize": torchvision_decode,
    }


def floor_speed(decode: Callable[[bytes], Any], images: list[bytes], seconds: float) -> float:
    decode(images[0])
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        decode(images[count % len(images)])
        count += 1
    return count / (time.perf_counter() - started)


def floor_in_process(name: str, size: int, paths: list[Path], seconds: float, ready: Callable[[], Any]) -> float:
    """One of the floor loops running at once (``in_processes_at_once``)."""
    images = [p.read_bytes() for p in paths]
    decode = floors(size)[name]
    decode(images[0])
    ready()
    return floor_speed(decode, images, seconds)


class PlainImageFolder(Dataset):
    """What a hand-rolled loader does: PIL decode, resize, crop, ``ToTensor``, ``Normalize``, per file."""

    def __init__(self, paths: list[Path], size: int) -> None:
        self.paths = paths
        self.transform = transforms.Compose(
            [
                transforms.Resize(size),
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                transforms.Normalize((0.481, 0.458, 0.408), (0.269, 0.261, 0.276)),
            ]
        )

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(Image.open(self.paths[i]).convert("RGB"))


def one_thread_worker(_: int) -> None:
    torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-images", type=int, default=1200, help="rows (an epoch)")
    parser.add_argument("--distinct-images", type=int, default=300, help="pictures drawn (rows share them)")
    parser.add_argument("--width", type=int, default=1920)
    parser.add_argument("--height", type=int, default=1080)
    parser.add_argument("--image-size", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--seconds", type=float, default=6.0, help="timed seconds per contender per round")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_images, args.distinct_images, args.width, args.height = 24, 12, 320, 180
        args.rounds, args.seconds = 1, 0.5
        args.image_size, args.batch_size = 64, 4
    torch.set_num_threads(1)
    from datamodules import ImageTextDataModule

    with data_directory(args.data_dir) as directory:
        folder = write_photos(directory / "photos", args.num_images, args.distinct_images, (args.width, args.height))
        paths = sorted(folder.glob("*.jpg"))[: args.distinct_images]
        warm_page_cache(paths)
        images = [p.read_bytes() for p in paths]
        captions = [json.loads(line)["text"] for line in (folder / "metadata.jsonl").read_text().splitlines()]
        tokenizer = train_caption_tokenizer(captions, directory / "tokenizer")
        loaders: dict[str, Iterator[Any]] = {}
        for workers in (0, 2):
            dm = ImageTextDataModule(
                "imagefolder", max_text_len=32, batch_size=args.batch_size, tokenizer=str(tokenizer),
                image_size=args.image_size, num_image_tokens=0, num_workers=workers,
                load_kwargs={"data_dir": str(folder)},
            )  # fmt: skip
            dm.prepare_data()
            dm.setup("fit")
            loaders[f"ImageTextDataModule, num_workers={workers}"] = endless(dm.train_dataloader)
        for workers in (0, 2):
            plain = DataLoader(
                PlainImageFolder(paths, args.image_size), batch_size=args.batch_size, shuffle=True,
                num_workers=workers, persistent_workers=workers > 0, worker_init_fn=one_thread_worker,
            )  # fmt: skip
            loaders[f"plain ImageFolder-style DataLoader, num_workers={workers}"] = endless(lambda p=plain: p)
        decoders = floors(args.image_size)
        together = {f"{name}, 2 processes at once": name for name in decoders}
        speeds: dict[str, list[float]] = {name: [] for name in [*decoders, *together, *loaders]}
        for _ in range(args.rounds):  # alternating, so drift hits all alike
            for name, decode in decoders.items():
                speeds[name].append(floor_speed(decode, images, args.seconds))
            for name, decoder in together.items():
                if args.quick:  # a smoke run: two fresh interpreters per decoder cost more than the rest of it
                    speeds[name].append(2 * speeds[decoder][-1])
                    continue
                speeds[name].append(
                    in_processes_at_once(floor_in_process, (decoder, args.image_size, paths, args.seconds), 2)
                )
            for name, batches in loaders.items():
                speeds[name].append(throughput(batches, args.batch_size, 8, args.seconds)["tokens/s"])
    median = {name: statistics.median(v) for name, v in speeds.items()}
    floor_name = max(decoders, key=median.get)
    floor = median[floor_name]  # per core, one process alone
    floor_together = median[f"{floor_name}, 2 processes at once"] / 2  # per core, both cores busy
    rows = []
    for name, speed in median.items():
        cores = 2 if name.endswith(("num_workers=2", "at once")) else 1
        rows.append(
            {
                "contender": name,
                "images/s": speed,
                "per core": speed / cores,
                "of the floor alone": speed / cores / floor,
                "of the floor on as many cores": speed / cores / (floor if cores == 1 else floor_together),
            }
        )
    ours0, ours2 = median["ImageTextDataModule, num_workers=0"], median["ImageTextDataModule, num_workers=2"]
    plain0 = median["plain ImageFolder-style DataLoader, num_workers=0"]
    plain2 = median["plain ImageFolder-style DataLoader, num_workers=2"]
    checks = {
        f"num_workers=0 >= 0.8 of the floor ({floor_name}) in one process ({ours0 / floor:.2f})": ours0 >= 0.8 * floor,
        "num_workers=2 >= 0.8 of the floor run in 2 processes at once, per process "
        f"({ours2 / 2 / floor_together:.2f}; {ours2 / 2 / floor:.2f} of the floor alone)": ours2 / 2
        >= 0.8 * floor_together,
        f">= 70 images/s per core ({ours0:.0f} at workers 0, {ours2 / 2:.0f} per worker at 2)": min(ours0, ours2 / 2)
        >= 70,
        f">= 2x the plain loader ({ours0 / plain0:.2f}x at workers 0, {ours2 / plain2:.2f}x at 2)": min(
            ours0 / plain0, ours2 / plain2
        )
        >= 2.0,
    }
    report(
        "image_text",
        {
            f"{args.width}x{args.height} JPEG to {args.image_size}x{args.image_size}, batch {args.batch_size}, "
            f"medians of {args.rounds} rounds": (
                ["contender", "images/s", "per core", "of the floor alone", "of the floor on as many cores"],
                rows,
            )
        },
        {
            "num_images": args.num_images,
            "distinct_images": args.distinct_images,
            "size": f"{args.width}x{args.height}",
            "mean_jpeg_kb": round(sum(map(len, images)) / len(images) / 1024),
            "image_size": args.image_size,
            "batch_size": args.batch_size,
        },
        checks,
        results_directory(args.results_dir, args.quick),
    )


if __name__ == "__main__":
    main()
