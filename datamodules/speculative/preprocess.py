"""Preprocess hooks for packed hidden-state rows, applied to each batch before it leaves the loader."""

from __future__ import annotations

import torch


def shift_tokens_left(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EAGLE-3 one-token shift: position ``t`` gets the next token of its conversation
    (``input_ids[t] = input_ids[t + 1]``, and its ``loss_mask``), so the draft reads the verifier's
    state at ``t`` with the token that followed it. A conversation's last position has no next
    token: it takes no loss (its ``input_ids`` become 0). Hidden states stay where they are."""
    same_document = batch["document_ids"][:, 1:] == batch["document_ids"][:, :-1]
    for key in ("input_ids", "loss_mask"):
        shifted = torch.zeros_like(batch[key])
        shifted[:, :-1] = torch.where(same_document, batch[key][:, 1:], 0)
        batch[key] = shifted
    return batch
