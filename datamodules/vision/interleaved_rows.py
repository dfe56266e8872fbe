"""``InterleavedRows``: interleaved documents packed into rows of ``total_seq_len`` tokens, counting
each image's placeholders, by multipack (``PackedRows``: best-fit decreasing, afresh every pass), a
plan source whose samples are the packed rows, as conversation rows are."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from datamodules.plan.bad_samples import BadSample, BadSampleLog
from datamodules.plan.hf_loading import tokenizer_threads
from datamodules.plan.loader import IGNORE_INDEX
from datamodules.plan.multipack import PackedRows, narrow_indices, row_layout
from datamodules.plan.parallelism import Job
from datamodules.storage.node_arrays import node_arrays
from datamodules.vision.interleaved_samples import InterleavedSamples

log = logging.getLogger(__name__)

COSTS_KIND = "document_costs-1"  # the node cache's folder for documents' lengths; its number: the format
_MEASURED_AT_ONCE = 512
_CHUNK = 1 << 16  # documents measured together, kept as one of the node's arrays
# Why a document cannot be packed, by code in the node's ``unfit`` array (0: it can).
UNFIT = {1: "malformed", 2: "too many images", 3: "over the row's budget alone", 4: "over the row's image cap alone"}


class InterleavedRows(InterleavedSamples):
    """Interleaved documents packed several a row of ``total_seq_len`` tokens (their text, each image's
    placeholders, BOS and EOS), at most ``max_images_per_row`` images a row.

    Every document's length and image count are measured once on the node (``node_arrays``: the
    rows are read and their texts tokenized, no image is decoded) before the first pass is packed,
    in chunks the node's ranks share out among themselves (``job``: its node-local rank). A
    document that cannot be packed (malformed, more than ``max_images`` images, longer than a row
    alone) is refused at ``setup`` naming it, or left out of every pass (``on_bad_sample="skip"``),
    counted in ``left_out`` and logged. An image that does not decode is found when its row is read:
    its document is refused, or its room in the row stays padding, counted in ``bad_samples``; never
    replaced by another document, which would not fit the row.

    A batch of ``B`` rows holds ``input_ids``, ``labels`` (each document's own, never across two),
    ``position_ids``, ``document_ids``, ``cu_seqlens``, ``num_sequences`` and ``max_seqlen`` as
    packed conversation rows do (``row_layout``); ``pixel_values`` ``[N, 3, H, W]``, the rows' images
    in order, ``image_sample_index`` ``[N]`` (the row of each) and ``image_counts`` ``[B]``.
    """

    uses_passes = True  # rows are packed afresh every pass over the documents

    def __init__(self, *args: Any, max_images_per_row: int | None, job: Job | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bad_samples = BadSampleLog("left bad document %s (%s) out of its row, its room padding")
        self.total_seq_len = self.text.max_text_len
        self.max_images_per_row = max_images_per_row
        identity = (self.fingerprint, self.split.first, len(self.split))
        self.shared_as = hashlib.blake2b(repr(identity).encode(), digest_size=16).hexdigest()
        self.job = job
        self.measured_here: list[int] = []  # the chunks this process measured (the rest: its node's other processes)
        unfit = np.concatenate([chunk["unfit"] for chunk in self._measured()])
        self.left_out = int(np.count_nonzero(unfit))
        if self.left_out:
            self._refuse_or_log(unfit)
        if self.left_out == len(unfit):
            raise ValueError(f"{self.name}: no document can be packed into rows of {self.total_seq_len} tokens")
        self._tables: dict[str, np.ndarray] | None = None
        self._packed: PackedRows | None = None
        packed = self.packed
        self.fingerprint = f"{self.fingerprint}:packed:{packed.fingerprint}"
        self.details = {**self.details, "documents": len(self.kept), "rows": len(packed)}

    def _measured(self) -> list[dict[str, np.ndarray]]:
        """Every chunk of ``_CHUNK`` documents measured (``_measure``), each once on the node: its
        processes start at chunks spread by their node-local rank, so they measure different chunks
        at once and map the others'."""
        n = len(self.split)
        count = -(-n // _CHUNK)
        per_node = max(1, self.job.size // self.job.nodes) if self.job is not None else 1
        first = (self.job.local_rank % per_node) * count // per_node if self.job is not None else 0
        found = {}
        for chunk in tqdm([(first + k) % count for k in range(count)], f"{self.name}: measuring", disable=count < 4):

            def measure(chunk: int = chunk) -> dict[str, np.ndarray]:
                self.measured_here.append(chunk)
                return self._measure(chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK))

            found[chunk] = node_arrays(COSTS_KIND, f"{self.shared_as}/measured-{chunk}", measure)
        return [found[chunk] for chunk in range(count)]

    def _measure(self, first: int, stop: int) -> dict[str, np.ndarray]:
        """Documents ``[first, stop)``: each one's tokens and images, and why it cannot be packed
        (``UNFIT``'s code, 0: it can)."""
        with tokenizer_threads():  # the texts tokenized on every core: each batch in one call
            batches = [self._measure_batch(start, min(stop, start + _MEASURED_AT_ONCE))
                       for start in range(first, stop, _MEASURED_AT_ONCE)]  # fmt: skip
        lengths, images, unfit = (np.concatenate(column) for column in zip(*batches, strict=True))
        unfit[(unfit == 0) & (lengths > self.total_seq_len)] = 3
        if self.max_images_per_row is not None:
            unfit[(unfit == 0) & (images > self.max_images_per_row)] = 4
        return {"lengths": lengths, "images": images, "unfit": unfit}

    def _measure_batch(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Lengths, images and ``UNFIT`` codes of documents ``[start, stop)``."""
        lengths = np.zeros(stop - start, dtype=np.int32)
        images = np.zeros(stop - start, dtype=np.int32)
        unfit = np.zeros(stop - start, dtype=np.int8)
        parts: list[Any] = []
        counts: list[list[int]] = []
        measured: list[int] = []  # the documents whose length is measured: the rest are unfit already
        for at, row in enumerate(self._texts_and_images(self.split.rows(np.arange(start, stop)).tolist())):
            try:
                if isinstance(row, BadSample):
                    raise row
                document, their_images = self.parts_of(*row)
                images[at] = len(their_images)
                if len(their_images) > self.max_images:
                    unfit[at] = 2
                    continue
                counts.append(self.image_counts(their_images))
            except BadSample:
                unfit[at] = 1
                continue
            parts.append(document)
            measured.append(at)
        for at, length in zip(measured, self.text.lengths(parts, counts), strict=True):
            if isinstance(length, BadSample):
                unfit[at] = 1
            else:
                lengths[at] = length
        return lengths, images, unfit

    def _texts_and_images(self, rows: list[int]) -> list[tuple[Any, Any] | BadSample]:
        """The texts and images fields of dataset ``rows`` (one read for them all); a tar sample
        that cannot be read gets its ``BadSample``."""
        fields = [self.texts_field, self.images_field]
        if hasattr(self.dataset, "select_columns"):
            table = self.dataset.select_columns(fields)[rows]
            return list(zip(table[self.texts_field], table[self.images_field], strict=True))
        self.dataset.prefetch(rows)  # tar shards' samples: their ranges requested together
        out: list[tuple[Any, Any] | BadSample] = []
        for row in rows:
            try:
                found = self.dataset[row]
                out.append((found[self.texts_field], found[self.images_field]))
            except BadSample as err:
                out.append(err)
        return out

    def _why(self, index: int, code: int) -> str:
        """Why document ``index`` cannot be packed (``UNFIT``'s ``code``), in words."""
        try:
            parts, images = self._row(index)
            if code in (2, 4):
                most = f"max_images={self.max_images}" if code == 2 else f"max_images_per_row={self.max_images_per_row}"
                return f"it holds {len(images)} images, more than {most}"
            (length,) = self.text.lengths([parts], [self.image_counts(images)])
        except BadSample as err:
            return str(err)
        if isinstance(length, BadSample):
            return str(length)
        return f"it takes {length} tokens, more than a row's {self.total_seq_len} (max_text_len)"

    def _refuse_or_log(self, unfit: np.ndarray) -> None:
        bad = np.flatnonzero(unfit)
        first = int(bad[0])
        kinds = ", ".join(f"{int((unfit == c).sum())} {why}" for c, why in UNFIT.items() if (unfit == c).any())
        example = f"{self.describe(first)}: {self._why(first, int(unfit[first]))}"
        if self.on_bad_sample == "raise":
            raise ValueError(
                f"{example}; {len(bad)} documents cannot be packed ({kinds}); on_bad_sample='skip' leaves them "
                "out and counts them"
            )
        log.warning("%s: left out %d of %d documents (%s), e.g. %s", self.name, len(bad), len(unfit), kinds, example)

    @property
    def tables(self) -> dict[str, np.ndarray]:
        """The documents packed (``kept``, indices of this split), their ``lengths`` and ``images``:
        the node's arrays, mapped (a process holds none of its own)."""
        if self._tables is None:

            def make() -> dict[str, np.ndarray]:
                chunks = self._measured()
                measured = {k: np.concatenate([c[k] for c in chunks]) for k in ("lengths", "images", "unfit")}
                kept = np.flatnonzero(measured["unfit"] == 0)
                return {"kept": narrow_indices(kept), **{k: measured[k][kept] for k in ("lengths", "images")}}

            self._tables = node_arrays(COSTS_KIND, f"{self.shared_as}/kept", make)
        return self._tables

    @property
    def kept(self) -> np.ndarray:
        return self.tables["kept"]

    @property
    def lengths(self) -> np.ndarray:
        return self.tables["lengths"]

    @property
    def images(self) -> np.ndarray:
        return self.tables["images"]

    @property
    def packed(self) -> PackedRows:
        """The documents' packing, every pass's computed once on the node."""
        if self._packed is None:
            cap = self.max_images_per_row
            self._packed = PackedRows(
                self.lengths, self.total_seq_len, shared_as=self.shared_as,
                images=None if cap is None else self.images, max_images_per_row=cap,
            )  # fmt: skip
        return self._packed

    @property
    def most_per_row(self) -> int:
        """The most documents a row can hold (the length of ``cu_seqlens`` follows it)."""
        return self.packed.most_per_row

    def __getstate__(self) -> dict[str, Any]:
        # A worker maps the node's arrays itself; the job's collectives stay in the rank.
        return {**self.__dict__, "_packed": None, "_tables": None, "job": None}

    def __len__(self) -> int:
        return len(self.packed)

    def documents(self, indices: np.ndarray, passes: np.ndarray) -> list[np.ndarray]:
        """The documents (indices of this split) of each packed row ``indices[i]`` of pass ``passes[i]``."""
        packed = self.packed
        rows = zip(np.asarray(indices).tolist(), np.asarray(passes).tolist(), strict=True)
        return [self.kept[packed.row(pass_, row)] for row, pass_ in rows]

    def file_keys(self, indices: np.ndarray, passes: np.ndarray | None = None) -> np.ndarray:
        """The ``url_key`` of the images each row's documents read by URL (``[rows, images]``, 0: none)."""
        passes = np.zeros(len(indices), dtype=np.int64) if passes is None else passes
        rows = [super(InterleavedRows, self).file_keys(d).ravel() for d in self.documents(indices, passes)]
        keys = np.zeros((len(rows), max(map(len, rows), default=0)), dtype=np.uint64)
        for r, found in enumerate(rows):
            keys[r, : len(found)] = found
        return keys

    def fetch(
        self, indices: np.ndarray, keys: np.ndarray, passes: np.ndarray, positions: np.ndarray | None = None
    ) -> dict[str, Any]:
        positions = np.zeros(len(indices), dtype=np.int64) if positions is None else positions
        skipped: list[tuple[str, str]] = []
        counts: dict[str, Any] = {}
        length = self.total_seq_len
        raw: dict[str, Any] = {
            "input_ids": np.full((len(indices), length), self.text.pad_id, dtype=np.int64),
            "labels": np.full((len(indices), length), IGNORE_INDEX, dtype=np.int64),
        }
        images: list[tuple[list[np.ndarray], dict[str, np.ndarray]]] = []
        image_counts = np.zeros(len(indices), dtype=np.int64)
        lengths: list[list[int]] = []
        with self.count_cache(counts):
            for b, (documents, position) in enumerate(
                zip(self.documents(indices, passes), positions.tolist(), strict=True)
            ):
                placed: list[int] = []
                for document in documents.tolist():
                    try:
                        with self.reading(position):
                            pixels, extras, arrays = self._read(document, 0)
                    except BadSample as err:
                        if self.on_bad_sample == "raise":
                            return {"error": f"{self.describe(document)}: {err} (on_bad_sample='skip' counts it)"}
                        skipped.append((self.describe(document), str(err)))
                        continue
                    n = int(arrays["attention_mask"].sum())
                    at = sum(placed)
                    if n != self.lengths[np.searchsorted(self.kept, document)] or at + n > length:
                        return {"error": f"{self.describe(document)} changed since it was measured: it now takes {n}"}
                    raw["input_ids"][b, at : at + n] = arrays["input_ids"][:n]
                    raw["labels"][b, at : at + n] = arrays["labels"][:n]
                    placed.append(n)
                    images.append((pixels, extras))
                    image_counts[b] += len(pixels)
                lengths.append(placed)
        raw.update(row_layout(lengths, length, self.most_per_row))
        raw.update(self.images_raw(images))
        raw["image_counts"] = image_counts
        return {**raw, **counts, "skipped": skipped}

    def to_batch(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        if "error" in raw:
            raise BadSample(raw["error"])
        self.bad_samples.record(raw["skipped"])
        self.add_cache_counts(raw)
        batch = {k: torch.from_numpy(raw[k]) for k in ("input_ids", "labels", "position_ids", "document_ids")}
        return {
            **batch,
            "cu_seqlens": torch.from_numpy(raw["cu_seqlens"]),
            "num_sequences": int(raw["num_sequences"]),
            "max_seqlen": int(raw["max_seqlen"]),
            **self.images_batch(raw),
            "image_counts": torch.from_numpy(raw["image_counts"]),
        }
