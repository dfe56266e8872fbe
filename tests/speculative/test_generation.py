"""Hidden states generated on demand by a real HTTP server on 127.0.0.1 that runs a tiny random
``transformers`` model and writes real safetensors files: the protocol, every missing-state policy,
retries of each failure, failover, validation, the circuit breaker, caching, and a resume that never
asks for the states of conversations already trained."""

from __future__ import annotations

import logging
import socket
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from datamodules import GenerationServer, HiddenStatesDataModule
from datamodules.speculative.hidden_states_store import check_states
from examples.hidden_states_server import HiddenStatesServer
from tests.speculative.speculative_data import conversations, speculative_dataset, tiny_verifier
from tests.support import RecordingModel, quiet_trainer, real_rows, row_digest, sample_digests

ROWS, ROW_LEN, LAYERS, MODEL = 30, 64, [1, 2, 3], "tiny-llama"


@pytest.fixture(scope="module")
def verifier() -> torch.nn.Module:
    return tiny_verifier()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """Conversations with no hidden states at all: every one must be generated."""
    path = tmp_path / "data"
    conversations(ROWS).save_to_disk(str(path))
    return path


@pytest.fixture
def server(verifier: torch.nn.Module, tmp_path: Path):
    with HiddenStatesServer(verifier, MODEL, LAYERS, tmp_path / "served") as running:
        yield running


def generating(data_dir: Path, urls: list[str], fetch_threads: int = 1, **kw: object) -> HiddenStatesDataModule:
    options = {"urls": urls, "model": MODEL, "timeout": 1.0, "retries": 2, "backoff": 0.01, "max_failures": 50}
    options.update(kw.pop("server", {}))
    dm = HiddenStatesDataModule(
        str(data_dir),
        total_seq_len=ROW_LEN,
        dtype="float32",
        on_missing=kw.pop("on_missing", "generate"),
        server=GenerationServer(**options),
        fetch_threads=fetch_threads,
        **kw,
    )
    dm.setup("fit")
    return dm


def epoch_conversations(dm: HiddenStatesDataModule) -> tuple[list[dict], Counter]:
    batches = list(dm.train_dataloader())
    return batches, Counter(d for b in batches for d in sample_digests(b, real_rows(b)))


def training_digests(data_dir: Path, skip: tuple[int, ...] = ()) -> Counter:
    rows = datasets.load_from_disk(str(data_dir))["input_ids"][:27]  # train_ratio 0.9 of 30
    return Counter(row_digest(torch.tensor(r)) for i, r in enumerate(rows) if i not in skip)


def test_generated_states_give_the_batches_offline_generation_gives(
    data_dir: Path, server: HiddenStatesServer, tmp_path: Path
) -> None:
    offline = speculative_dataset(tmp_path / "offline", ROWS)
    reference = HiddenStatesDataModule(str(offline), total_seq_len=ROW_LEN, dtype="float32")
    reference.setup("fit")
    expected = list(reference.train_dataloader())
    generated = list(generating(data_dir, [server.url]).train_dataloader())
    assert len(generated) == len(expected)
    for got, want in zip(generated, expected, strict=True):
        for key in ("input_ids", "loss_mask", "position_ids", "document_ids"):
            assert torch.equal(got[key], want[key])
        for key in ("hidden_states", "verifier_last_hidden_states"):
            torch.testing.assert_close(got[key], want[key])  # one sequence a forward vs padded batches


def test_cache_keeps_valid_files_that_the_next_pass_reads_without_asking_the_server(
    data_dir: Path, server: HiddenStatesServer
) -> None:
    dm = generating(data_dir, [server.url])
    _, trained = epoch_conversations(dm)
    assert trained == training_digests(data_dir)
    rows = datasets.load_from_disk(str(data_dir))["input_ids"]
    for row in range(27):
        states = load_file(str(data_dir / "hidden_states" / f"hs_{row}.safetensors"))
        assert check_states(states, torch.tensor(rows[row]), len(LAYERS), 16) is None
    assert not list(server.output_dir.iterdir())  # the server's own copies are removed once cached
    asked = len(server.prompts)
    epoch_conversations(dm)
    assert len(server.prompts) == asked


