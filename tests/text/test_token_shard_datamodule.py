"""TokenShardDataModule: batch contract, packing, validation split and bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import TokenShardDataModule
from datamodules.text.shard_metadata import ShardInfo, ShardMetadata
from tests.support import make_token_shards


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
        ({"num_workers": -1}, "num_workers must be >= 0, got -1"),
    ],
)
def test_bad_arguments_fail_at_construction(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenShardDataModule(tmp_path, **{"seq_len": 8, "batch_size": 4, **kwargs})


def test_missing_directory_fails_at_setup(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        setup_dm(tmp_path / "nowhere")


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
