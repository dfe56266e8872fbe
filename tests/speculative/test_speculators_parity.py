"""Our EAGLE-3 and MTP preprocessing against speculators' own (0.9.0), conversation by conversation.

speculators pins ``datasets`` and ``transformers`` below ours, so it is not installed here: its two
functions are read from its wheel on the package index, with the one name they import from the rest
of the package (``BatchType``, a type alias) given to them.
"""

from __future__ import annotations

import subprocess
import sys
import types
import zipfile

import pytest
import torch

from datamodules.speculative.preprocess import rename_for_mtp, shift_tokens_left

VERSION = "0.9.0"
KEYS = ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids")


@pytest.fixture(scope="module")
def speculators(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    folder = tmp_path_factory.mktemp("speculators")
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"speculators=={VERSION}", "-d", str(folder)]
    subprocess.run(pip, check=True, capture_output=True, timeout=120)
    (wheel,) = folder.glob("speculators-*.whl")
    stub = types.ModuleType("speculators.train.data")
    stub.BatchType = dict
    functions = {}
    with zipfile.ZipFile(wheel) as archive, pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "speculators", types.ModuleType("speculators"))
        patch.setitem(sys.modules, "speculators.train", types.ModuleType("speculators.train"))
        patch.setitem(sys.modules, "speculators.train.data", stub)
        for family, name in (("eagle3", "shift_batch"), ("mtp", "shift_batch_mtp")):
            namespace: dict = {"__name__": f"speculators.models.{family}.data"}
            exec(archive.read(f"speculators/models/{family}/data.py"), namespace)  # noqa: S102 (their code, read here)
            functions[name] = namespace[name]
    return types.SimpleNamespace(**functions)


def conversation(length: int, first_token: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One conversation as speculators' dataset yields it: [T] ids, [T, 3, H] auxiliary states, ..."""
    return {
        "input_ids": torch.arange(first_token, first_token + length),
        "hidden_states": torch.randn(length, 3, 8, generator=generator),
        "verifier_last_hidden_states": torch.randn(length, 8, generator=generator),
        "loss_mask": torch.randint(0, 2, (length,), generator=generator),
        "position_ids": torch.arange(length),
        "lengths": torch.tensor([length]),
    }


def packed_row(conversations: list[dict[str, torch.Tensor]], total: int) -> dict[str, torch.Tensor]:
    """The conversations one after another in a row of ``total`` positions, as our loader packs them."""
    first = conversations[0]
    row = {key: torch.zeros(1, total, *first[key].shape[1:], dtype=first[key].dtype) for key in KEYS}
    row["document_ids"] = torch.full((1, total), -1)
    start = 0
    for index, conv in enumerate(conversations):
        end = start + len(conv["input_ids"])
        for key in KEYS:
            row[key][0, start:end] = conv[key]
        row["document_ids"][0, start:end] = index
        start = end
    return row


@pytest.mark.parametrize("lengths", [[9], [5, 3, 7], [2, 1, 4, 6]])
def test_the_eagle3_shift_of_a_packed_row_equals_shift_batch_per_conversation(
    speculators: types.SimpleNamespace, lengths: list[int]
) -> None:
    generator = torch.Generator().manual_seed(len(lengths))
    conversations = [conversation(n, 100 * i, generator) for i, n in enumerate(lengths)]
    shifted = shift_tokens_left(packed_row(conversations, sum(lengths) + 3))
    start = 0
    for conv in conversations:
        expected, end = speculators.shift_batch(dict(conv)), start + len(conv["input_ids"])
        for key in KEYS:
            assert torch.equal(shifted[key][0, start : end - 1], expected[key]), key
        assert shifted["loss_mask"][0, end - 1] == 0  # the freed position takes no loss
        start = end
    assert not shifted["loss_mask"][0, start:].any() and not shifted["input_ids"][0, start:].any()


def test_the_mtp_preprocess_equals_shift_batch_mtp(speculators: types.SimpleNamespace) -> None:
    generator = torch.Generator().manual_seed(0)
    conversations = [conversation(n, 100 * i, generator) for i, n in enumerate([4, 6])]
    ours = rename_for_mtp(packed_row(conversations, 12))
    start = 0
    for conv in conversations:
        expected, end = speculators.shift_batch_mtp(dict(conv)), start + len(conv["input_ids"])
        for key in ("input_ids", "hidden_states", "loss_mask", "position_ids"):
            assert torch.equal(ours[key][0, start:end], expected[key]), key
        start = end