def test_delete_generates_afresh_and_leaves_no_files(data_dir: Path, server: HiddenStatesServer) -> None:
    dm = generating(data_dir, [server.url], on_generate="delete")
    _, trained = epoch_conversations(dm)
    assert trained == training_digests(data_dir)
    assert not list((data_dir / "hidden_states").glob("hs_*")) and not list(server.output_dir.iterdir())
    asked = len(server.prompts)
    epoch_conversations(dm)
    assert len(server.prompts) == asked + 27


def first_time_each(fault: str):
    """A fault on the first request for each prompt; the retry of it succeeds."""
    seen: set[tuple[int, ...]] = set()

    def faults(number: int, prompt: list[int]) -> str | None:
        if tuple(prompt) in seen:
            return None
        seen.add(tuple(prompt))
        return fault

    return faults


@pytest.mark.parametrize("fault", ["error", "hang", "drop", "nan", "mismatch"])
def test_each_failure_is_retried_and_the_conversation_still_trained(
    data_dir: Path, server: HiddenStatesServer, fault: str
) -> None:
    server.faults, server.hang_seconds = first_time_each(fault), 3.0  # "hang" outlasts the 1 s timeout
    dm = generating(data_dir, [server.url], fetch_threads=4)
    _, trained = epoch_conversations(dm)
    assert trained == training_digests(data_dir)
    assert len(dm.bad_samples.reasons) == 0
    assert Counter(map(tuple, server.prompts)) == Counter({p: 2 for p in set(map(tuple, server.prompts))})


@pytest.mark.parametrize(("fault", "reason"), [("error", "HTTP 500"), ("nan", "NaN"), ("mismatch", "prompt_token_ids")])
def test_a_conversation_that_keeps_failing_is_skipped_counted_and_the_same_on_every_run(
    data_dir: Path, server: HiddenStatesServer, fault: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    bad = [tuple(datasets.load_from_disk(str(data_dir))["input_ids"][row]) for row in (4, 9)]
    server.faults = lambda n, prompt: fault if tuple(prompt) in bad else None
    with caplog.at_level(logging.WARNING, logger="datamodules"):
        dm = generating(data_dir, [server.url], on_generate="delete")
        batches, trained = epoch_conversations(dm)
    assert trained == training_digests(data_dir, skip=(4, 9))
    assert len(dm.bad_samples.reasons) == 2 and all(reason in r for r in dm.bad_samples.reasons.values())
    assert any("not trained on" in r.getMessage() for r in caplog.records)
    per_bad = Counter(p for p in map(tuple, server.prompts) if p in bad)
    # Three requests each: retries=2 after a 500, or validation_retries=2 after states that came back wrong.
    assert per_bad == Counter({bad[0]: 3, bad[1]: 3})
    again, _ = epoch_conversations(generating(data_dir, [server.url], on_generate="delete"))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(again, batches, strict=True))


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes


def test_requests_fail_over_to_a_second_endpoint(
    data_dir: Path, server: HiddenStatesServer, verifier: torch.nn.Module, tmp_path: Path
) -> None:
    with HiddenStatesServer(verifier, MODEL, LAYERS, tmp_path / "broken", faults=lambda n, p: "error") as broken:
        dm = generating(data_dir, [closed_port_url(), broken.url, server.url], fetch_threads=3)
        _, trained = epoch_conversations(dm)
    assert trained == training_digests(data_dir)
    assert len(broken.prompts) > 0 and len(server.prompts) >= 27


