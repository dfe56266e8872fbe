"""HiddenStatesDataModule on real files: the speculators layout, hidden states from a real (tiny)
``transformers`` model, packed rows checked by hand, bad states never trained on, the split,
noise, the EAGLE-3 shift, and exact resume through ``Trainer.fit`` with workers 0 and 2."""

from __future__ import annotations

import logging
import pickle
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file, save_file

from datamodules import HiddenStatesDataModule
from datamodules.plan.bad_samples import BadSample
from datamodules.speculative.hidden_states_datamodule import train_rows
from datamodules.speculative.hidden_states_store import StoredBytes
from datamodules.speculative.preprocess import rename_for_mtp, shift_tokens_left
from tests.speculative.speculative_data import HIDDEN, conversations, speculative_dataset
from tests.support import RecordingModel, batch_digest, quiet_trainer, real_rows, row_digest, sample_digests

ROWS, ROW_LEN = 60, 64


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return speculative_dataset(tmp_path_factory.mktemp("speculative"), ROWS)


@pytest.fixture
def own_data(tmp_path: Path) -> Path:
    """A copy of the data this test may damage."""
    return speculative_dataset(tmp_path, 30)


def datamodule(data_dir: Path, **kw: object) -> HiddenStatesDataModule:
    dm = HiddenStatesDataModule(str(data_dir), total_seq_len=ROW_LEN, **kw)
    dm.setup("fit")
    return dm


def dataset_rows(data_dir: Path) -> list[dict]:
    import datasets

    return datasets.load_from_disk(str(data_dir)).to_list()


def conversation_digests(batches: list[dict]) -> list[str]:
    return [digest for batch in batches for digest in sample_digests(batch, real_rows(batch))]


def test_a_packed_row_holds_each_conversation_with_its_states_positions_and_document(data_dir: Path) -> None:
    dm = datamodule(data_dir, dtype="float32")
    rows = dataset_rows(data_dir)
    source = dm._train
    for step, batch in zip(range(4), dm.train_dataloader(), strict=False):
        (row,) = dm.plan.locate(np.array([step]))[1]
        conversations_in_row = source.packed.row(0, int(row)).tolist()
        filled = 0
        for document, conversation in enumerate(conversations_in_row):
            expected, n = rows[conversation], rows[conversation]["seq_len"]
            states = load_file(str(data_dir / "hidden_states" / f"hs_{conversation}.safetensors"))["hidden_states"]
            at = slice(filled, filled + n)
            assert batch["input_ids"][0, at].tolist() == expected["input_ids"]
            assert batch["loss_mask"][0, at].tolist() == expected["loss_mask"]
            assert batch["position_ids"][0, at].tolist() == list(range(n))
            assert (batch["document_ids"][0, at] == document).all()
            assert torch.equal(batch["hidden_states"][0, at], states[:, :2].flatten(1))  # layers 1, 2 of 3
            assert torch.equal(batch["verifier_last_hidden_states"][0, at], states[:, 2])
            filled += n
        assert filled <= ROW_LEN
        padding = slice(filled, ROW_LEN)
        assert (batch["document_ids"][0, padding] == -1).all() and (batch["loss_mask"][0, padding] == 0).all()
        assert (batch["input_ids"][0, padding] == 0).all() and (batch["hidden_states"][0, padding] == 0).all()
        assert batch["hidden_states"].shape == (1, ROW_LEN, 2 * HIDDEN)
        assert batch["verifier_last_hidden_states"].shape == (1, ROW_LEN, HIDDEN)


