"""``HiddenStatesDataModule``: packed rows of conversations and their verifier hidden states for
training speculative-decoding draft models (EAGLE-style), through the sample plan."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from datamodules.chat.conversation_rows import checked_rows
from datamodules.plan.arguments import require_existing, require_int
from datamodules.plan.bad_samples import BadSampleLog, check_policy
from datamodules.plan.datamodule import PlanDataModule
from datamodules.plan.hf_loading import is_saved_dataset, load_split
from datamodules.plan.multipack import OverLong
from datamodules.plan.sample_plan import SamplePlan
from datamodules.plan.worker_start import START_METHODS
from datamodules.speculative.generation_client import GenerationClient, GenerationServer
from datamodules.speculative.hidden_state_rows import MISSING_POLICIES, NOISES, Batch, HiddenStateRows
from datamodules.speculative.hidden_states_store import STORES
from datamodules.speculative.state_fetcher import ON_GENERATE, StateFetcher
from datamodules.storage.remote_files import RemoteFiles

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require_ratio(train_ratio: float) -> float:
    if isinstance(train_ratio, bool) or not isinstance(train_ratio, int | float) or not 0 < train_ratio < 1:
        raise ValueError(f"train_ratio must be a number in (0, 1), got {train_ratio!r}")
    return float(train_ratio)


def train_rows(num_rows: int, train_ratio: float) -> int:
    """Rows ``[0, k)`` train and ``[k, num_rows)`` validate, with ``k = int(num_rows * train_ratio)``:
    speculators' split (``Eagle3SampleFileDataset``), so a user moving over keeps the same validation set."""
    k = int(num_rows * require_ratio(train_ratio))
    if not 0 < k < num_rows:
        raise ValueError(
            f"train_ratio={train_ratio} of {num_rows} rows leaves {k} for training and {num_rows - k} for "
            "validation; both splits need at least one row"
        )
    return k


PROBE_ROWS = 16  # rows whose states' headers are read to learn their shape, before one listing


