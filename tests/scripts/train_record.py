"""Train ``RecordingModel`` on a ``TokenShardDataModule`` or a mixture and record every batch, per rank.

Run as a standalone script because Lightning's ``ddp`` strategy re-launches ``sys.argv`` for the
other local ranks. Every Trainer flag that matters for data loading is left at its default
(``use_distributed_sampler=True`` in particular).

Each rank appends its batch records to ``{record}.rank{global_rank}`` (see ``tests/support.py``)
and, with ``--info``, writes ``{info}.rank{global_rank}``: where it sat in the data-parallel group,
which loader and sampler the training loop actually iterated, the positions consumed and the
learning rate of every optimizer step.

``--mixture a=dir_a:0.5,b=dir_b:0.5`` trains a ``MixtureDataModule`` of token-shard sources instead
of ``--data`` (``--mixture-stream web:0.3:a.parquet,b.parquet`` adds a streamed parquet source, with
``--tokenizer``); ``--phases`` (a JSON list of ``{start_step, dataset_weights, lr_scale}``) adds a
``PhaseScheduler``.

Example::

    python tests/scripts/train_record.py --data shards/ --seq-len 8 --batch-size 4 \
        --devices 2 --strategy ddp --max-epochs 1 --record out/records --info out/info
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS.parent))

import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from datamodules import (  # noqa: E402
    ConversationDataModule,
    HFTextDataModule,
    HFTextSource,
    HiddenStatesDataModule,
    ImageTextDataModule,
    MixtureComponent,
    MixtureDataModule,
    PhaseScheduler,  # noqa: E402
    TokenShardDataModule,
    TokenShardSource,
    VideoDataModule,
)
from datamodules.plan.datamodule import PlanDataModule  # noqa: E402
from tests.support import RecordingModel, all_tokens  # noqa: E402


def validation_tokens(datamodule: PlanDataModule) -> list[list[int]]:
    """Every validation source's token stream, as this rank holds it."""
    return [all_tokens(val.shards).tolist() for _, val in datamodule._vals if hasattr(val, "shards")]


class TokenizationCounter(logging.Handler):
    """Counts the corpora this process tokenized (the prepare command's "wrote ..." records)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.evaluation_sets = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("wrote ")
        self.evaluation_sets += record.getMessage().startswith("tokenized the evaluation set")


class LoaderProbe(Callback):
    """Notes the DataLoader and sampler the fit loop iterates, at the first training batch."""

    def __init__(self, datamodule: PlanDataModule) -> None:
        self.datamodule = datamodule
        self.seen: dict | None = None
        self.lr_by_step: dict[int, float] = {}

    def on_train_batch_start(self, trainer: Trainer, pl_module, batch, batch_idx: int) -> None:
        self.lr_by_step[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]
        if self.seen is not None:
            return
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        self.seen = {
            "loader_type": type(loader).__name__,
            "sampler_type": type(sampler).__name__,
            "sampler_is_datamodule_sampler": sampler is self.datamodule._sampler,
            "batch_sampler": None if loader.batch_sampler is None else type(loader.batch_sampler).__name__,
            "num_training_batches": trainer.num_training_batches,
            "worker_processes": len(multiprocessing.active_children()),
        }


class MeshDDPStrategy(DDPStrategy):
    """DDP over every rank, with a ``(data_parallel, tensor_parallel)`` device mesh whose data-parallel
    view the sampler sees, as ``ModelParallelStrategy`` gives it (that strategy trains on GPUs only):
    the shape of a tensor-parallel job, trained on CPU."""

    def __init__(
        self, data_parallel_size: int, tensor_parallel_size: int, global_sampler: bool = False,
        model_parallel_name: str = "tensor_parallel",
    ) -> None:  # fmt: skip
        super().__init__()
        self.sizes = (data_parallel_size, tensor_parallel_size)
        self.names = ("data_parallel", model_parallel_name)  # "context_parallel": the shape of a CP job
        self.device_mesh = None
        self.global_sampler = global_sampler  # DDP's view (a rank each) in place of the mesh's: a wrong strategy

    def setup_environment(self) -> None:
        super().setup_environment()
        self.device_mesh = init_device_mesh("cpu", self.sizes, mesh_dim_names=self.names)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        if self.global_sampler:
            return super().distributed_sampler_kwargs
        data_parallel = self.device_mesh["data_parallel"]
        return {"num_replicas": data_parallel.size(), "rank": data_parallel.get_local_rank()}


class WorkerKiller(Callback):
    """Kills one of this rank's DataLoader workers with SIGKILL (as the kernel's OOM killer does) at ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            workers = multiprocessing.active_children()
            assert workers, "no DataLoader worker to kill"
            os.kill(workers[-1].pid, signal.SIGKILL)