def test_hidden_states_are_cast_to_the_configured_dtype_during_the_copy(data_dir: Path) -> None:
    wide = next(iter(datamodule(data_dir, dtype="float32").train_dataloader()))
    narrow = next(iter(datamodule(data_dir).train_dataloader()))
    assert narrow["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(narrow["hidden_states"], wide["hidden_states"].to(torch.bfloat16))
    assert torch.equal(narrow["verifier_last_hidden_states"], wide["verifier_last_hidden_states"].to(torch.bfloat16))


def one_epoch(dm: HiddenStatesDataModule) -> list[dict]:
    return list(dm.train_dataloader())


def test_an_epoch_trains_every_training_conversation_once_and_validation_holds_the_rest(data_dir: Path) -> None:
    dm = datamodule(data_dir)
    rows = dataset_rows(data_dir)
    first_val = train_rows(ROWS, 0.9)
    trained = Counter(conversation_digests(one_epoch(dm)))
    validated = Counter(conversation_digests(list(dm.val_dataloader())))
    digest = [row_digest(torch.tensor(r["input_ids"])) for r in rows]
    assert trained == Counter(digest[:first_val]) and validated == Counter(digest[first_val:])


def test_test_ratio_tests_the_last_held_out_rows_and_validation_the_ones_before(data_dir: Path) -> None:
    dm = datamodule(data_dir, test_ratio=0.05)
    digest = [row_digest(torch.tensor(r["input_ids"])) for r in dataset_rows(data_dir)]
    first_val, first_test = train_rows(ROWS, 0.9), ROWS - int(ROWS * 0.05)
    assert Counter(conversation_digests(one_epoch(dm))) == Counter(digest[:first_val])
    assert Counter(conversation_digests(list(dm.val_dataloader()))) == Counter(digest[first_val:first_test])
    assert Counter(conversation_digests(list(dm.test_dataloader()))) == Counter(digest[first_test:])


def test_a_test_ratio_that_leaves_no_validation_row_is_refused(data_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"test_ratio=0.1 of \d+ rows takes all \d+ held out by train_ratio=0.9"):
        datamodule(data_dir, test_ratio=0.1)


@pytest.mark.parametrize("size", [20, 101, 997])
def test_train_and_validation_rows_are_contiguous_complementary_and_disjoint(size: int) -> None:
    for ratio in (0.1, 0.2, 0.25, 0.33, 0.5, 0.6, 0.75, 0.9, 0.95):
        k = train_rows(size, ratio)
        train, val = set(range(k)), set(range(k, size))
        assert 0 < k < size and not train & val and train | val == set(range(size))
        assert k == int(size * ratio)


@pytest.mark.parametrize("size", [75, 77, 100])
@pytest.mark.parametrize("ratio", [0.9, 0.98])
def test_the_split_is_speculators_split(size: int, ratio: float) -> None:
    """speculators trains on rows [0, int(N * ratio)): at N = 75, ratio 0.9, row 67 validates (67.5 rounds down)."""
    assert train_rows(size, ratio) == {(75, 0.9): 67, (77, 0.9): 69, (100, 0.9): 90, (75, 0.98): 73,
                                       (77, 0.98): 75, (100, 0.98): 98}[(size, ratio)]  # fmt: skip


def test_a_ratio_that_leaves_a_split_empty_is_refused() -> None:
    with pytest.raises(ValueError, match="train_ratio=0.05 of 10 rows leaves 0 for training and 10 for validation"):
        train_rows(10, 0.05)


def damage_states(data_dir: Path, row: int, how: str) -> Path:
    path = data_dir / "hidden_states" / f"hs_{row}.safetensors"
    if how == "missing":
        path.unlink()
    elif how == "other tokens":
        states = load_file(str(path))
        states["token_ids"] = states["token_ids"].flip(0)
        save_file(states, str(path))
    elif how in ("not finite", "infinite"):
        states = load_file(str(path))
        states["hidden_states"][-1, -1, -1] = float("nan") if how == "not finite" else float("-inf")
        save_file(states, str(path))
    elif how == "not safetensors":
        path.write_bytes(b"not a safetensors file")
    return path


@pytest.mark.parametrize("how", ["missing", "other tokens", "not finite", "infinite", "not safetensors"])
def test_bad_states_raise_naming_the_file(own_data: Path, how: str) -> None:
    path = damage_states(own_data, 4, how)
    with pytest.raises(BadSample, match=f"{path}.*on_missing='skip'"):
        one_epoch(datamodule(own_data))


@pytest.mark.parametrize("how", ["missing", "other tokens", "not finite", "infinite", "not safetensors"])
def test_skipped_conversations_are_never_trained_on_and_counted(own_data: Path, how: str) -> None:
    damage_states(own_data, 4, how)
    damage_states(own_data, 9, how)
    dm = datamodule(own_data, on_missing="skip")
    rows = dataset_rows(own_data)
    epoch = one_epoch(dm)
    expected = Counter(row_digest(torch.tensor(r["input_ids"])) for i, r in enumerate(rows[:27]) if i not in (4, 9))
    assert Counter(conversation_digests(epoch)) == expected
    assert len(dm.bad_samples.reasons) == 2
    again = one_epoch(datamodule(own_data, on_missing="skip"))
    assert [batch_digest(b) for b in again] == [batch_digest(b) for b in epoch]


def test_a_file_is_validated_once_per_process_until_it_changes(own_data: Path) -> None:
    fetcher = datamodule(own_data)._train.fetcher
    ids = torch.tensor(dataset_rows(own_data)[4]["input_ids"])
    checks = []
    original = fetcher.check
    fetcher.check = lambda states, input_ids: checks.append(1) or original(states, input_ids)
    assert fetcher.fetch(4, ids).states is not None and fetcher.fetch(4, ids).states is not None
    assert len(checks) == 1  # the second read skips the full pass over the states
    damage_states(own_data, 4, "not finite")  # a new file: another size, time or inode
    assert fetcher.fetch(4, ids).reason == "hidden_states holds NaN or infinite values" and len(checks) == 2


def test_bad_validation_conversations_are_counted_apart_from_training_ones(own_data: Path) -> None:
    damage_states(own_data, 28, "missing")  # rows [27, 30) validate
    dm = datamodule(own_data, on_missing="skip")
    validated = list(dm.val_dataloader())
    assert list(dm.bad_validation_samples.reasons) == [str(own_data / "hidden_states" / "hs_28.safetensors")]
    assert dm.bad_validation_samples.replacements == 1 and not dm.bad_samples.reasons
    assert sum(int(b["loss_mask"].any(dim=1).sum()) for b in validated) >= 1


def test_a_token_mismatch_names_the_first_differing_position_and_both_ids(own_data: Path) -> None:
    path = own_data / "hidden_states" / "hs_4.safetensors"
    states = load_file(str(path))
    original = int(states["token_ids"][3])
    states["token_ids"][3] = original + 1
    save_file(states, str(path))
    length = len(states["token_ids"])
    expected = f"its {length} token_ids are not the row's {length} input_ids: first differing at position 3, "
    with pytest.raises(BadSample, match=re.escape(expected + f"{original + 1} vs {original}")):
        one_epoch(datamodule(own_data))


def test_warn_logs_every_conversation_it_leaves_out(own_data: Path, caplog: pytest.LogCaptureFixture) -> None:
    damage_states(own_data, 4, "missing")
    with caplog.at_level(logging.WARNING, logger="datamodules"):
        warned = one_epoch(datamodule(own_data, on_missing="warn"))
        one_epoch(datamodule(own_data, on_missing="warn"))
    assert sum("hs_4.safetensors" in r.getMessage() and "not trained on" in r.getMessage() for r in caplog.records) >= 2
    skipped = one_epoch(datamodule(own_data, on_missing="skip"))
    assert [batch_digest(b) for b in warned] == [batch_digest(b) for b in skipped]  # warn skips as skip does


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train_ratio": 0.0}, r"train_ratio must be a number in \(0, 1\), got 0.0"),
        ({"train_ratio": 1.0}, r"train_ratio must be a number in \(0, 1\), got 1.0"),
        ({"train_ratio": 1.5}, r"got 1.5"),
        ({"train_ratio": True}, r"got True"),
        ({"dtype": "int8"}, r"dtype must be one of \('float32', 'bfloat16', 'float16'\), got 'int8'"),
        ({"on_missing": "ignore"}, r"on_missing must be one of \('generate', 'skip', 'warn', 'raise'\), got 'ignore'"),
        ({"noise": "laplace"}, r"noise must be one of \('uniform', 'gaussian'\), got 'laplace'"),
        ({"noise_std": -0.1}, r"noise_std must be a number >= 0, got -0.1"),
        ({"store": "redis"}, r"store must be one of \('files',\), got 'redis'"),
        ({"worker_start_method": "thread"}, r"worker_start_method must be one of"),
        ({"total_seq_len": 0}, r"total_seq_len must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_are_refused_at_construction(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HiddenStatesDataModule(str(tmp_path), **{"total_seq_len": ROW_LEN, **kwargs})


def test_setup_refuses_data_it_cannot_read_with_one_message(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder written by datasets' save_to_disk"):
        datamodule(tmp_path)
    no_mask = tmp_path / "no_mask"
    conversations(5).remove_columns("loss_mask").save_to_disk(str(no_mask))
    with pytest.raises(ValueError, match=r"has no column \['loss_mask'\]"):
        datamodule(no_mask)
    wrong = tmp_path / "wrong_len"
    conversations(5).map(lambda r, i: {"seq_len": r["seq_len"] + (i == 2)}, with_indices=True).save_to_disk(str(wrong))
    with pytest.raises(ValueError, match="row 2 has seq_len .* input_ids"):
        datamodule(wrong)
    with pytest.raises(
        ValueError, match="no hidden states found for any of the 60 rows in /nowhere: none for the 16 rows"
    ):
        datamodule(data_dir, hidden_states_dir="/nowhere")
    with pytest.raises(ValueError, match="leaves 0 for training and 60 for validation"):
        datamodule(data_dir, train_ratio=0.001)


def test_noise_is_for_training_only_bounded_as_documented_and_the_same_on_every_run(data_dir: Path) -> None:
    clean = datamodule(data_dir, dtype="float32")
    uniform = datamodule(data_dir, dtype="float32", noise_std=0.05)
    gaussian = datamodule(data_dir, dtype="float32", noise="gaussian", noise_std=0.05)
    base, noisy, normal = (next(iter(dm.train_dataloader())) for dm in (clean, uniform, gaussian))
    real = base["document_ids"][0] >= 0
    difference = (noisy["hidden_states"] - base["hidden_states"])[0, real]
    assert 0 < difference.abs().max() < 0.05
    assert abs(difference.std().item() - 0.05 / 3**0.5) < 0.01  # uniform on (-s, s): std s / sqrt(3)
    assert abs((normal["hidden_states"] - base["hidden_states"])[0, real].std().item() - 0.05) < 0.01
    assert torch.equal(noisy["verifier_last_hidden_states"], base["verifier_last_hidden_states"])
    assert torch.equal(
        next(iter(uniform.val_dataloader()))["hidden_states"], next(iter(clean.val_dataloader()))["hidden_states"]
    )
    again = next(iter(datamodule(data_dir, dtype="float32", noise_std=0.05).train_dataloader()))
    assert torch.equal(again["hidden_states"], noisy["hidden_states"])


def test_the_eagle3_shift_aligns_each_conversation_as_speculators_shift_batch() -> None:
    """Two conversations of 3 and 2 tokens and a padding position; states hold 0, 10, 20, ... so every
    value names the position it came from: (x[t+1], g[t], y[t+1], l[t+1], p[t+1]) inside a conversation,
    the freed last position of each taking no loss, nothing crossing into the next conversation."""
    positions = torch.arange(6)
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9, 0]]),
        "hidden_states": (positions * 10.0).view(1, 6, 1, 1).repeat(1, 1, 2, 3),
        "verifier_last_hidden_states": (positions * 10.0 + 1).view(1, 6, 1).repeat(1, 1, 3),
        "loss_mask": torch.tensor([[1, 0, 1, 1, 1, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]]),
        "document_ids": torch.tensor([[0, 0, 0, 1, 1, -1]]),
    }
    shifted = shift_tokens_left(batch)
    assert shifted["input_ids"].tolist() == [[6, 7, 0, 9, 0, 0]]
    assert shifted["hidden_states"][0, :, 0, 0].tolist() == [0, 10, 0, 30, 0, 50]  # g[t] stays; freed: 0
    assert shifted["verifier_last_hidden_states"][0, :, 0].tolist() == [11, 21, 0, 41, 0, 51]
    assert shifted["loss_mask"].tolist() == [[0, 1, 0, 1, 0, 0]]
    assert shifted["position_ids"].tolist() == [[1, 2, 3, 1, 2, 0]]
    assert shifted["document_ids"].tolist() == [[0, 0, 0, 1, 1, -1]]