class HiddenStatesDataModule(PlanDataModule):
    """Trains a draft model on packed rows: one row of ``total_seq_len`` tokens per rank per step.

    Reads, unchanged, what the ``speculators`` project writes: a ``datasets`` ``save_to_disk`` folder
    with ``input_ids``, ``loss_mask`` and ``seq_len``, and ``hidden_states/hs_{i}.safetensors`` for
    dataset row ``i``, holding ``hidden_states`` ``[T, L, H]`` and ``token_ids`` ``[T]``. Rows are
    packed by multipack (``PackedRows``: best-fit decreasing, afresh every pass) and are the plan's
    samples: order, exact O(1) and elastic resume and coverage are the plan's, and the rows do not
    depend on the number of ranks. Batches, one row of ``total_seq_len`` per rank: ``input_ids``,
    ``loss_mask``, ``position_ids`` (restarting in every conversation), ``document_ids`` (``-1`` on
    padding): ``[1, T]``; ``hidden_states`` (layers ``1..L-1`` side by side) ``[1, T, (L-1) * H]`` and
    ``verifier_last_hidden_states`` ``[1, T, H]``, cast to ``dtype``.

    Args:
        data_dir: the ``save_to_disk`` folder.
        total_seq_len: tokens per packed row.
        hidden_states_dir: where the ``hs_{i}.safetensors`` files are; default ``data_dir/hidden_states``.
        train_ratio: rows ``[0, int(n * train_ratio))`` train, the rest validate (speculators' split); in (0, 1).
        test_ratio: the last ``int(n * test_ratio)`` rows of the held-out ones are a test split
            (``Trainer.test``) instead of validation; default 0: none, speculators' split unchanged.
        dtype: ``"bfloat16"`` (default), ``"float16"`` or ``"float32"``: the hidden states' dtype.
        on_missing: states missing or not matching their tokens: ``"raise"`` (default), ``"skip"``
            (counted, logged once each), ``"warn"`` (each also logged when met) or ``"generate"``
            (asked of ``server``; the ones that still fail are skipped and counted, and the server's
            circuit breaker stops training on every rank after ``max_failures`` of them in a row).
        server: the vLLM server(s) that generate missing states (``GenerationServer``: urls, served
            model, timeout, retries, validation retries, backoff, breaker); needs ``on_missing="generate"``.
        on_generate: a generated state is kept in the store (``"cache"``, default: later passes read
            it) or removed once read (``"delete"``).
        fetch_threads: conversations whose states are fetched at once per process (or worker); with
            more than one, a worker message holds enough rows to keep them all busy.
        noise, noise_std: training-only noise on ``hidden_states``: ``"uniform"`` on
            ``(-noise_std, noise_std)`` (its standard deviation is ``noise_std / sqrt(3)``) or
            ``"gaussian"`` with standard deviation ``noise_std``; default 0: none.
        over_long: a conversation longer than a row is ``"truncate"``-d (default) or ``"drop"``-ped.
        length_quantum: lengths are rounded up to a multiple of this for packing (more samples
            trade places between passes; the rows lose at most ``quantum - 1`` tokens a sample);
            default ``total_seq_len // 2048``, at least 1.
        preprocess: a function on each batch, such as
            ``datamodules.speculative.preprocess.shift_tokens_left`` (the EAGLE-3 shift).
        store: the hidden-states backend, a key of ``STORES`` (default ``"files"``).
        storage_options: for a ``data_dir`` or ``hidden_states_dir`` that is a URL (``s3://``, ``gs://``,
            ...), the fsspec filesystem's options (endpoint, credentials, ``anon``); kept out of checkpoints.
        file_cache_dir, file_cache_bytes: a node-local folder keeping hidden-state files read by URL
            (each by its URL and version: a changed object is fetched again), shared by the node's ranks
            and workers, and the most bytes it holds; default: no cache.
        file_cache_policy: which files leave the cache when it is full: ``"planned"`` (default), the one
            the node's ranks read furthest ahead in the plan (a file read later than all of those is not
            kept: Belady's rule); ``"lru"``, the least recently used.
        worker_start_method: how DataLoader workers start: ``"spawn"``, ``"fork"`` or ``"forkserver"``;
            default ``None``: spawn when this process has initialised CUDA or holds a client of the
            generation server (threads and connections a fork could deadlock on), else fork, which
            starts in a fraction of a second where spawn takes many.
        seed, num_workers, allow_plan_change, pin_memory, prefetch_factor, in_order, broadcast_within,
            split_sequence_for, sequence_split: see
            ``PlanDataModule`` (``in_order=False`` keeps one slow fetch from stalling the rank).

    Example::

        dm = HiddenStatesDataModule("data/sharegpt_llama", total_seq_len=8192, num_workers=4)
        trainer.fit(draft, datamodule=dm)
    """

    def __init__(
        self,
        data_dir: str,
        total_seq_len: int,
        hidden_states_dir: str | None = None,
        train_ratio: float = 0.9,
        test_ratio: float = 0.0,
        dtype: str = "bfloat16",
        on_missing: str = "raise",
        server: GenerationServer | None = None,
        on_generate: str = "cache",
        fetch_threads: int = 1,
        noise: str = "uniform",
        noise_std: float = 0.0,
        over_long: OverLong = "truncate",
        length_quantum: int | None = None,
        preprocess: Callable[[Batch], Batch] | None = None,
        store: str = "files",
        storage_options: dict[str, Any] | None = None,
        file_cache_dir: str | None = None,
        file_cache_bytes: int | None = None,
        file_cache_policy: str = "planned",
        worker_start_method: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        broadcast_within: str | list[str] | None = None,
        split_sequence_for: str | list[str] | None = None,
        sequence_split: str = "head_tail",
        in_order: bool = True,
    ) -> None:
        super().__init__(
            1,
            seed=seed,
            num_workers=num_workers,
            allow_plan_change=allow_plan_change,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            broadcast_within=broadcast_within,
            split_sequence_for=split_sequence_for,
            sequence_split=sequence_split,
            in_order=in_order,
        )
        self.data_dir = str(data_dir)
        require_existing("data_dir", self.data_dir)
        self.total_seq_len = require_int("total_seq_len", total_seq_len, 1)
        self.hidden_states_dir = str(hidden_states_dir or f"{self.data_dir.rstrip('/')}/hidden_states")
        self.storage_options = storage_options
        self.files = RemoteFiles(storage_options, file_cache_dir, file_cache_bytes, file_cache_policy)
        self.train_ratio = require_ratio(train_ratio)
        if isinstance(test_ratio, bool) or not isinstance(test_ratio, int | float) or not 0 <= test_ratio < 1:
            raise ValueError(f"test_ratio must be a number in [0, 1), got {test_ratio!r}")
        self.test_ratio = float(test_ratio)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.on_missing = check_policy(on_missing, MISSING_POLICIES, "on_missing")
        if (on_missing == "generate") != (server is not None):
            raise ValueError(
                f"on_missing={on_missing!r} with server={server!r}: generating states needs a server "
                "(server=GenerationServer(urls=[...], model=...)), and a server is used only by on_missing='generate'"
            )
        if isinstance(server, dict):
            server = GenerationServer(**server)
        self.server = server
        self.on_generate = check_policy(on_generate, ON_GENERATE, "on_generate")
        self.fetch_threads = require_int("fetch_threads", fetch_threads, 1)
        self.noise = check_policy(noise, NOISES, "noise")
        if isinstance(noise_std, bool) or not isinstance(noise_std, int | float) or not noise_std >= 0:
            raise ValueError(f"noise_std must be a number >= 0, got {noise_std!r}")
        self.noise_std = float(noise_std)
        self.over_long, self.length_quantum, self.preprocess = over_long, length_quantum, preprocess
        self.store = check_policy(store, tuple(STORES), "store")
        if worker_start_method is not None:
            check_policy(worker_start_method, START_METHODS, "worker_start_method")
        self.worker_start_method = worker_start_method
        self.save_hyperparameters(ignore=["preprocess", "server", "storage_options"])  # no credentials
        # Plain values, so ``torch.load(weights_only=True)`` reads the checkpoint.
        self.hparams["server"] = asdict(server) if server is not None else None

    test_options = "give it test_ratio (its held-out rows' last part)"

    def sequence_length(self) -> int:
        return self.total_seq_len

    def spawn_reasons(self) -> list[str]:
        reasons = ["CUDA is initialised in this process"] if torch.cuda.is_initialized() else []
        return reasons + (["this process holds a client of the generation server"] if self.server else [])

    def build_sources(self) -> list[tuple[str, HiddenStateRows, dict[str, HiddenStateRows]]]:
        dataset = self._load()
        first_val = train_rows(len(dataset), self.train_ratio)
        first_test = len(dataset) - int(len(dataset) * self.test_ratio)
        if first_test <= first_val:
            raise ValueError(
                f"test_ratio={self.test_ratio} of {len(dataset)} rows takes all {len(dataset) - first_val} held out by "
                f"train_ratio={self.train_ratio}: validation needs at least one row"
            )
        store = STORES[self.store](self.hidden_states_dir, self.files)
        client = None
        if self.server is not None:
            client = GenerationClient(self.server)
            client.check_model()
        retries = self.server.validation_retries if self.server else 0
        fetcher = StateFetcher(store, None, None, client, self.on_generate, retries, self.fetch_threads)
        fetcher.layers, fetcher.hidden_size = self.job(lambda: self._state_shape(fetcher, dataset))
        mean_length = float(np.mean(np.asarray(dataset.data.column("seq_len")))) if len(dataset) else 1.0
        common = {
            "total_seq_len": self.total_seq_len,
            "dtype": DTYPES[self.dtype],
            "seed": self.seed,
            "over_long": self.over_long,
            "length_quantum": self.length_quantum,
            "on_missing": self.on_missing,
            "max_failures": self.server.max_failures if self.server else None,
            # Rows enough for about four conversations per fetch thread: a message's fetches run in
            # waves of ``fetch_threads``, and the last, partly idle wave then costs little.
            "batches_per_message": math.ceil(
                (4 if self.fetch_threads > 1 else 1)
                * self.fetch_threads
                * min(mean_length, self.total_seq_len)
                / self.total_seq_len
            ),
            "preprocess": self.preprocess,
        }
        train = HiddenStateRows(
            dataset, 0, first_val, fetcher, noise=self.noise, noise_std=self.noise_std, name="train", **common
        )
        held = {"validation": HiddenStateRows(dataset, first_val, first_test, fetcher, name="validation", **common)}
        if first_test < len(dataset):
            held["test"] = HiddenStateRows(dataset, first_test, len(dataset), fetcher, name="test", **common)
        return [("train", train, held)]

    def _load(self) -> Any:
        if not is_saved_dataset(self.data_dir, self.storage_options):
            raise ValueError(f"data_dir {self.data_dir!r} is not a folder written by datasets' save_to_disk")
        return checked_rows(load_split(self.data_dir, None, storage_options=self.storage_options), self.data_dir)

    def _state_shape(self, fetcher: StateFetcher, dataset: Any) -> tuple[int, int]:
        """``(L, H)`` of the first cached state (when generating: of row 0's, generated if need be);
        every state must have them, so all ranks agree on shapes."""
        if fetcher.client is not None:
            ids = torch.as_tensor(dataset.with_format("numpy")[0]["input_ids"]).long()
            found = fetcher.fetch(0, ids)
            if found.states is None:
                raise ValueError(f"cannot learn the hidden states' shape from row 0: {found.reason}")
            return self._checked_shape(fetcher.store, 0, tuple(found.states["hidden_states"].shape[1:]))
        # A bounded probe: a few rows spread over the dataset (their headers only), then one listing.
        rows = len(dataset)
        probed = sorted(set(np.linspace(0, rows - 1, min(rows, PROBE_ROWS)).astype(int).tolist()))

        def listed() -> Iterator[int]:  # read only if the probe finds nothing
            yield from (row for row in fetcher.store.cached_indices() or [] if row < rows)

        for row in itertools.chain(probed, listed()):
            shape = fetcher.store.layers_and_width(row)
            if shape is not None:
                return self._checked_shape(fetcher.store, row, shape)
        raise ValueError(
            f"no hidden states found for any of the {rows} rows in {self.hidden_states_dir}: none for the "
            f"{len(probed)} rows probed, and its listing holds no hs_*.safetensors of these rows"
        )

    @staticmethod
    def _checked_shape(store: Any, row: int, shape: tuple[int, ...]) -> tuple[int, int]:
        layers, hidden_size = shape
        if layers < 2:
            raise ValueError(f"{store.describe(row)} holds {layers} layer; draft training needs at least 2")
        return int(layers), int(hidden_size)

    def build_plan(self, position: int, step: int) -> SamplePlan:
        # Packed rows arrive in the packer's own order, keyed by the pass; the plan adds no shuffle.
        return SamplePlan(tuple(self.sources), seed=self.seed, shuffle=False)

    @property
    def bad_samples(self) -> BadSampleLog:
        """Training conversations not trained on in this process so far (missing or invalid states)."""
        self._require_setup()
        return self._train.bad_samples

    @property
    def bad_validation_samples(self) -> BadSampleLog:
        """Validation conversations not evaluated in this process so far (missing or invalid states)."""
        self._require_setup()
        return self._vals[0][1].bad_samples
