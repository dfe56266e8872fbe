"""Offline generation of verifier hidden states: a local ``transformers`` causal LM run over a
tokenized dataset, writing ``hs_{i}.safetensors`` files as ``HiddenStatesDataModule`` reads them.

``python -m datamodules.speculative.generate --data-dir D --model M [--layers 2,8,13,16]``. Resumable:
valid files already there are kept; every file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from datamodules.plan.arguments import program_name
from datamodules.plan.bad_samples import BadSample
from datamodules.plan.hf_loading import load_split, one_line
from datamodules.speculative.hidden_states_store import HiddenStateFiles, check_states

log = logging.getLogger(__name__)


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice: a low, a middle and a high layer, then the last (``hidden_states`` indices:
    0 is the embeddings, ``i`` the output of decoder layer ``i``)."""
    return sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3), num_layers})


@dataclass
class GenerationReport:
    written: int
    kept: int
    layers: list[int]


def generate_hidden_states(
    data_dir: str,
    model: str | torch.nn.Module,
    layers: list[int] | None = None,
    hidden_states_dir: str | None = None,
    batch_size: int = 8,
    dtype: str = "float32",
    device: str = "cpu",
) -> GenerationReport:
    """Write the hidden states of every row of ``data_dir`` that has no valid file yet.

    Rows are run in batches of similar length (right-padded, with an attention mask); the chosen
    ``layers`` of ``hidden_states`` are stacked into ``[T, L, H]``, the last of them being the one the
    draft model learns to predict.
    """
    from transformers import AutoModelForCausalLM

    dataset = load_split(data_dir, None).with_format("numpy", columns=["input_ids"])
    store = HiddenStateFiles(hidden_states_dir or Path(data_dir) / "hidden_states")
    for stale in Path(store.directory).glob(".hs_*.partial-*"):
        stale.unlink()  # left by a run that was killed mid-write
    if isinstance(model, str):
        try:
            model = AutoModelForCausalLM.from_pretrained(model, torch_dtype=getattr(torch, dtype))
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot load the model {model!r}: {one_line(err)}") from None
    model = model.to(device).eval()
    num_layers = model.config.num_hidden_layers
    layers = layers or default_layers(num_layers)
    if any(not 0 <= layer <= num_layers for layer in layers):
        raise ValueError(f"layers must be in [0, {num_layers}] (0: embeddings), got {layers}")
    todo, kept = [], 0
    for row in range(len(dataset)):
        tokens = torch.from_numpy(dataset[row]["input_ids"]).long()
        try:
            states = store.lookup(row)
        except BadSample:
            states = None
        if states is not None and check_states(states, tokens, len(layers), model.config.hidden_size) is None:
            kept += 1
        else:
            todo.append((len(tokens), row))
    todo.sort()
    with tqdm(total=len(todo), desc="hidden states", unit="row", disable=not todo) as progress:
        for start in range(0, len(todo), batch_size):
            rows = [row for _, row in todo[start : start + batch_size]]
            _write_batch(model, dataset, store, rows, layers, device)
            progress.update(len(rows))
    log.info("hidden states: %d written, %d valid files kept, layers %s", len(todo), kept, layers)
    return GenerationReport(written=len(todo), kept=kept, layers=layers)


def _write_batch(
    model: torch.nn.Module, dataset, store: HiddenStateFiles, rows: list[int], layers: list[int], device: str
) -> None:
    sequences = [torch.from_numpy(dataset[row]["input_ids"]).long() for row in rows]
    for row, states in zip(rows, verifier_states(model, sequences, layers, device), strict=True):
        store.cache(row, states)


@torch.no_grad()
def verifier_states(
    model: torch.nn.Module, sequences: list[torch.Tensor], layers: list[int], device: str = "cpu"
) -> list[dict[str, torch.Tensor]]:
    """The states of each token sequence: ``hidden_states`` ``[T, L, H]`` (the chosen ``layers`` of
    the model's ``hidden_states``) and ``token_ids`` ``[T]``; one forward pass, right-padded."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        input_ids[i, : len(sequence)] = sequence
        attention_mask[i, : len(sequence)] = 1
    out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), output_hidden_states=True)
    stacked = torch.stack([out.hidden_states[layer] for layer in layers], dim=2).cpu()  # [B, T, L, H]
    return [
        {"hidden_states": stacked[i, : len(sequence)].clone(), "token_ids": sequence}
        for i, sequence in enumerate(sequences)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program_name("datamodules.speculative.generate"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data-dir", required=True, help="the save_to_disk folder (input_ids, loss_mask, seq_len)")
    parser.add_argument("--model", required=True, help="a transformers causal LM: hub name or local path")
    parser.add_argument(
        "--layers",
        help="comma-separated hidden_states indices, the last one predicted; "
        "default: a low, a middle, a high and the last layer",
    )
    parser.add_argument("--hidden-states-dir", help="default: DATA_DIR/hidden_states")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    try:
        report = generate_hidden_states(
            args.data_dir, args.model, layers, args.hidden_states_dir, args.batch_size, args.dtype, args.device
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{report.written} written, {report.kept} kept, layers {report.layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