class ShardReplacer(Callback):
    """Overwrites ``target`` in place with ``source``'s bytes, cut or padded to ``target``'s size, on
    global rank 0 after ``step``: a shard replaced under the running job."""

    def __init__(self, step: int, target: str, source: str) -> None:
        self.step, self.target, self.source = step, Path(target), Path(source)

    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            size = self.target.stat().st_size
            with self.target.open("r+b") as f:
                f.write(self.source.read_bytes()[:size].ljust(size, b"\0"))


class ErrorRecorder(Callback):
    """Writes the exception that ended ``fit`` on this rank to ``{path}.rank{r}``, as soon as it is raised."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_exception(self, trainer: Trainer, pl_module, exception: BaseException) -> None:
        Path(f"{self.path}.rank{trainer.global_rank}").write_text(f"{type(exception).__name__}: {exception}")


def mixture_components(spec: str) -> list[MixtureComponent]:
    """``name=dir:weight,...`` as mixture components of token-shard sources."""
    components = []
    for item in spec.split(","):
        name, rest = item.split("=", 1)
        directory, weight = rest.rsplit(":", 1)
        components.append(MixtureComponent(name, float(weight), TokenShardSource(directory)))
    return components


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="token shard directory or URL (TokenShardDataModule)")
    parser.add_argument("--storage-options", type=json.loads, help="JSON: storage_options of a --data URL")
    data.add_argument("--mixture", help="name=dir:weight,... (MixtureDataModule of token-shard sources)")
    data.add_argument("--hf-json", help="a JSON-lines file (HFTextDataModule over load_dataset('json'))")
    data.add_argument("--hf-files", help="BUILDER:file,file,... (HFTextDataModule over load_dataset(BUILDER))")
    data.add_argument("--image-folder", help="an imagefolder with metadata.jsonl (ImageTextDataModule)")
    data.add_argument("--image-urls", help="a saved dataset whose rows name images by URL (ImageTextDataModule)")
    parser.add_argument("--file-cache-bytes", type=int, help="with --image-urls: a file cache in --cache-dir")
    data.add_argument("--interleaved", help="a saved dataset of OBELICS rows, packed (ImageTextDataModule)")
    data.add_argument("--webdataset", help="tar shards, a brace pattern (ImageTextDataModule, path='webdataset')")
    data.add_argument("--video-folder", help="clips with captions.jsonl (VideoDataModule, folder layout)")
    data.add_argument("--conversations", help="a ShareGPT JSON-lines file (ConversationDataModule; --tokenizer)")
    data.add_argument("--hidden-states", help="a save_to_disk folder with hidden_states/ (HiddenStatesDataModule)")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="with --image/video-folder: held out")
    parser.add_argument("--train-ratio", type=float, default=0.9, help="with --hidden-states")
    parser.add_argument("--server", help="with --hidden-states: a generation server url (on_missing='generate')")
    parser.add_argument("--server-model", default="tiny-llama", help="with --server: the served model id")
    parser.add_argument("--max-failures", type=int, default=8, help="with --server: the circuit breaker")
    parser.add_argument("--streaming", action="store_true", help="HFTextDataModule(streaming=True)")
    parser.add_argument("--mixture-stream", help="with --mixture: name:weight:file,... a streamed parquet source")
    parser.add_argument("--tokenizer", help="tokenizer path, with --hf-json")
    parser.add_argument("--hf-val-json", help="with --hf-json: a JSON-lines file as the 'validation' split")
    parser.add_argument("--cache-dir", help="HF text or tar index cache_dir; {node} is replaced by NODE_RANK")
    parser.add_argument("--prepare-once", action="store_true", help="prepare_data_per_node=False")
    parser.add_argument("--phases", help="JSON list of PhaseScheduler phases")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--mesh", help="DPxTP: a MeshDDPStrategy of that shape (--devices must be DP * TP)")
    parser.add_argument("--mesh-sampler", default="mesh", help="'global': DDP's sampler view, not the mesh's")
    parser.add_argument("--broadcast-within", help="the DataModule's broadcast_within (a mesh dimension)")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--root", required=True, help="default_root_dir of the Trainer")
    parser.add_argument("--record", required=True, help="per-rank batch records: {record}.rank{r}")
    parser.add_argument("--info", help="per-rank run facts as JSON: {info}.rank{r}")
    parser.add_argument("--every-n-steps", type=int, help="save a checkpoint every n training steps")
    parser.add_argument("--resume", help="checkpoint to resume from")
    parser.add_argument("--replace-shard", help="STEP:TARGET:SOURCE: TARGET overwritten by SOURCE after STEP")
    parser.add_argument("--on-bad-sample", default="raise", help="with --webdataset")
    parser.add_argument("--kill-worker", help="RANK:STEP: SIGKILL one DataLoader worker of global rank RANK there")
    args = parser.parse_args(argv)
    Path(args.record).parent.mkdir(parents=True, exist_ok=True)

    loading = {"seq_len": args.seq_len, "batch_size": args.batch_size, "seed": args.seed, "num_workers": args.workers}
    if args.broadcast_within:
        loading["broadcast_within"] = args.broadcast_within
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("datamodules.storage.tar_index").setLevel(logging.INFO)  # which rank indexed what
    tokenized = TokenizationCounter()
    logging.getLogger("datamodules.text.prepare").addHandler(tokenized)
    logging.getLogger("datamodules.text.prepare").setLevel(logging.INFO)
    if args.mixture:
        components = mixture_components(args.mixture)
        if args.mixture_stream:
            name, weight, files = args.mixture_stream.split(":", 2)
            source = HFTextSource("parquet", args.tokenizer, data_files=files.split(","), streaming=True)
            components.append(MixtureComponent(name, float(weight), source))
        datamodule: PlanDataModule = MixtureDataModule(components, **loading)
    elif args.hf_files:
        builder, files = args.hf_files.split(":", 1)
        datamodule = HFTextDataModule(
            builder, args.tokenizer, data_files=files.split(","), streaming=args.streaming, **loading
        )
    elif args.image_folder:
        datamodule = ImageTextDataModule(
            "imagefolder",
            tokenizer=args.tokenizer,
            max_text_len=loading.pop("seq_len"),
            num_image_tokens=2,
            image_size=8,
            load_kwargs={"data_dir": args.image_folder},
            val_fraction=args.val_fraction,
            **loading,
        )
    elif args.image_urls:
        datamodule = ImageTextDataModule(
            args.image_urls,
            tokenizer=args.tokenizer,
            max_text_len=loading.pop("seq_len"),
            num_image_tokens=2,
            image_size=8,
            storage_options=args.storage_options,
            file_cache_dir=args.cache_dir,
            file_cache_bytes=args.file_cache_bytes,
            **loading,
        )
    elif args.interleaved:
        from examples.default_images import SPECIAL_TOKENS

        datamodule = ImageTextDataModule(
            args.interleaved,
            tokenizer=args.tokenizer,
            max_text_len=loading.pop("seq_len"),
            layout="obelics",
            text_field="texts",
            image_field="images",
            image_token=SPECIAL_TOKENS["image_token"],
            num_image_tokens=3,
            image_size=8,
            pack_sequences=True,
            max_images_per_row=10,
            **loading,
        )
    elif args.webdataset:
        datamodule = ImageTextDataModule(
            "webdataset",
            tokenizer=args.tokenizer,
            max_text_len=loading.pop("seq_len"),
            num_image_tokens=2,
            image_size=8,
            data_files=args.webdataset,
            image_field="jpg;png",
            text_field="txt",
            load_kwargs={"cache_dir": args.cache_dir.replace("{node}", os.environ.get("NODE_RANK", "0"))},
            on_bad_sample=args.on_bad_sample,
            val_fraction=args.val_fraction,
            **loading,
        )
    elif args.video_folder:
        datamodule = VideoDataModule(
            args.video_folder,
            args.tokenizer,
            max_text_len=loading.pop("seq_len"),
            image_size=8,
            max_frames=4,
            frame_options={"fps": 2.0},
            val_fraction=args.val_fraction,
            **loading,
        )
    elif args.hidden_states:
        del loading["batch_size"]  # one packed row per rank per step
        if args.server:
            server = {"urls": [args.server], "model": args.server_model, "max_failures": args.max_failures}
            server.update(retries=1, backoff=0.01)  # fail fast: the breaker is under test
            loading.update(on_missing="generate", server=server, on_generate="delete")
        datamodule = HiddenStatesDataModule(
            args.hidden_states, total_seq_len=loading.pop("seq_len"), train_ratio=args.train_ratio, **loading
        )
    elif args.conversations:
        datamodule = ConversationDataModule(
            args.conversations,
            total_seq_len=loading.pop("seq_len"),
            tokenizer=args.tokenizer,
            cache_dir=args.cache_dir.replace("{node}", os.environ.get("NODE_RANK", "0")),
            **loading,
        )
    elif args.hf_json:
        cache_dir = args.cache_dir.replace("{node}", os.environ.get("NODE_RANK", "0"))
        files = {"train": args.hf_json, "validation": args.hf_val_json} if args.hf_val_json else args.hf_json
        datamodule = HFTextDataModule(
            "json",
            args.tokenizer,
            data_files=files,
            val_split="validation" if args.hf_val_json else None,
            cache_dir=cache_dir,
            num_proc=1,
            prepare_data_per_node=not args.prepare_once,
            **loading,
        )
    else:
        datamodule = TokenShardDataModule(args.data, storage_options=args.storage_options, **loading)
    probe = LoaderProbe(datamodule)
    callbacks: list[Callback] = [probe]
    if args.info:
        callbacks.append(ErrorRecorder(f"{args.info}.error"))
    if args.replace_shard:
        step, target, source = args.replace_shard.split(":", 2)
        callbacks.append(ShardReplacer(int(step), target, source))
    if args.kill_worker:
        callbacks.append(WorkerKiller(*map(int, args.kill_worker.split(":"))))
    if args.phases:
        callbacks.append(PhaseScheduler(json.loads(args.phases)))
    if args.every_n_steps:
        callbacks.append(
            ModelCheckpoint(
                dirpath=Path(args.root) / "checkpoints",
                filename="{step}",
                every_n_train_steps=args.every_n_steps,
                save_top_k=-1,
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=MeshDDPStrategy(*map(int, args.mesh.split("x")), args.mesh_sampler == "global")
        if args.mesh
        else args.strategy,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        accumulate_grad_batches=args.accumulate,
        default_root_dir=args.root,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RecordingModel(args.record), datamodule=datamodule, ckpt_path=args.resume)

    if args.info:
        info = {
            **(probe.seen or {}),
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            # Under ddp_spawn the ranks trained in processes of their own: this one never set the data up.
            "dp_rank": getattr(datamodule, "dp_rank", None),
            "dp_size": getattr(datamodule, "dp_size", None),
            "global_step": trainer.global_step,
            "positions_consumed": datamodule.positions_consumed,
            "lr_by_step": probe.lr_by_step,
            "tokenized": tokenized.count,
            "evaluation_sets_tokenized": tokenized.evaluation_sets,
            "validation_tokens": validation_tokens(datamodule),
        }
        Path(f"{args.info}.rank{trainer.global_rank}").write_text(json.dumps(info))
    if dist.is_initialized():
        # Lightning leaves the process group up; a gloo group still up at interpreter exit can abort the
        # process ("terminate called without an active exception", pytorch/pytorch#190489).
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
