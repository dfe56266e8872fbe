"""A streamed HF text source inside a ``MixtureDataModule``, beside token shards, with a phase change.

The plan decides how many rows of each source every global batch holds; the stream's rows are the
rank's next windows of the stream, in its readers' order. Token-shard tokens start at ``ID`` and the
stream's are a tokenizer's ids (below 300), so a row's first token names its source.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import HFTextSource, MixtureComponent, MixtureDataModule, PhaseScheduler, TokenShardSource
from datamodules.mixture import mixture_probabilities
from datamodules.plan.sample_plan import Segment
from datamodules.text.text_stream import TextStream
from tests.distributed_support import Run, train_record
from tests.support import RecordingModel, make_token_shards, quiet_trainer, row_digest
from tests.text.test_hf_stream import parquet, trained_tokenizer

SEQ_LEN, BATCH, ID = 8, 5, 10**6
BASE = {"shards": 0.7, "web": 0.3}
PHASE_STEP = 6
PHASES = [{"start_step": PHASE_STEP, "dataset_weights": {"shards": 0.25, "web": 0.75}, "lr_scale": 1.0}]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str], Path]:
    """A tokenizer, the stream's parquet files (12 row groups) and the token shards (400 windows)."""
    root = tmp_path_factory.mktemp("mixture_stream")
    shards = make_token_shards(root / "shards", 400 * SEQ_LEN + 1, shard_tokens=777, first_value=ID)
    return trained_tokenizer(root), parquet(root, 3, row_group=25), shards


def web(tokenizer: str, files: list[str]) -> HFTextSource:
    return HFTextSource("parquet", tokenizer, data_files=files, streaming=True)


def make_dm(data: tuple[str, list[str], Path], **kwargs) -> MixtureDataModule:
    tokenizer, files, shards = data
    components = [
        MixtureComponent("shards", BASE["shards"], TokenShardSource(str(shards))),
        MixtureComponent("web", BASE["web"], web(tokenizer, files)),
    ]
    return MixtureDataModule(components, **{"seq_len": SEQ_LEN, "batch_size": BATCH, **kwargs})


def fit(data, max_steps: int, workers: int = 0, ckpt_dir: Path | None = None, resume: Path | None = None) -> list:
    callbacks = [PhaseScheduler(PHASES)]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1))
    model = RecordingModel()
    trainer = quiet_trainer(max_steps=max_steps, callbacks=callbacks, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=make_dm(data, num_workers=workers), ckpt_path=resume)
    return model.records


def stream_rows(records: list[dict]) -> list[str]:
    """The stream's rows, in the order trained."""
    return [d for r in records for start, d in zip(r["starts"], r["rows"], strict=True) if start < ID]


def windows(stream: TextStream, reads: list, count: int) -> list[str]:
    """The first ``count`` window digests of ``reads`` (each an iterator of a reader's raw batches), taken
    in turn, as a rank's DataLoader workers hand them over."""
    out: list[str] = []
    for i in range(count):
        out += [row_digest(row) for row in stream.to_batch(next(reads[i % len(reads)])[0])["input_ids"]]
    return out


def test_each_batch_holds_the_plans_count_of_stream_windows_in_the_streams_order(data) -> None:
    records = fit(data, 12)
    web_rows = [sum(start < ID for start in r["starts"]) for r in records]
    plan = [Segment(0, BATCH, mixture_probabilities(list(w.values()), 1.0)).counts(np.arange(6))[:, 1].tolist()
            for w in (BASE, {**BASE, **PHASES[0]["dataset_weights"]})]  # fmt: skip
    assert web_rows == plan[0] + plan[1]
    # Floor or ceiling of the share, 1.5 then 3.75 of 5 rows, and the share tracked within a row.
    assert set(web_rows[:PHASE_STEP]) == {1, 2} and set(web_rows[PHASE_STEP:]) == {3, 4}
    assert abs(sum(web_rows[:PHASE_STEP]) - 1.5 * PHASE_STEP) <= 1
    stream = make_dm(data).build_sources()[1][1]
    assert (
        stream_rows(records)
        == windows(stream, [stream.read(0, 1, None)], math.ceil(sum(web_rows) / BATCH))[: sum(web_rows)]
    )
    shard_starts = [s for r in records for s in r["starts"] if s >= ID]
    assert len(set(shard_starts)) == len(shard_starts)  # no window twice within the pass


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_before_the_phase_change_trains_the_uninterrupted_batches(data, tmp_path: Path, workers: int) -> None:
    uninterrupted = fit(data, 12, workers)
    stopped = fit(data, 6, workers, ckpt_dir=tmp_path)
    resumed = fit(data, 12, workers, resume=next(tmp_path.glob("*step=4.ckpt")))
    assert [r["digest"] for r in stopped[:4] + resumed] == [r["digest"] for r in uninterrupted]
    assert stream_rows(stopped[:4] + resumed) == stream_rows(uninterrupted)


def test_a_mixture_of_streams_only_is_refused_at_setup(data) -> None:
    tokenizer, files, _ = data
    dm = MixtureDataModule([MixtureComponent("web", 1.0, web(tokenizer, files))], seq_len=SEQ_LEN, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"sources \['web'\] are all streams; a plan needs at least one map-style"):
        dm.setup("fit")


