"""WebDataset tar shards written in the test by the ``webdataset`` package's own ``ShardWriter``, and
shards changed under a run."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch import Callback, Trainer

from tests.vision.image_data import metadata


def shards_of_folder(folder: Path, out: Path, per_shard: int, image_key: str | None = None) -> str:
    """The imagefolder ``folder``'s rows as WebDataset shards in ``out`` (``per_shard`` samples each:
    the image under its own extension or ``image_key``, the caption as ``.txt``, the prompt in
    ``.json``); returns the brace pattern naming them."""
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    rows = metadata(folder)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, row in enumerate(rows):
            name = row["file_name"]
            sample = {"__key__": f"sample{i:04d}", image_key or name.rsplit(".", 1)[1]: (folder / name).read_bytes()}
            sample["txt"] = row["text"]
            if "question" in row:
                sample["json"] = {"question": row["question"]}
            sink.write(sample)
    count = (len(rows) + per_shard - 1) // per_shard
    return str(out / f"shard-{{000000..{count - 1:06d}}}.tar")


def captions_rewritten(shard: Path) -> bytes:
    """``shard``'s bytes with every ``.txt`` member's text reversed in place: the same size, the same
    tar headers, other captions (a shard rewritten by a writer that fixes its members' times)."""
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        for member in tar:
            if member.name.endswith(".txt"):
                start, end = member.offset_data, member.offset_data + member.size
                data[start:end] = data[start:end][::-1]
    return bytes(data)


def resized(data: bytes, size: int) -> bytes:
    """``data`` cut or padded with zeros to ``size`` bytes: another shard's bytes in one's place."""
    return data[:size].ljust(size, b"\0")


class ChangeAfterStep(Callback):
    """Calls ``change()`` once, after training step ``step`` (1-based): the data changed under a run."""

    def __init__(self, step: int, change: Callable[[], None]) -> None:
        self.step, self.change = step, change

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            self.change()
