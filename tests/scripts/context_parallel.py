"""Train a tiny causal language model with context parallelism on CPU, and record each rank's batches and the loss.

Run as a standalone script (Lightning's ``ddp`` strategy re-launches ``sys.argv`` for the other local
ranks). With ``--cp C`` the job is ``C`` ranks shaped as one data-parallel rank x ``C`` context-parallel
ranks (``MeshDDPStrategy`` with a ``context_parallel`` mesh dimension) and the DataModule splits every
row among them (``split_sequence_for="context_parallel"``); with ``--cp 1``, one process trains the
whole rows: the reference.

The model attends as context parallelism does: each rank embeds its own tokens (at their
``position_ids``), gathers every rank's keys and values with their ``sequence_index``, and masks by
row position (causal) and ``document_ids`` (kept whole on every rank). Each rank's loss sum and
label count are summed over the group, so every rank records the loss of the whole batch. The
learning rate is 0: every step sees the initial weights, so steps compare one for one.

A quarter of the windows is held out and validated every 2 steps (in the middle of the epoch) and
once, on its first batch only, before training (Lightning's sanity check).

Each rank writes ``{out}.rank{global_rank}``: per batch trained or validated, the stage, the step, the
loss and the batch's ``input_ids``, ``labels``, ``position_ids``, ``document_ids`` and
``sequence_index``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402

from datamodules import TokenShardDataModule  # noqa: E402
from tests.scripts.train_record import MeshDDPStrategy  # noqa: E402

RECORDED = ("input_ids", "labels", "position_ids", "document_ids", "sequence_index")


class GatheredAttentionLM(LightningModule):
    """One attention layer whose keys and values are gathered over the context-parallel group."""

    def __init__(self, vocab: int, max_positions: int, out: str, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(max_positions, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.out = out

    def _group(self):
        mesh = getattr(self.trainer.strategy, "device_mesh", None)
        return None if mesh is None else mesh["context_parallel"].get_group()

    def _gather(self, tensor: torch.Tensor, group) -> torch.Tensor:
        """Every rank's ``tensor`` side by side along dim 1 (this rank's own part keeps its gradient)."""
        if group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        parts[dist.get_rank(group)] = tensor
        return torch.cat(parts, dim=1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._loss(batch, "validation")

    def _loss(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        group = self._group()
        ids, labels = batch["input_ids"], batch["labels"]
        index = batch.get("sequence_index", torch.arange(ids.shape[1]))
        x = self.embed(ids) + self.position(batch["position_ids"])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        keys, values = self._gather(k, group), self._gather(v, group)
        key_index = self._gather(index[None], group)[0]
        allowed = index[:, None] >= key_index[None, :]  # causal by place in the row
        documents = batch["document_ids"]  # whole: [B, S] on every rank
        allowed = allowed & (documents[:, index, None] == documents[:, None, key_index])
        scores = (q @ keys.transpose(1, 2)) / math.sqrt(q.shape[-1])
        attended = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ values
        logits = self.head(attended)
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        totals = torch.stack([loss_sum.detach(), (labels != -100).sum().to(loss_sum.dtype)])
        if group is not None:
            dist.all_reduce(totals, group=group)
        record = {"stage": stage, "step": self.global_step, "loss": (totals[0] / totals[1]).item()}
        record.update({key: batch[key].tolist() for key in RECORDED if key in batch})
        with open(f"{self.out}.rank{self.global_rank}", "a") as f:
            f.write(json.dumps(record) + "\n")
        return loss_sum / totals[1]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--sequence-split", default="head_tail")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    seed_everything(0)
    model = GatheredAttentionLM(args.vocab, args.seq_len, args.out)
    split = {"split_sequence_for": "context_parallel", "sequence_split": args.sequence_split} if args.cp > 1 else {}
    datamodule = TokenShardDataModule(
        args.data, seq_len=args.seq_len, batch_size=args.batch_size, pack_sequences=True,
        num_workers=args.workers, val_fraction=0.25, **split,
    )  # fmt: skip
    strategy = MeshDDPStrategy(1, args.cp, model_parallel_name="context_parallel") if args.cp > 1 else "auto"
    trainer = Trainer(
        accelerator="cpu",
        devices=args.cp,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=2,  # in the middle of the epoch, between training batches sent ahead
        num_sanity_val_steps=1,  # of 2: a validation iteration left before its end
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=datamodule)


if __name__ == "__main__":
    main()