def test_the_mtp_preprocess_hands_the_verifier_states_over_unshifted() -> None:
    batch = {"input_ids": torch.tensor([[5, 6]]), "hidden_states": torch.zeros(1, 2, 2, 3)}
    batch["verifier_last_hidden_states"] = torch.ones(1, 2, 3)
    renamed = rename_for_mtp(batch)
    assert torch.equal(renamed["hidden_states"], torch.ones(1, 2, 3)) and "verifier_last_hidden_states" not in renamed
    assert renamed["input_ids"].tolist() == [[5, 6]]


def test_a_preprocess_hook_reaches_every_batch(data_dir: Path) -> None:
    plain = next(iter(datamodule(data_dir).train_dataloader()))
    hooked = next(iter(datamodule(data_dir, preprocess=shift_tokens_left).train_dataloader()))
    assert torch.equal(hooked["input_ids"], shift_tokens_left(dict(plain))["input_ids"])


def test_workers_get_no_length_list_and_repack_the_same_rows(data_dir: Path) -> None:
    source = datamodule(data_dir)._train
    shipped = pickle.loads(pickle.dumps(source))
    assert shipped.packed is None  # the lengths and rows stay in the parent; a worker re-packs from the column
    args = (np.array([3]), np.array([7], dtype=np.uint64), np.array([1]))
    assert torch.equal(shipped.fetch(*args)["input_ids"], source.fetch(*args)["input_ids"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_states_read_again_straight_from_their_files_equal_the_first_read(data_dir: Path, dtype: str) -> None:
    # The files hold float32: read into a float32 batch by the kernel, or loaded and cast into a bf16 one.
    source = datamodule(data_dir, dtype=dtype)._train
    args = (np.array([2]), np.array([5], dtype=np.uint64), np.array([0]))
    first = {k: v.clone() for k, v in source.fetch(*args).items() if isinstance(v, torch.Tensor)}
    conversation = source.first + int(source.packed.row(0, 2)[0])
    ids = torch.tensor(dataset_rows(data_dir)[conversation]["input_ids"])
    assert isinstance(source.fetcher.fetch(conversation, ids).states["hidden_states"], StoredBytes)
    again = source.fetch(*args)
    assert all(torch.equal(again[k], v) for k, v in first.items()) and first["hidden_states"].dtype == getattr(
        torch, dtype
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_still_held_is_never_overwritten_and_the_others_memory_is_reused(data_dir: Path, workers: int) -> None:
    dm = datamodule(data_dir, num_workers=workers)
    kept, copies, dropped = [], [], set()
    for epoch in range(2):
        for step, batch in enumerate(dm.train_dataloader()):
            if epoch == 0 and step in (0, 3, 6):  # a training step that keeps its batch (a logger, a callback)
                kept.append(batch)
                copies.append({k: v.clone() for k, v in batch.items()})
            else:
                dropped.add(batch["hidden_states"].untyped_storage().data_ptr())
    assert all(torch.equal(b[k], c[k]) for b, c in zip(kept, copies, strict=True) for k in c)
    if workers == 0:  # every batch let go of came from the pool (in workers, each is mapped anew here)
        assert dropped <= {storage.data_ptr() for storage in dm._train.buffers._storages}


# Exact resume through Trainer.fit: 60 rows, 54 training conversations in ~20 packed rows a pass,
# so 30 steps cross two pass boundaries (rows packed afresh each pass).
TOTAL_STEPS = 30


def fit(data_dir: Path, max_steps: int, workers: int, ckpt_dir: Path | None = None, every: int = 0, resume=None):
    dm = HiddenStatesDataModule(str(data_dir), total_seq_len=ROW_LEN, num_workers=workers, seed=3, noise_std=0.01)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1)] if every else []
    model = RecordingModel()
    quiet_trainer(max_steps=max_steps, callbacks=callbacks, limit_val_batches=0).fit(
        model, datamodule=dm, ckpt_path=resume
    )
    return model.records


@pytest.fixture(scope="module")
def uninterrupted(data_dir: Path) -> list[dict]:
    return fit(data_dir, TOTAL_STEPS, 0)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [7, 23])
