"""A tiny reference draft model for speculative decoding, trained on ``HiddenStatesDataModule`` rows."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule

from examples.tiny_lm import log_held_out


class TinyDraft(LightningModule):
    """Predicts the verifier's last-layer state at each position from its earlier layers' states and
    the token there (the regression half of an EAGLE draft head), loss on ``loss_mask`` positions.

    Args:
        vocab_size: must cover the tokenizer's ids.
        verifier_hidden_size: ``H`` of the verifier's states.
        aux_layers: how many earlier layers ``hidden_states`` holds side by side (``L - 1``).
        width: the draft's hidden width.
        learning_rate: AdamW learning rate.
    """

    def __init__(
        self,
        vocab_size: int,
        verifier_hidden_size: int,
        aux_layers: int,
        width: int = 128,
        learning_rate: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab_size, verifier_hidden_size)
        self.head = torch.nn.Sequential(
            torch.nn.Linear((aux_layers + 1) * verifier_hidden_size, width),
            torch.nn.GELU(),
            torch.nn.Linear(width, verifier_hidden_size),
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        features = torch.cat([batch["hidden_states"].float(), self.embed(batch["input_ids"])], dim=-1)
        return self.head(features)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        error = (self(batch) - batch["verifier_last_hidden_states"].float()).pow(2).mean(-1)
        mask = batch["loss_mask"].float()
        return (error * mask).sum() / mask.sum().clamp(min=1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        log_held_out(self, "val_loss", self.loss(batch), dataloader_idx)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        log_held_out(self, "test_loss", self.loss(batch), dataloader_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
