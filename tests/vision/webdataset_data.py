"""WebDataset tar shards written in the test by the ``webdataset`` package's own ``ShardWriter``."""

from __future__ import annotations

from pathlib import Path

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
