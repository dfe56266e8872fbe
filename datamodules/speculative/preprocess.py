"""Preprocess hooks for packed hidden-state rows, applied to each batch before it leaves the loader:
the alignments speculators' trainers apply to a conversation (``shift_batch``, ``shift_batch_mtp``)."""

from __future__ import annotations

import torch

# Shifted one position left inside each conversation; ``hidden_states`` stay where they are.
_SHIFTED = ("input_ids", "verifier_last_hidden_states", "loss_mask", "position_ids")


def shift_tokens_left(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EAGLE-3 alignment, conversation by conversation, as speculators' ``shift_batch``.

    For a conversation of ``n`` tokens ``x``, auxiliary states ``g``, verifier last states ``y``,
    loss mask ``l`` and positions ``p``, position ``t < n - 1`` holds ``(x[t+1], g[t], y[t+1],
    l[t+1], p[t+1])``: the draft reads the verifier's state at ``t`` with the token that followed it
    and is trained towards ``lm_head(y[t+1])``, the verifier's prediction of the token after that.
    speculators drops the conversation's last position; a packed row keeps its fixed shape instead,
    and that freed position takes no loss: its token, verifier state and loss mask are 0, its
    ``hidden_states`` 0, and its position ``p[n-1] + 1``. Nothing crosses a conversation boundary.
    """
    documents = batch["document_ids"]
    same = torch.zeros_like(documents, dtype=torch.bool)
    same[:, :-1] = (documents[:, 1:] == documents[:, :-1]) & (documents[:, :-1] >= 0)
    # The last position of each conversation: the one whose next position is another conversation.
    last = (documents >= 0) & ~same
    for key in _SHIFTED:
        value = batch[key]
        shifted = value.clone()  # padding (document -1) stays as it is
        inner = same.view(*same.shape, *([1] * (value.dim() - 2))).expand_as(value)
        shifted[:, :-1][inner[:, :-1]] = value[:, 1:][inner[:, :-1]]
        shifted[last] = value[last] + 1 if key == "position_ids" else 0
        batch[key] = shifted
    batch["hidden_states"][last] = 0
    return batch


def rename_for_mtp(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP alignment, as speculators' ``shift_batch_mtp``: no shift (the MTP forward offsets the
    tokens itself); ``hidden_states`` become the verifier's last states, the auxiliary layers go."""
    batch["hidden_states"] = batch.pop("verifier_last_hidden_states")
    return batch