def test_resumed_run_trains_identical_batches(
    tmp_path: Path, data_dir: Path, uninterrupted: list[dict], workers: int, stop: int
) -> None:
    before = fit(data_dir, stop + 2, workers, tmp_path, every=stop)
    (checkpoint,) = tmp_path.glob(f"*-step={stop}.ckpt")
    after = fit(data_dir, TOTAL_STEPS, workers, resume=checkpoint)
    trained = [r["digest"] for r in before if r["step"] < stop] + [r["digest"] for r in after]
    assert trained == [r["digest"] for r in uninterrupted]  # workers 2 (spawned) trains what workers 0 does


def test_workers_fork_unless_the_process_holds_what_a_fork_would_break(data_dir: Path) -> None:
    """Fork where it is safe (a second or less to start), spawn with CUDA or a server client in the process."""
    loader = datamodule(data_dir, num_workers=2).train_dataloader()
    assert loader.multiprocessing_context is None or loader.multiprocessing_context.get_start_method() == "fork"
    assert datamodule(data_dir).spawn_reasons() == []
    spawned = datamodule(data_dir, num_workers=2, worker_start_method="spawn").train_dataloader()
    assert spawned.multiprocessing_context.get_start_method() == "spawn"


def test_spawning_workers_from_an_unguarded_script_is_refused_in_one_line(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    script = tmp_path / "train.py"
    script.write_text("from lightning.pytorch import Trainer\nTrainer().fit(model, datamodule=dm)\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    dm = datamodule(data_dir, num_workers=2, worker_start_method="spawn")
    with pytest.raises(RuntimeError) as refused:
        dm.train_dataloader()
    assert len(str(refused.value).splitlines()) == 1
    assert "each would run" in str(refused.value) and 'under `if __name__ == "__main__":`' in str(refused.value)
    script.write_text(script.read_text().replace("Trainer().fit", 'if __name__ == "__main__":\n    Trainer().fit'))
    assert dm.train_dataloader().multiprocessing_context.get_start_method() == "spawn"
