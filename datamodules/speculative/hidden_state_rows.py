"""``HiddenStateRows``: conversations and their verifier hidden states packed into rows of
``total_seq_len`` tokens, a plan source (the plan's samples are the packed rows).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from datamodules.chat.conversation_rows import ConversationRows
from datamodules.plan.bad_samples import BadSample, BadSampleLog
from datamodules.plan.multipack import OverLong
from datamodules.plan.recycled_buffers import RecycledBuffers, nbytes_of, release_returned, views
from datamodules.plan.stopping import STOP
from datamodules.speculative.generation_client import CircuitBreaker
from datamodules.speculative.hidden_states_store import StoredBytes
from datamodules.speculative.state_fetcher import Outcome, StateFetcher
from datamodules.storage.locations import is_url
from datamodules.storage.planned_reads import PlannedReads
from datamodules.storage.remote_files import LOCAL_FILES, url_key

log = logging.getLogger(__name__)

MISSING_POLICIES = ("generate", "skip", "warn", "raise")
NOISES = ("uniform", "gaussian")
Batch = dict[str, torch.Tensor]
TOKEN_KEYS = ("input_ids", "loss_mask", "position_ids")


class HiddenStateRows(ConversationRows, PlannedReads):
    """Rows ``[first, stop)`` of a tokenized dataset, packed by multipack, with hidden states from ``fetcher``.

    A row gives ``input_ids``, ``loss_mask``, ``position_ids`` (restarting in every conversation),
    ``document_ids`` (the conversation's place in the row, ``-1`` on padding): ``[B, total_seq_len]``;
    ``hidden_states`` (layers ``1..L-1`` side by side) ``[B, total_seq_len, (L-1) * H]`` and
    ``verifier_last_hidden_states`` (layer ``L``) ``[B, total_seq_len, H]``, cast to ``dtype`` as they
    are copied in. A conversation whose states are missing or do not match its tokens is never
    trained on: ``on_missing="raise"`` names it, ``"skip"`` counts it, ``"warn"`` also logs each,
    ``"generate"`` has a server generate it (``fetcher``) and counts the ones that still fail; the
    rest of its row closes up, and no other row moves.

    Args:
        dataset: a ``datasets.Dataset`` with ``input_ids``, ``loss_mask`` and ``seq_len``.
        first, stop: the dataset rows of this split.
        fetcher: reads (and generates) the hidden states; knows the ``L`` and ``H`` every state must have.
        total_seq_len: tokens per packed row.
        dtype: the dtype of the hidden-state tensors.
        seed: the data-order seed (the packing of every pass follows it).
        over_long, length_quantum: see ``PackedRows``.
        on_missing: ``"raise"`` | ``"skip"`` | ``"warn"`` | ``"generate"``.
        max_failures: with ``"generate"``, the circuit breaker: after this many conversations in a row
            (in plan order) failed to generate, batches carry a stop message (``STOP``), and the
            DataModule stops training on every rank at once.
        noise, noise_std: noise added to ``hidden_states`` (never to the verifier's last layer):
            ``"uniform"`` on ``(-noise_std, noise_std)``, or ``"gaussian"`` with standard deviation
            ``noise_std``; drawn from the row's plan key, so the same on every run and after resume.
        preprocess: called on every batch of rows before it leaves the loader (the EAGLE-3 shift).
    """

    uses_sample_keys = True  # noise draws from the row's plan key
    batches_per_message = 1  # a row of hidden states is worth a message of its own between processes;
    # more when fetches are slow and concurrent (``fetch_many`` spreads a message's conversations over threads)

    def __init__(
        self,
        dataset: Any,
        first: int,
        stop: int,
        fetcher: StateFetcher,
        *,
        total_seq_len: int,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        over_long: OverLong = "truncate",
        length_quantum: int | None = None,
        on_missing: str = "raise",
        max_failures: int | None = None,
        batches_per_message: int = 1,
        noise: str = "uniform",
        noise_std: float = 0.0,
        preprocess: Callable[[Batch], Batch] | None = None,
        name: str = "train",
    ) -> None:
        super().__init__(
            dataset,
            np.arange(first, stop),
            total_seq_len=total_seq_len,
            seed=seed,
            over_long=over_long,
            length_quantum=length_quantum,
            name=name,
        )
        self.first, self.stop = first, stop
        self.fetcher, self.store = fetcher, fetcher.store
        self.layers, self.hidden_size, self.dtype = fetcher.layers, fetcher.hidden_size, dtype
        self.batches_per_message = batches_per_message
        self.on_missing, self.noise, self.noise_std = on_missing, noise, noise_std
        self.preprocess = preprocess
        identity = (
            dataset._fingerprint,
            first,
            stop,
            self.packed.fingerprint,
            self.layers,
            self.hidden_size,
            str(dtype),
        )
        self.fingerprint = hashlib.blake2b(repr(identity).encode(), digest_size=16).hexdigest()
        self.details = {"rows": f"[{first}, {stop})", "total_seq_len": total_seq_len}
        self.bad_samples = BadSampleLog("hidden states of %s missing or invalid (%s): not trained on")
        self.breaker = CircuitBreaker(max_failures)
        self.buffers = RecycledBuffers()
        self.files = getattr(self.store, "files", LOCAL_FILES)
        self._start_planning()

    @property
    def plans_file_reads(self) -> bool:
        """Whether the states' files, in a bucket, go through a cache that evicts by the plan's next use."""
        return self.files.plans_ahead and is_url(getattr(self.store, "directory", ""))

    @property
    def uses_positions(self) -> bool:  # where each row is read, for a cache planned by the plan
        return self.plans_file_reads

    def file_keys(self, indices: np.ndarray, passes: np.ndarray | None = None) -> np.ndarray:
        """The ``url_key`` of each of a row's conversations' state files (``[rows, most in a row]``, 0
        past a row's last): a row packs other conversations every pass."""
        packed = self.mapped()
        passes = np.zeros(len(indices), dtype=np.int64) if passes is None else passes
        rows = [packed.row(p, i).tolist() for i, p in zip(np.asarray(indices).tolist(), passes.tolist(), strict=True)]
        keys = np.zeros((len(rows), max(map(len, rows), default=0)), dtype=np.uint64)
        for r, conversations in enumerate(rows):
            keys[r, : len(conversations)] = [url_key(self.store.path(self.first + c)) for c in conversations]
        return keys

    @classmethod
    def join(cls, parts: list[HiddenStateRows]) -> HiddenStateRows:
        raise ValueError("hidden-state rows are packed per source and cannot be mixed with other sources")

    def fetch(
        self, indices: np.ndarray, keys: np.ndarray, passes: np.ndarray, positions: np.ndarray | None = None
    ) -> dict[str, Any]:
        extra = {"keys": keys, "passes": passes} | ({} if positions is None else {"positions": positions})
        return self.fetch_many([(indices, extra)])[0]

    def fetch_many(self, calls: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> list[dict[str, Any]]:
        """``fetch`` of several spans at once: their conversations' states are fetched together,
        ``fetch_threads`` at a time, so one slow fetch overlaps the others."""
        packed = self.mapped()
        rows = [
            [
                packed.row(pass_, row).tolist()
                for row, pass_ in zip(indices.tolist(), extra["passes"].tolist(), strict=True)
            ]
            for indices, extra in calls
        ]
        wanted = [self.first + c for span in rows for row in span for c in row]
        # Where the plan reads each conversation (its row's position), for a cache planned by it.
        at = None
        if all("positions" in extra for _, extra in calls):
            spans = zip(rows, calls, strict=True)
            at = [
                (self.planned_uses, p)
                for span, (_, extra) in spans
                for row, p in zip(span, extra["positions"].tolist(), strict=True)
                for _ in row
            ]
        tokens = self.conversations(wanted)
        ids = [torch.tensor(tokens[row]["input_ids"], dtype=torch.int64) for row in wanted]
        counts: dict[str, Any] = {}
        with self.count_cache(counts):
            outcomes = dict(zip(wanted, self.fetcher.fetch_all(wanted, ids, at), strict=True))
        raws = [
            self._assemble(span, extra["keys"], tokens, outcomes) for span, (_, extra) in zip(rows, calls, strict=True)
        ]
        raws[0].update(counts)  # the message's counts ride on its first batch
        return raws

    def _usable(self, row: int, outcome: Outcome, skipped: list[tuple[str, str]]) -> bool:
        if outcome.states is not None:
            return True
        where = f"hidden states of {self.store.describe(row)} (dataset row {row})"
        if self.on_missing == "raise":
            raise BadSample(
                f"{where}: {outcome.reason} (on_missing='skip' leaves such conversations out and counts them)"
            )
        if self.on_missing == "warn":
            log.warning("%s: %s; not trained on", where, outcome.reason)
        skipped.append((self.store.describe(row), outcome.reason))
        return False

    def _assemble(
        self, span: list[list[int]], keys: np.ndarray, tokens: dict, outcomes: dict[int, Outcome]
    ) -> dict[str, Any]:
        rows, length = len(span), self.total_seq_len
        # One buffer for the whole micro-batch, reused once nothing refers to it (``RecycledBuffers``);
        # in a worker, in shared memory: the message to the main process then passes it, not a copy.
        layout = {key: ((rows, length), torch.int64) for key in (*TOKEN_KEYS, "document_ids")}
        # Every layer of a conversation in one contiguous copy, in the layout the files have; the
        # auxiliary layers and the last are views of it. Padding is zeroed once a row is filled.
        layout["states"] = ((rows, length, self.layers, self.hidden_size), self.dtype)
        shared = torch.utils.data.get_worker_info() is not None
        buffer, ticket = self.buffers.take(nbytes_of(layout), shared)
        batch = views(buffer, layout)
        for key in TOKEN_KEYS:
            batch[key].zero_()
        batch["document_ids"].fill_(-1)
        states = batch.pop("states")
        skipped: list[tuple[str, str]] = []
        generated: list[bool] = []  # in generation mode: whether each conversation's states came, in order
        for b, (conversations, key) in enumerate(zip(span, keys.tolist(), strict=True)):
            filled = document = 0
            for conversation in conversations:
                row = self.first + conversation
                outcome = outcomes[row]
                generated.append(not outcome.generation_failed)
                if not self._usable(row, outcome, skipped):
                    continue
                ids = tokens[row]
                n = min(len(ids["input_ids"]), length)
                at = slice(filled, filled + n)
                batch["input_ids"][b, at] = torch.tensor(ids["input_ids"][:n])  # copies: Arrow's buffers are read-only
                batch["loss_mask"][b, at] = torch.tensor(ids["loss_mask"][:n])
                batch["position_ids"][b, at] = torch.arange(n)
                batch["document_ids"][b, at] = document
                copy_states(states[b, at], outcome.states["hidden_states"])
                filled, document = filled + n, document + 1
            states[b, filled:] = 0
            if self.noise_std > 0 and filled:
                self._add_noise(states[b, :filled, :-1], key)
        # Layers 1..L-1 side by side and the last layer: views of the one buffer (rows of stride L x H).
        batch["hidden_states"] = states[:, :, :-1].flatten(2)
        batch["verifier_last_hidden_states"] = states[:, :, -1]
        return {**batch, "skipped": skipped, "generated": generated, "ticket": ticket}

    def _add_noise(self, hidden: torch.Tensor, key: int) -> None:
        generator = torch.Generator().manual_seed(key & (2**63 - 1))
        if self.noise == "uniform":
            noise = torch.rand(hidden.shape, generator=generator).mul_(2).sub_(1).mul_(self.noise_std)
        else:
            noise = torch.randn(hidden.shape, generator=generator).mul_(self.noise_std)
        hidden.add_(noise.to(hidden.dtype))

    def to_batch(self, raw: dict[str, Any]) -> Batch:
        self.bad_samples.record(raw["skipped"])
        self.add_cache_counts(raw)
        release_returned()  # the buffers of batches let go of go back to their workers
        batch = {key: value for key, value in raw.items() if key not in ("skipped", "generated", "valid", "ticket")}
        batch = self.preprocess(batch) if self.preprocess is not None else batch
        stop = self.breaker.record(raw["generated"], raw["skipped"])
        return batch if stop is None else {**batch, STOP: stop}

    def mask_rows(self, batch: Batch, invalid: torch.Tensor) -> None:
        """Padding rows (the tail of a validation split) take no loss."""
        batch["loss_mask"][invalid] = 0


def copy_states(out: torch.Tensor, states: torch.Tensor | StoredBytes) -> None:
    """The first ``len(out)`` positions of ``states`` into ``out``: one copy, cast to ``out``'s dtype on
    the way; bytes in a local file of that dtype are read into ``out`` directly."""
    if isinstance(states, StoredBytes) and states.dtype == out.dtype:
        states.read_into(out)
    elif isinstance(states, StoredBytes):
        out.copy_(load_file(states.path)["hidden_states"][: len(out)])
    else:
        out.copy_(states[: len(out)])