def test_the_circuit_breaker_stops_training_with_one_error(data_dir: Path, server: HiddenStatesServer) -> None:
    dm = generating(data_dir, [server.url], server={"max_failures": 3, "retries": 0})
    server.faults = lambda n, prompt: "error"
    model = RecordingModel()
    with pytest.raises(RuntimeError, match=r"stopped on every rank by rank\(s\) \[0\].* in a row \(max_failures=3\)"):
        quiet_trainer(max_steps=20, limit_val_batches=0).fit(model, datamodule=dm)
    assert len(model.records) <= 1  # stopped at the row where the third failure in a row came


def test_fetch_threads_keep_that_many_requests_in_flight(data_dir: Path, server: HiddenStatesServer) -> None:
    server.delay = 0.05
    epoch_conversations(generating(data_dir, [server.url], fetch_threads=6, on_generate="delete"))
    assert server.most_in_flight >= 4


def test_setup_refuses_a_server_that_does_not_serve_the_model_or_cannot_be_reached(
    data_dir: Path, server: HiddenStatesServer
) -> None:
    with pytest.raises(ValueError, match=rf"serves \['{MODEL}'\], not model 'other'"):
        generating(data_dir, [server.url], server={"model": "other"})
    with pytest.raises(ValueError, match="no generation server reachable"):
        generating(data_dir, [closed_port_url()])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"urls": []}, "needs at least one url"),
        ({"urls": ["localhost:8000"]}, r"url must be http\(s\)://host\[:port\], got 'localhost:8000'"),
        ({"model": ""}, "needs the served model id"),
        ({"timeout": -1}, "timeout must be a number >= 0, got -1"),
        ({"retries": 1.5}, "retries must be an integer >= 0, got 1.5"),
        ({"max_failures": 0}, "max_failures must be an integer >= 1, got 0"),
    ],
)
def test_bad_server_options_are_refused_at_construction(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationServer(**{"urls": ["http://127.0.0.1:8000"], "model": MODEL, **options})


def test_generate_needs_a_server_and_a_server_needs_generate(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generating states needs a server"):
        HiddenStatesDataModule(str(tmp_path), total_seq_len=ROW_LEN, on_missing="generate")
    with pytest.raises(ValueError, match="a server is used only by on_missing='generate'"):
        HiddenStatesDataModule(
            str(tmp_path), total_seq_len=ROW_LEN, server={"urls": ["http://127.0.0.1:1"], "model": MODEL}
        )
    with pytest.raises(ValueError, match=r"on_generate must be one of \('cache', 'delete'\), got 'keep'"):
        HiddenStatesDataModule(str(tmp_path), total_seq_len=ROW_LEN, on_generate="keep")


def test_a_resumed_run_never_asks_for_the_states_of_conversations_already_trained(
    data_dir: Path, server: HiddenStatesServer, tmp_path: Path
) -> None:
    def fit(max_steps: int, resume: Path | None = None, every: int = 0) -> list[dict]:
        dm = HiddenStatesDataModule(
            str(data_dir),
            total_seq_len=ROW_LEN,
            on_missing="generate",
            on_generate="delete",
            server={"urls": [server.url], "model": MODEL},
        )
        checkpoints = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)] if every else []
        model = RecordingModel()
        quiet_trainer(max_steps=max_steps, callbacks=checkpoints, limit_val_batches=0).fit(
            model, datamodule=dm, ckpt_path=resume
        )
        return model.records

    before = fit(7, every=5)
    asked_before = len(server.prompts)
    after = fit(10, resume=next(tmp_path.glob("*-step=5.ckpt")))
    trained_before = {d for r in before if r["step"] < 5 for d in r["rows"]}
    asked_after = {row_digest(torch.tensor(p)) for p in server.prompts[asked_before:]}
    row0 = row_digest(torch.tensor(datasets.load_from_disk(str(data_dir))["input_ids"][0]))
    assert not (asked_after - {row0}) & trained_before  # row 0 teaches setup the states' shape
    assert {d for r in after for d in r["rows"]} <= asked_after