@pytest.fixture(scope="module")
def ddp_run(data, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 ranks x 2 workers on gloo, 8 steps, a checkpoint every 4."""
    tokenizer, files, shards = data
    args = ["--mixture", f"shards={shards}:{BASE['shards']}", "--tokenizer", tokenizer]
    args += ["--mixture-stream", f"web:{BASE['web']}:{','.join(files)}", "--phases", json_phases()]
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--workers", "2", "--devices", "2"]
    args += ["--strategy", "ddp", "--max-steps", "8", "--every-n-steps", "4"]
    return train_record(args, tmp_path_factory.mktemp("ddp_mixture_stream"))


def json_phases() -> str:
    import json

    return json.dumps(PHASES)


def test_two_ddp_ranks_each_take_their_own_readers_windows_in_turn(data, ddp_run: Run) -> None:
    stream = make_dm(data).build_sources()[1][1]
    for rank in (0, 1):
        trained = stream_rows(ddp_run.records(rank))
        reads = [stream.read(rank * 2 + worker, 4, None) for worker in (0, 1)]
        assert trained == windows(stream, reads, math.ceil(len(trained) / BATCH))[: len(trained)]


def test_a_2_rank_checkpoint_resumed_on_1_rank_trains_what_each_rank_left_then_the_readers_work_dealt_to_it(
    data, ddp_run: Run
) -> None:
    checkpoint = ddp_run.checkpoint(4)
    model = RecordingModel()
    trainer = quiet_trainer(max_steps=12, callbacks=[PhaseScheduler(PHASES)], num_sanity_val_steps=0)
    trainer.fit(model, datamodule=make_dm(data), ckpt_path=checkpoint)
    saved = torch.load(checkpoint, weights_only=True)["MixtureDataModule"]["streams"]["web"]
    left = [saved["data_parallel_ranks"][r]["left"] for r in (0, 1)]
    stream = make_dm(data).build_sources()[1][1]
    state = stream.redeal(saved["readers"], 4, 1)[0]
    trained = stream_rows(model.records)
    expected = [row_digest(row) for part in left if part for row in stream.to_batch(
        {k: v.numpy() for k, v in part.items()})["input_ids"]]  # fmt: skip
    expected += windows(stream, [stream.read(0, 1, state)], math.ceil(len(trained) / BATCH))
    assert len(model.records) == 8 and len(trained) > sum(len(part.get("tokens", [])) for part in left) > 0
    assert trained == expected[: len(trained)]
    before = stream_rows([r for rank in (0, 1) for r in ddp_run.records(rank) if r["step"] < 4])
    assert not set(before) & set(trained)  # no window trained on both sides of the resize


def test_a_tensor_parallel_pair_reads_the_stream_once_and_resumes_exactly(data, tmp_path: Path) -> None:
    """1 data-parallel x 2 tensor-parallel ranks, the first reading for both (``broadcast_within``): both
    train one rank's batches; the checkpoint holds the reading rank's stream state, not its peer's."""
    tokenizer, files, shards = data
    args = ["--mixture", f"shards={shards}:{BASE['shards']}", "--tokenizer", tokenizer]
    args += ["--mixture-stream", f"web:{BASE['web']}:{','.join(files)}", "--phases", json_phases()]
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--workers", "2", "--devices", "2"]
    args += ["--strategy", "ddp", "--mesh", "1x2", "--broadcast-within", "tensor_parallel", "--max-steps", "8"]
    uninterrupted = train_record([*args, "--every-n-steps", "4"], tmp_path / "whole")
    assert uninterrupted.records(0) == uninterrupted.records(1)
    # Resumed twice: the second checkpoint is written after a resume, when the peer holds a restored state.
    resumed = train_record(
        [*args, "--resume", str(uninterrupted.checkpoint(4)), "--every-n-steps", "6"], tmp_path / "r1"
    )
    again = train_record([*args, "--resume", str(resumed.checkpoint(6))], tmp_path / "r2")
    digests = [r["digest"] for r in uninterrupted.records(0)]
    assert [r["digest"] for r in resumed.records(0)] == digests[4:]
    assert [r["digest"] for r in again.records(0)] == digests[6:]
    stream = make_dm(data).build_sources()[1][1]
    trained = stream_rows(uninterrupted.records(0))
    reads = [stream.read(worker, 2, None) for worker in (0, 1)]  # one data-parallel rank, 2 workers
    assert trained == windows(stream, reads, math.ceil(len(trained) / BATCH))[: len(trained)]


def test_a_stream_beside_a_source_of_other_samples_is_refused_at_setup(data, tmp_path: Path) -> None:
    from datamodules import ImageTextSource
    from tests.vision.image_data import image_folder

    tokenizer, files, _ = data
    pictures = ImageTextSource(
        "imagefolder", tokenizer=tokenizer, num_image_tokens=2, image_size=8,
        load_kwargs={"data_dir": str(image_folder(tmp_path / "pictures", 8))},
    )  # fmt: skip
    components = [MixtureComponent("pictures", 0.5, pictures), MixtureComponent("web", 0.5, web(tokenizer, files))]
    dm = MixtureDataModule(components, seq_len=SEQ_LEN, batch_size=2, allow_mixed_tokenizers=True)
    with pytest.raises(ValueError, match=r"the streamed source 'web' gives token windows, but source 'pictures' gives"):
        dm.setup("fit")
