"""Fixed-length training windows over a token stream: the token-shard source of the sample plan.

Window ``i`` is tokens ``[first + i*seq_len, first + i*seq_len + seq_len + 1)``: inputs and their
next-token labels. Workers return compact raw arrays; tensors are built in the main process.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from datamodules.plan.loader import IGNORE_INDEX, MESSAGE_BATCHES
from datamodules.storage.planned_reads import CACHE_COUNTS, PlannedReads
from datamodules.text.token_shards import TokenShards


class TokenWindows(PlannedReads):
    """``seq_len + 1``-token windows over tokens ``[first_token, last_token)`` of ``shards``.

    Args:
        shards: the token stream.
        seq_len: tokens per training sequence (each window reads one more, for the last label).
        first_token: first stream token of this split.
        last_token: end of this split (exclusive); windows never read past it.
        pack_sequences: also return document boundaries, so batches carry ``position_ids`` that
            restart in every document, ``document_ids``, and no loss across a document boundary.
        split_name: what this split is, for messages (e.g. "the validation split (val_fraction=0.01)").
    """

    def __init__(
        self,
        shards: TokenShards,
        seq_len: int,
        first_token: int = 0,
        last_token: int | None = None,
        pack_sequences: bool = False,
        split_name: str | None = None,
    ) -> None:
        self.shards = shards
        self.seq_len = seq_len
        self.first_token = first_token
        self.last_token = shards.num_tokens if last_token is None else last_token
        self.pack_sequences = pack_sequences
        span = self.last_token - self.first_token
        if span < seq_len + 1:
            raise ValueError(
                f"seq_len={seq_len} needs at least {seq_len + 1} tokens, but {shards.directory} "
                f"has {span} tokens in {split_name or 'this split'}"
            )
        if pack_sequences and shards.document_starts is None:
            raise ValueError(
                f"pack_sequences=True needs document boundaries, but {shards.directory} has no "
                "metadata.json with document_starts; write the shards with python -m datamodules.text.prepare"
            )
        self.num_windows = (span - 1) // seq_len
        self.fingerprint = f"{shards.fingerprint}:{first_token}:{self.last_token}:{seq_len}:{int(pack_sequences)}"
        # What the fingerprint is made of, in plain values: a refused resume names what changed.
        self.details = {
            "data": shards.fingerprint,
            "tokens": [first_token, self.last_token],
            "seq_len": seq_len,
            "pack_sequences": pack_sequences,
        }
        self.vocabulary = shards.vocabulary
        # Window ranges of the stream: one here, several after ``join``. Range ``r`` holds windows
        # ``[_ends[r - 1], _ends[r])``; window ``i`` of it starts at token ``_shifts[r] + i * seq_len``.
        self._ends = np.array([self.num_windows], dtype=np.int64)
        self._shifts = np.array([first_token], dtype=np.int64)
        self.files = shards.files
        self._start_planning()

    raw_layout = "token windows"  # what ``fetch`` returns; a ``TextStream`` gives the same

    def __len__(self) -> int:
        return self.num_windows

    @classmethod
    def join(cls, parts: list[TokenWindows]) -> TokenWindows:
        """One source whose windows are those of ``parts``, one part after another.

        A mixture reads a whole batch, whatever its sources, with one gather from the joined stream.
        """
        kinds = {(p.seq_len, p.pack_sequences) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"joined token windows need one seq_len and packing mode, got {sorted(kinds)}")
        stream_offsets = np.cumsum([0] + [p.shards.num_tokens for p in parts[:-1]])
        window_offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
        joined = cls.__new__(cls)
        joined.__dict__.update(parts[0].__dict__)
        joined.shards = TokenShards.concat([p.shards for p in parts])
        joined.num_windows = sum(len(p) for p in parts)
        joined.fingerprint = "+".join(p.fingerprint for p in parts)
        joined.files = joined.shards.files
        joined._start_planning()
        offsets = list(zip(parts, stream_offsets, window_offsets, strict=True))
        joined._ends = np.concatenate([p._ends + w for p, _, w in offsets])
        # Joined window i is window i - w of a part whose stream starts t tokens into the joined one.
        joined._shifts = np.concatenate([p._shifts + t - w * p.seq_len for p, t, w in offsets])
        return joined

    def _window_starts(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if len(self._shifts) == 1:
            return self._shifts[0] + indices * self.seq_len
        # Once per micro-batch, so one lookup and one gather (the ndarray method skips numpy's dispatch).
        return self._shifts[self._ends.searchsorted(indices, side="right")] + indices * self.seq_len

    @property
    def uses_positions(self) -> bool:  # where each window is read, for a cache planned by the plan
        return self.plans_file_reads

    @property
    def plans_file_reads(self) -> bool:
        """Whether the windows' ranges go through a cache that evicts by the plan's next use."""
        return self.shards.remote and self.files.plans_ahead

    def file_keys(self, indices: np.ndarray, passes: np.ndarray | None = None) -> np.ndarray:
        """The ``range_key`` of each window's pieces in the shards (``[windows, 2]``), whatever the pass."""
        return self.shards.window_keys(self._window_starts(indices), self.seq_len + 1)

    def fetch(self, indices: np.ndarray, positions: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Raw windows for sample ``indices``: tokens in the stored dtype, plus document starts."""
        width = self.seq_len + 1
        starts = self._window_starts(indices)
        raw: dict[str, np.ndarray] = {}
        with self.count_cache(raw):
            raw["tokens"] = self.shards.read_windows(starts, width, self.planned_uses, positions)
        if self.pack_sequences:
            doc = self.shards.document_starts
            lo = np.searchsorted(doc, starts, side="left")
            hi = np.searchsorted(doc, starts + width, side="left")
            flags = np.zeros((len(indices), width), dtype=bool)
            for row, (a, b, start) in enumerate(zip(lo.tolist(), hi.tolist(), starts.tolist(), strict=True)):
                flags[row, doc[a:b] - start] = True
            raw["document_starts"] = flags
        return raw

    @property
    def batches_per_message(self) -> int:
        """Micro-batches a worker reads and sends at once; for a URL, those fetched in one round."""
        return self.shards.prefetch_steps if self.shards.remote else MESSAGE_BATCHES

    @property
    def fetch_many(self) -> Callable[[list[tuple[np.ndarray, dict]]], list[dict[str, np.ndarray]]]:
        """For shards behind a URL: the windows of a whole group of micro-batches (a worker message,
        or a group of spans in-process: ``prefetch_steps`` steps of the plan) in one round of
        concurrent range requests, so a batch does not wait for its own round trip. Local shards have no
        ``fetch_many`` (``hasattr`` is false): a memory-mapped read gains nothing from grouping."""
        if not self.shards.remote:
            raise AttributeError("fetch_many")
        return self._fetch_many

    def _fetch_many(self, calls: list[tuple[np.ndarray, dict]]) -> list[dict[str, np.ndarray]]:
        bounds = np.cumsum([0] + [len(indices) for indices, _ in calls])
        positions = [extra["positions"] for _, extra in calls if "positions" in extra]
        joined = np.concatenate(positions) if len(positions) == len(calls) else None
        raw = self.fetch(np.concatenate([indices for indices, _ in calls]), joined)
        counts = raw.pop(CACHE_COUNTS, None)
        raws = [{key: value[a:b] for key, value in raw.items()} for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        if counts is not None:  # the round's counts ride on its first batch
            raws[0][CACHE_COUNTS] = counts
        return raws

    def to_batch(self, raw: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        self.add_cache_counts(raw)
        return windows_to_batch(raw)


def windows_to_batch(raw: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Tensors per the batch contract from raw windows (``tokens`` ``[B, seq_len + 1]``, optional
    ``document_starts``): int64 ``input_ids``/``labels`` (shifted), and the packing extras."""
    tokens = raw["tokens"]
    n, width = tokens.shape
    # One fresh array per tensor (the consumer may keep a batch), each filled by a single cast.
    input_ids = torch.from_numpy(tokens[:, :-1].astype(np.int64, order="C"))
    labels = torch.from_numpy(tokens[:, 1:].astype(np.int64, order="C"))
    batch = {"input_ids": input_ids, "labels": labels}
    if "document_starts" in raw:
        starts = torch.from_numpy(raw["document_starts"])
        # The target at t is the first token of a new document: no loss across the boundary.
        labels.masked_fill_(starts[:, 1:], IGNORE_INDEX)
        segment = starts[:, :-1].clone()
        segment[:, 0] = True
        steps = torch.arange(width - 1).expand(n, -1)
        last_start = torch.where(segment, steps, 0).cummax(dim=1).values
        batch["position_ids"] = steps - last_start
        batch["document_ids"] = segment.cumsum(dim=1) - 1
    return batch
