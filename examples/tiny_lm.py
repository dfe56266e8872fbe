"""A tiny randomly initialised causal LM (a HuggingFace Llama) that trains on our text batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from transformers import LlamaConfig, LlamaForCausalLM


def log_held_out(module: LightningModule, metric: str, loss: torch.Tensor, dataloader_idx: int) -> None:
    """Logs a validation or test ``metric`` (``"val_loss"``, ``"test_loss"``), named by its source
    (``val_loss/web``) where the DataModule has a loader per source and says which (``held_out_names``)."""
    role = "validation" if module.trainer.validating or module.trainer.sanity_checking else "test"
    datamodule = getattr(module.trainer, "datamodule", None)
    names = datamodule.held_out_names(role) if hasattr(datamodule, "held_out_names") else []
    named = len(names) > 1
    name = f"{metric}/{names[dataloader_idx]}" if named else metric
    module.log(name, loss, prog_bar=True, sync_dist=True, add_dataloader_idx=not named)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over positions with a label; 0 for a batch that has none (padding)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return total / (labels != -100).sum().clamp(min=1)


class TinyCausalLM(LightningModule):
    """A small Llama trained on batches that follow the batch contract (labels already shifted).

    Validation and test losses are logged as ``val_loss`` and ``test_loss``, or by source
    (``val_loss/web``) where the DataModule has a loader per source (``held_out_names``).

    Args:
        vocab_size: must cover the tokenizer's ids.
        hidden_size: model width.
        num_layers: decoder layers.
        num_heads: attention heads.
        max_seq_len: longest sequence (position embedding range).
        learning_rate: AdamW learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        max_seq_len: int = 2048,
        learning_rate: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 4,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=max_seq_len,
        )
        self.model = LlamaForCausalLM(config)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # No cache: only then does transformers find packed documents from where the positions restart
        # (with a cache, attention would cross from one document or conversation into the next).
        positions = batch.get("position_ids")
        return self.model(input_ids=batch["input_ids"], position_ids=positions, use_cache=False).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = causal_lm_loss(self(batch), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        log_held_out(self, "val_loss", causal_lm_loss(self(batch), batch["labels"]), dataloader_idx)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        log_held_out(self, "test_loss", causal_lm_loss(self(batch), batch["labels"]), dataloader_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
