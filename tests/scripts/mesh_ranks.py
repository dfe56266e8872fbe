"""Read the first training batches of one rank under a real ModelParallel or FSDP strategy, on CPU.

Both strategies need GPUs to train, but their rank resolution needs only a process group. This
script is one process of a torchelastic-style launch (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``, ``MASTER_PORT`` set
by the caller). It builds a real ``Trainer`` with the strategy, runs the strategy's own
``setup_environment()`` (gloo process group and, for ModelParallel, the
``("data_parallel", "tensor_parallel")`` device mesh), attaches the DataModule as ``Trainer.fit``
does, passes the train loader through Lightning's own dataloader processing and records the
window starts of the first ``--batches`` batches to ``{out}.rank{global_rank}``.

Only one thing is not what ``Trainer.fit`` would do: Lightning refuses ``FSDPStrategy`` on a CPU
accelerator by an exact type check, so FSDP is given as a subclass that changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage, TrainerFn  # noqa: E402

from datamodules import TokenShardDataModule  # noqa: E402
from tests.support import RecordingModel, batch_digest  # noqa: E402


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` unchanged; a subclass only passes the accelerator connector's GPU check."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=("model_parallel", "fsdp"), required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--broadcast-within", help="the DataModule's broadcast_within")
    args = parser.parse_args(argv)

    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    num_nodes = int(os.environ["WORLD_SIZE"]) // devices
    if args.strategy == "model_parallel":
        strategy = ModelParallelStrategy(data_parallel_size=num_nodes, tensor_parallel_size=devices)
    else:
        strategy = CPUFSDPStrategy()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # What Trainer.fit does before it asks for data: connect the model, set up the environment
    # (process group, device mesh), attach the DataModule, call its setup, process its loader.
    trainer.strategy.connect(RecordingModel())
    trainer.strategy.setup_environment()
    datamodule = TokenShardDataModule(
        args.data, seq_len=args.seq_len, batch_size=args.batch_size, broadcast_within=args.broadcast_within
    )
    datamodule.trainer = trainer
    datamodule.setup("fit")
    loader = _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, datamodule.train_dataloader())

    batches = []
    for batch in loader:
        batches.append(datamodule.on_after_batch_transfer(batch, 0))  # as fit does: the ranks' stop vote
        if len(batches) == args.batches:
            break
    record = {
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "dp_rank": datamodule.dp_rank,
        "dp_size": datamodule.dp_size,
        "mesh_coordinate": (
            trainer.strategy.device_mesh.get_coordinate() if args.strategy == "model_parallel" else None
        ),
        "sampler_is_datamodule_sampler": loader.sampler is datamodule._sampler,
        "reads": datamodule._broadcast is None or datamodule._broadcast.leads,  # iterates its own loader
        "starts": [b["input_ids"][:, 0].tolist() for b in batches],
        "digests": [batch_digest(b) for b in batches],
    }
    Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(record))
    # As fit ends: the loaders are closed (a group's transfer threads hear their end) before the
    # process group goes; destroying it under a transfer still in flight would abort the process.
    datamodule.teardown("fit")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
