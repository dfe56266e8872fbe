"""Context parallelism (``split_sequence_for``): each rank of a group trains on its share of every row.

The shares are checked against the formula written here and against torch's own head-tail load
balancer; a real 2-rank job (a ``context_parallel`` device mesh on gloo) trains a tiny attention model
on its shares, and its loss, gathered over the group, equals the loss of one process on whole rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from datamodules import TokenShardDataModule
from datamodules.plan.sequence_split import SequenceSplit
from tests.distributed_support import REPO, free_port, ranks, run_processes
from tests.support import make_token_shards

SEQ_LEN, BATCH, STEPS = 16, 2, 4


def head_tail(length: int, size: int, rank: int) -> list[int]:
    """Chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size``, as Megatron's context parallelism cuts a row."""
    chunk = length // (2 * size)
    return list(range(rank * chunk, (rank + 1) * chunk)) + list(
        range((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    )


@pytest.mark.parametrize(("length", "size"), [(8, 2), (12, 3), (16, 4), (32, 2)])
def test_head_tail_shares_are_the_formula_and_torch_s_balancer(length: int, size: int) -> None:
    shares = [SequenceSplit(rank, size).indices(length).tolist() for rank in range(size)]
    assert shares == [head_tail(length, size, rank) for rank in range(size)]
    assert sorted(sum(shares, [])) == list(range(length))  # every position on exactly one rank
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    except ImportError:  # a private module: compared where this torch has it
        return
    torch_order = _HeadTailLoadBalancer(length, size, "cpu")._generate_indices()[0].tolist()
    share = length // size
    assert shares == [torch_order[rank * share : (rank + 1) * share] for rank in range(size)]


def test_contiguous_shares_are_speculators_ulysses_chunks() -> None:
    row = torch.arange(24)[None]
    for rank in range(3):
        # speculators' split_batch_for_sp keeps tensor.chunk(sp_size, dim=1)[sp_rank]
        assert SequenceSplit(rank, 3, "contiguous").indices(24).tolist() == row.chunk(3, dim=1)[rank][0].tolist()


def packed_batch(tmp_path: Path) -> dict[str, torch.Tensor]:
    data = make_token_shards(tmp_path / "data", 8 * SEQ_LEN + 1, doc_len=5)
    dm = TokenShardDataModule(data, seq_len=SEQ_LEN, batch_size=BATCH, pack_sequences=True)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


@pytest.mark.parametrize("layout", ["head_tail", "contiguous"])
def test_every_per_token_tensor_is_cut_alike_and_the_row_s_description_stays_whole(tmp_path: Path, layout: str) -> None:
    full = packed_batch(tmp_path)
    full["loss_mask"] = (full["labels"] != -100).long()
    full["hidden_states"] = torch.randn(BATCH, SEQ_LEN, 6)
    full["attention_mask"] = torch.ones(BATCH, 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
    shares = [SequenceSplit(rank, 2, layout)(full) for rank in range(2)]
    for rank, share in enumerate(shares):
        index = head_tail(SEQ_LEN, 2, rank) if layout == "head_tail" else list(range(rank * 8, rank * 8 + 8))
        assert share["sequence_index"].tolist() == index
        for key in ("input_ids", "labels", "position_ids", "loss_mask", "hidden_states"):
            assert torch.equal(share[key], full[key][:, index]), key
        # The block mask: this rank's queries, every key of the row.
        assert torch.equal(share["attention_mask"], full["attention_mask"][:, :, index, :])
        assert torch.equal(share["document_ids"], full["document_ids"])
        assert int(share["full_seq_len"]) == SEQ_LEN
    # Put side by side and reordered by their positions, the shares are the batch.
    order = torch.argsort(torch.cat([s["sequence_index"] for s in shares]))
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(torch.cat([s[key] for s in shares], dim=1)[:, order], full[key])


def test_rows_without_positions_get_them_before_the_cut(tmp_path: Path) -> None:
    data = make_token_shards(tmp_path / "data", 8 * SEQ_LEN + 1)
    dm = TokenShardDataModule(data, seq_len=SEQ_LEN, batch_size=BATCH)
    dm.setup("fit")
    full = next(iter(dm.train_dataloader()))
    assert "position_ids" not in full
    share = SequenceSplit(1, 2)(full)
    assert share["position_ids"].tolist() == [head_tail(SEQ_LEN, 2, 1)] * BATCH


def test_an_unknown_layout_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sequence_split='zigzag': one of 'head_tail', 'contiguous'"):
        TokenShardDataModule(tmp_path, seq_len=SEQ_LEN, batch_size=BATCH, sequence_split="zigzag")


def train(root: Path, data: Path, cp: int, layout: str = "head_tail", seq_len: int = SEQ_LEN, workers: int = 0):
    """``context_parallel.py`` as a job of ``cp`` ranks; each rank's records."""
    out = root / "records"
    cmd = [sys.executable, str(REPO / "tests" / "scripts" / "context_parallel.py"), "--data", str(data)]
    cmd += ["--seq-len", str(seq_len), "--batch-size", str(BATCH), "--vocab", str(20 * SEQ_LEN), "--cp", str(cp)]
    cmd += ["--sequence-split", layout, "--workers", str(workers), "--max-steps", str(STEPS), "--out", str(out)]
    failing = seq_len % (2 * cp) != 0
    run_processes(ranks(cmd, free_port(), cp), root / "logs", (lambda: True) if failing else None)
    if failing:
        return (root / "logs" / "process0.log").read_text()
    return [[json.loads(line) for line in Path(f"{out}.rank{rank}").read_text().splitlines()] for rank in range(cp)]


def test_a_context_parallel_job_trains_each_rank_on_its_share_with_the_loss_of_whole_rows(tmp_path: Path) -> None:
    data = make_token_shards(tmp_path / "data", 16 * SEQ_LEN + 1, shard_tokens=64, doc_len=5)
    (whole,) = train(tmp_path / "whole", data, cp=1)
    # Validated before training (its first batch), at step 2 (both batches) and at step 4 (both).
    assert [(r["stage"], r["step"]) for r in whole if r["stage"] == "validation"] == [("validation", 0)] + [
        ("validation", step) for step in (2, 2, 4, 4)
    ]
    assert len(whole) == 5 + STEPS
    for layout, workers in (("head_tail", 0), ("contiguous", 2)):
        ranks = train(tmp_path / layout, data, cp=2, layout=layout, workers=workers)
        for rank, records in enumerate(ranks):
            assert [(r["stage"], r["step"]) for r in records] == [(r["stage"], r["step"]) for r in whole]
            for step, (share, reference) in enumerate(zip(records, whole, strict=True)):
                index = head_tail(SEQ_LEN, 2, rank) if layout == "head_tail" else list(range(rank * 8, rank * 8 + 8))
                assert share["sequence_index"] == index
                for key in ("input_ids", "labels", "position_ids"):
                    assert share[key] == [[row[i] for i in index] for row in reference[key]], (layout, step, key)
                assert share["document_ids"] == reference["document_ids"]
                # The group's loss over the shares is the loss of the whole rows.
                assert share["loss"] == pytest.approx(reference["loss"], rel=1e-5), (layout, rank, step)


def test_rows_that_do_not_cut_into_equal_chunks_are_refused_at_setup(tmp_path: Path) -> None:
    data = make_token_shards(tmp_path / "data", 8 * 18 + 1)
    log = train(tmp_path / "uneven", data, cp=2, seq_len=18)
    assert "seq_len=18 does not split among 2 context-parallel ranks with sequence_split='head_tail'" in log
    assert "a multiple of 4" in log
