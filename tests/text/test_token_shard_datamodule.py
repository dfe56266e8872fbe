"""TokenShardDataModule: batch contract, packing, validation split and bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback

from datamodules import TokenShardDataModule
from datamodules.storage.range_reader import ChangedDuringRun
from datamodules.text.shard_metadata import ShardInfo, ShardMetadata
from tests.support import RecordingModel, all_tokens, fit_in_a_plain_script, make_token_shards, quiet_trainer


def setup_dm(path: Path, **kwargs) -> TokenShardDataModule:
    dm = TokenShardDataModule(path, **{"seq_len": 8, "batch_size": 4, **kwargs})
    dm.setup("fit")
    return dm


def test_batches_follow_the_batch_contract(tmp_path: Path) -> None:
    dm = setup_dm(make_token_shards(tmp_path, 1000, shard_tokens=64))
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    for value in batch.values():
        assert value.dtype == torch.int64 and value.shape == (4, 8) and value.is_contiguous()
    # Token t holds the value t: each window is consecutive and labels are the next tokens.
    assert torch.equal(batch["labels"], batch["input_ids"] + 1)
    assert torch.equal(batch["input_ids"] - batch["input_ids"][:, :1], torch.arange(8).expand(4, -1))


def test_windows_span_shard_boundaries_without_losing_tokens(tmp_path: Path) -> None:
    dm = setup_dm(make_token_shards(tmp_path, 8 * 40 + 1, shard_tokens=7), batch_size=40)
    (batch,) = list(dm.train_dataloader())
    assert sorted(batch["input_ids"][:, 0].tolist()) == list(range(0, 320, 8))
    assert torch.equal(batch["labels"], batch["input_ids"] + 1)


def test_packed_batches_restart_positions_and_mask_targets_across_documents(tmp_path: Path) -> None:
    dm = setup_dm(make_token_shards(tmp_path, 1000, doc_len=5), pack_sequences=True)
    batch = next(iter(dm.train_dataloader()))
    for row in range(4):
        tokens = batch["input_ids"][row]
        # Documents are 5 tokens long: a new document starts where the token value is a multiple of 5.
        starts = (tokens % 5 == 0).tolist()
        starts[0] = True
        expected_pos, expected_doc, pos, doc = [], [], -1, -1
        for is_start in starts:
            pos, doc = (0, doc + 1) if is_start else (pos + 1, doc)
            expected_pos.append(pos)
            expected_doc.append(doc)
        assert batch["position_ids"][row].tolist() == expected_pos
        assert batch["document_ids"][row].tolist() == expected_doc
        next_starts_doc = (tokens + 1) % 5 == 0
        assert torch.equal(batch["labels"][row] == -100, next_starts_doc)
        assert torch.equal(batch["labels"][row][~next_starts_doc], (tokens + 1)[~next_starts_doc])


def test_held_out_fraction_shares_no_token_with_training(tmp_path: Path) -> None:
    dm = setup_dm(make_token_shards(tmp_path, 801), val_fraction=0.25, batch_size=8)
    train = torch.cat([b["input_ids"] for b in dm.train_dataloader()])
    train_tokens = set(train.flatten().tolist()) | set((train[:, -1] + 1).tolist())
    val = [b for b in dm.val_dataloader()]
    val_tokens = {
        t
        for b in val
        for row, lab in zip(b["input_ids"], b["labels"], strict=True)
        if (lab != -100).any()
        for t in row.tolist() + [int(row[-1]) + 1]
    }
    assert val_tokens and not train_tokens & val_tokens


def test_validation_reads_every_window_once_and_pads_without_loss(tmp_path: Path) -> None:
    val_dir = make_token_shards(tmp_path / "val", 8 * 10 + 1)
    dm = setup_dm(make_token_shards(tmp_path / "train", 1000), val_dir=val_dir, batch_size=4)
    batches = list(dm.val_dataloader())
    assert len(batches) == 3
    rows = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    real = (labels != -100).any(dim=1)
    assert rows[real][:, 0].tolist() == list(range(0, 80, 8))
    assert real.sum() == 10 and (labels[~real] == -100).all()


def test_a_directory_of_npy_shards_without_metadata_is_read_with_its_stored_dtype(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.uint16))
    np.save(tmp_path / "b.npy", np.arange(100, 300, dtype=np.uint16))
    dm = setup_dm(tmp_path, batch_size=37)
    (batch,) = list(dm.train_dataloader())
    assert sorted(batch["input_ids"][:, 0].tolist()) == list(range(0, 296, 8))


def test_bin_shards_take_their_dtype_from_metadata(tmp_path: Path) -> None:
    np.arange(1000, dtype=np.uint32).tofile(tmp_path / "shard.bin")
    ShardMetadata("uint32", [ShardInfo("shard.bin", 1000)], 1000, 0, document_starts=None).write(tmp_path)
    batch = next(iter(setup_dm(tmp_path).train_dataloader()))
    assert torch.equal(batch["labels"], batch["input_ids"] + 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, "seq_len must be a positive integer, got 0"),
        ({"seq_len": -3}, "seq_len must be a positive integer, got -3"),
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\), got 1.0"),
        ({"val_fraction": 0.1, "val_dir": "v"}, "give val_dir"),
        ({"test_fraction": 0.1, "test_dir": "t"}, "give test_dir"),
        ({"test_fraction": 0.5, "val_fraction": 0.5}, "test_fraction=0.5 and val_fraction=0.5 leave no training data"),
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        ({"seq_len": 64.0}, "seq_len must be a positive integer, got 64.0"),
        ({"batch_size": 4.0}, "batch_size must be a positive integer, got 4.0"),
        ({"batch_size": True}, "batch_size must be a positive integer, got True"),
        ({"prefetch_factor": 4}, "prefetch_factor=4 needs num_workers > 0"),
    ],
)
def test_bad_arguments_fail_at_construction(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenShardDataModule(tmp_path, **{"seq_len": 8, "batch_size": 4, **kwargs})


def test_missing_directory_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^data_dir '.*nowhere' does not exist$"):
        TokenShardDataModule(tmp_path / "nowhere", seq_len=8, batch_size=4)
    with pytest.raises(ValueError, match=r"quickstart's data: run `python -m examples.quickstart` first"):
        TokenShardDataModule(".cache/quickstart/no_such_shards", seq_len=8, batch_size=4)


def first_tokens(loader: object) -> list[int]:
    """The first token of every row that takes a loss (padding rows take none)."""
    return [
        int(row[0]) for b in loader for row, lab in zip(b["input_ids"], b["labels"], strict=True) if (lab != -100).any()
    ]


def test_a_test_split_is_the_tail_after_validation_and_trainer_test_reads_each_window_once(tmp_path: Path) -> None:
    from tests.support import RecordingModel, quiet_trainer

    dm = TokenShardDataModule(
        make_token_shards(tmp_path, 801), seq_len=8, batch_size=4, val_fraction=0.2, test_fraction=0.1
    )
    model, trainer = RecordingModel(), quiet_trainer(max_steps=2)
    trainer.fit(model, datamodule=dm)
    # 801 tokens: 559 train, 161 validation (ceil of 20%), 81 test (ceil of 10%), in that order.
    assert first_tokens(dm.test_dataloader()) == list(range(720, 800, 8))
    assert first_tokens(dm.val_dataloader()) == list(range(559, 559 + 20 * 8, 8))
    assert max(first_tokens(dm.train_dataloader())) + 8 < 559
    trainer.test(model, datamodule=dm)
    assert len(model.test_rows) == len(set(model.test_rows)) == 10


def test_trainer_test_without_a_test_split_says_how_to_give_one(tmp_path: Path) -> None:
    from tests.support import RecordingModel, quiet_trainer

    dm = TokenShardDataModule(make_token_shards(tmp_path, 801), seq_len=8, batch_size=4)
    with pytest.raises(ValueError, match="TokenShardDataModule has no test split: give it test_dir or test_fraction"):
        quiet_trainer().test(RecordingModel(), datamodule=dm)


def test_a_fraction_too_small_for_a_window_names_the_split_and_both_counts(tmp_path: Path) -> None:
    dm = TokenShardDataModule(make_token_shards(tmp_path, 2000), seq_len=64, batch_size=4, val_fraction=0.01)
    message = (
        r"seq_len=64 needs at least 65 tokens, but .* has 20 tokens in the validation split "
        r"\(val_fraction=0.01 of 2000 tokens: 1980 train, 20 validation\)"
    )
    with pytest.raises(ValueError, match=message):
        dm.setup("fit")
    short = TokenShardDataModule(make_token_shards(tmp_path / "short", 50), seq_len=64, batch_size=4)
    with pytest.raises(ValueError, match=r"but .*short has 50 tokens in the training split$"):
        short.setup("fit")


def test_empty_directory_fails_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no token shards \(\*.npy or \*.bin\)"):
        setup_dm(tmp_path)


def test_bin_without_metadata_is_refused_not_guessed(tmp_path: Path) -> None:
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "shard.bin")
    with pytest.raises(ValueError, match=r"raw .bin shards \(shard.bin, ...\) but no metadata.json"):
        setup_dm(tmp_path)


def test_shard_size_not_a_multiple_of_the_dtype_is_refused(tmp_path: Path) -> None:
    (tmp_path / "shard.bin").write_bytes(b"\0" * 10)
    (tmp_path / "metadata.json").write_text(
        json.dumps(
            {"dtype": "uint32", "shards": [{"file": "shard.bin", "num_tokens": 2}], "num_tokens": 2, "num_documents": 0}
        )
    )
    with pytest.raises(ValueError, match="is 10 bytes, not a multiple of the uint32 item size 4"):
        setup_dm(tmp_path)


def test_metadata_token_count_disagreeing_with_the_file_is_refused(tmp_path: Path) -> None:
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "shard.bin")
    ShardMetadata("uint16", [ShardInfo("shard.bin", 900)], 900, 0, document_starts=None).write(tmp_path)
    with pytest.raises(ValueError, match="holds 1000 tokens but metadata.json says 900"):
        setup_dm(tmp_path)


def test_seq_len_longer_than_the_corpus_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seq_len=100 needs at least 101 tokens.* has 50 tokens"):
        setup_dm(make_token_shards(tmp_path, 50), seq_len=100)


def test_packing_without_document_boundaries_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(ValueError, match="pack_sequences=True needs document boundaries"):
        setup_dm(tmp_path, pack_sequences=True)


def test_unsupported_metadata_dtype_is_refused(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "shard.bin")
    (tmp_path / "metadata.json").write_text(
        json.dumps(
            {
                "dtype": "float32",
                "shards": [{"file": "shard.bin", "num_tokens": 5}],
                "num_tokens": 5,
                "num_documents": 0,
            }
        )
    )
    with pytest.raises(ValueError, match="metadata dtype 'float32' is not supported"):
        setup_dm(tmp_path)


def test_standalone_iteration_continues_where_the_last_epoch_stopped(tmp_path: Path) -> None:
    dm = setup_dm(make_token_shards(tmp_path, 8 * 4 * 3 + 1))
    loader = dm.train_dataloader()
    first, second = list(loader), list(loader)
    windows = [w for b in first + second for w in (b["input_ids"][:, 0] // 8).tolist()]
    assert sorted(windows[:12]) == sorted(windows[12:]) == list(range(12))
    assert dm.state_dict()["positions_consumed"] == 24


def test_signed_npy_shards_without_metadata_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(-5, 95, dtype=np.int32))
    with pytest.raises(ValueError, match=r"hold signed integers \(int32\) and no metadata.json"):
        setup_dm(tmp_path)


def test_a_truncated_npy_shard_names_the_file(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(1000, dtype=np.uint16))
    data = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "a.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"token shard .*a.npy is truncated or not a .npy file"):
        setup_dm(tmp_path)


def test_a_missing_document_starts_file_names_it(tmp_path: Path) -> None:
    make_token_shards(tmp_path, 500)
    (tmp_path / "document_starts.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"document_starts.npy, named in .*metadata.json, is missing"):
        setup_dm(tmp_path)


def test_a_global_batch_larger_than_the_data_is_an_error_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"takes 4 samples of source 'train', which has only 3: rows would repeat"):
        setup_dm(make_token_shards(tmp_path, 3 * 8 + 1))


def test_file_pattern_selects_the_shard_files(tmp_path: Path) -> None:
    np.save(tmp_path / "train_0.npy", np.arange(100, dtype=np.uint16))
    np.save(tmp_path / "valid_0.npy", np.arange(5000, 5100, dtype=np.uint16))
    dm = setup_dm(tmp_path, file_pattern="train_*.npy")
    starts = [int(b["input_ids"][r, 0]) for b in dm.train_dataloader() for r in range(4)]
    assert dm.sources[0].num_samples == 12 and max(starts) < 100


def test_pin_memory_is_off_without_a_gpu_and_prefetch_factor_reaches_the_loader(tmp_path: Path) -> None:
    dm = setup_dm(make_token_shards(tmp_path, 2000), num_workers=2, prefetch_factor=3)
    loader = dm.train_dataloader()
    assert loader.prefetch_factor == 3 and loader.pin_batches is False
    forced = setup_dm(tmp_path, pin_memory=True)
    with pytest.warns(UserWarning, match="pin_memory=True, but no CUDA device is available"):
        loader = forced.train_dataloader()
    assert not next(iter(loader))["input_ids"].is_pinned()


def test_fit_shows_a_data_summary_in_a_plain_script_with_no_logging_set_up(tmp_path: Path) -> None:
    make_token_shards(tmp_path / "shards", 8 * 40 + 1)
    shown, table = fit_in_a_plain_script(
        f"TokenShardDataModule({str(tmp_path / 'shards')!r}, seq_len=8, batch_size=4)", 25
    )
    assert "TokenShardDataModule: 10 steps per epoch of 4 samples (batch_size 4 x 1 data-parallel ranks" in shown
    assert table[0] == ["Source", "Samples", "Tokens", "Weight", "Passes in max_steps=25"]
    assert table[1] == ["0", "train", "40", "320", "1", "2.50"]


def write_megatron_pair(prefix: Path, documents: list[list[list[int]]]) -> None:
    """A ``.bin``/``.idx`` pair by the MMIDIDX rules: documents of sequences of uint16 tokens."""
    import struct

    sequences = [s for doc in documents for s in doc]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * 2
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    np.array([t for s in sequences for t in s], dtype=np.uint16).tofile(prefix.with_suffix(".bin"))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(doc_index)))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + doc_index.tobytes())


def test_megatron_bin_idx_pairs_read_as_our_shards_of_the_same_documents(tmp_path: Path) -> None:
    from datamodules import TokenShards
    from datamodules.text.shard_writer import ShardWriter

    rng = np.random.default_rng(0)
    docs = [
        [rng.integers(1, 60000, rng.integers(3, 40)).tolist() for _ in range(rng.integers(1, 4))] for _ in range(30)
    ]
    (tmp_path / "megatron").mkdir()
    write_megatron_pair(tmp_path / "megatron" / "a_text_document", docs[:20])
    write_megatron_pair(tmp_path / "megatron" / "b_text_document", docs[20:])
    writer = ShardWriter(tmp_path / "ours", "uint16", 100)
    for doc in docs:
        tokens = [t for sentence in doc for t in sentence]
        writer.add(np.array(tokens), np.array([len(tokens)]))
    writer.close().write(tmp_path / "ours")
    theirs, ours = TokenShards(tmp_path / "megatron"), TokenShards(tmp_path / "ours")
    assert theirs.dtype == np.uint16 and theirs.num_tokens == ours.num_tokens
    assert np.array_equal(all_tokens(theirs), all_tokens(ours)) and np.array_equal(
        theirs.document_starts, ours.document_starts
    )
    packed = setup_dm(tmp_path / "megatron", pack_sequences=True)
    reference = setup_dm(tmp_path / "ours", pack_sequences=True)
    assert [b["position_ids"].tolist() for b in packed.train_dataloader()] == [
        b["position_ids"].tolist() for b in reference.train_dataloader()
    ]


def test_a_megatron_index_with_a_wrong_header_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.idx").write_bytes(b"NOTMMIDX" + b"\0" * 40)
    (tmp_path / "x.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"x.idx is not a Megatron MMIDIDX index"):
        setup_dm(tmp_path)


class ShardRewriter(Callback):
    """Rewrites ``shard`` in place (same size, other tokens) after ``step``: a shard changed under a run."""

    def __init__(self, shard: Path, step: int) -> None:
        self.shard, self.step = shard, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            tokens = np.load(self.shard, mmap_mode="r+")
            tokens[:] = tokens[::-1].copy()
            tokens.flush()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_rewritten_in_place_under_a_run_stops_it_naming_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    monkeypatch.setattr("datamodules.text.token_shards.CHECK_EVERY", 0.0)  # checked at every read
    shards = make_token_shards(tmp_path / "shards", 8 * 40 + 1, shard_tokens=97)
    dm = TokenShardDataModule(shards, seq_len=8, batch_size=4, num_workers=workers)
    trainer = quiet_trainer(max_steps=20, callbacks=[ShardRewriter(shards / "shard_00001.npy", 2)])
    with pytest.raises(ChangedDuringRun, match=r"shard_00001.npy changed during the run: 516 bytes, mtime_ns"):
        trainer.fit(RecordingModel(), datamodule=dm)
    assert trainer.global_step < 20  # batches the workers read before the rewrite may still train
