"""Index WebDataset tar shards ahead of a job, into the folder its DataModule reads indexes from.

``python -m datamodules.storage.index 's3://bucket/{00000..09999}.tar' --cache-dir /shared/tar_index``
indexes every shard (a progress bar) and assembles the table the DataModule maps, so the job's setup
reads nothing but the shards' versions. ``--num-parts N --part-index i`` indexes the shards ``i``,
``i + N``, ``i + 2N``, ... only: one task of a job array (Slurm's ``--array=0-N``), each writing its
shards' indexes into the shared ``--cache-dir``; the part that finds every shard indexed assembles the
table (the DataModule's setup assembles it otherwise). An index is written as soon as its shard is
done, so a build stopped half way and started again indexes only the rest.

Give the DataModule the same folder: ``load_kwargs={"cache_dir": ...}`` (image-text) or
``layout_options={"index_cache_dir": ...}`` (video).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from datamodules.plan.arguments import program_name
from datamodules.storage.sample_table import assemble_table, table_name
from datamodules.storage.tar_index import (
    INDEX_FORMAT,
    build_shard_indexes,
    default_index_cache,
    described_shards,
    index_file,
    kept_index,
    reader_and_versions,
)

log = logging.getLogger(__name__)


def index_part(
    shards: str | list[str],
    cache_dir: str | None = None,
    storage_options: dict | None = None,
    num_parts: int = 1,
    part_index: int = 0,
    io_threads: int = 16,
    allow_compressed: bool = False,
) -> dict[str, int | bool]:
    """Index the shards of part ``part_index`` of ``num_parts`` (dealt by position) into ``cache_dir``;
    assemble the table once every shard is indexed. What it did: ``indexed`` (built now), ``kept``
    (found from before), ``missing`` (shards of other parts not indexed yet), ``assembled``."""
    if not 0 <= part_index < num_parts:
        raise ValueError(f"--part-index must be in [0, {num_parts}), got {part_index}")
    locations, versions = described_shards(shards, storage_options, io_threads)
    reader, versions = reader_and_versions(locations, storage_options, io_threads, versions)
    folder = Path(cache_dir or default_index_cache())
    folder.mkdir(parents=True, exist_ok=True)
    mine = list(range(part_index, len(locations), num_parts))
    paths = [index_file(folder, location, version) for location, version in zip(locations, versions, strict=True)]
    kept = sum(kept_index(paths[i]) for i in mine)
    build_shard_indexes([locations[i] for i in mine], [versions[i] for i in mine], folder, reader, io_threads,
                        allow_compressed)  # fmt: skip
    missing = sum(not kept_index(path) for path in paths)
    table = folder / table_name(locations, versions, INDEX_FORMAT)
    assembled = not missing and not table.exists()
    if assembled:
        assemble_table(table, locations, versions, paths)
    return {"indexed": len(mine) - kept, "kept": kept, "missing": missing, "assembled": assembled}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=program_name("datamodules.storage.index"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("shards", nargs="+", help="tar shards: brace patterns, globs, folders, URLs")
    parser.add_argument("--cache-dir", help=f"where the indexes go (default: {default_index_cache()})")
    parser.add_argument("--num-parts", type=int, default=1, help="split the shards into this many parts ...")
    parser.add_argument("--part-index", type=int, default=0, help="... and index this one")
    parser.add_argument("--io-threads", type=int, default=16, help="shards indexed at once (default: 16)")
    parser.add_argument("--allow-compressed-tar", action="store_true", help="decompress compressed shards once")
    parser.add_argument("--storage-options", type=json.loads, default=None, help="for URLs: fsspec options as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        done = index_part(args.shards, args.cache_dir, args.storage_options, args.num_parts, args.part_index,
                          args.io_threads, args.allow_compressed_tar)  # fmt: skip
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    table = "assembled" if done["assembled"] else f"waiting for {done['missing']} shards of other parts"
    table = "already there" if not done["missing"] and not done["assembled"] else table
    print(f"indexed {done['indexed']} tar shards ({done['kept']} kept from before); the table: {table}")


if __name__ == "__main__":
    main()
