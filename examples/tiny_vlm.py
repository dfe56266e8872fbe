"""A tiny randomly initialised vision-language model (a patch encoder feeding a HuggingFace Llama)
that trains on our image-text batches: image embeddings go in at ``image_positions``."""

from __future__ import annotations

import torch

from examples.tiny_lm import TinyCausalLM


class PatchEncoder(torch.nn.Module):
    """Non-overlapping ``patch_size`` patches to ``hidden_size`` vectors, plus learned positions."""

    def __init__(self, image_size: int, patch_size: int, hidden_size: int) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be a multiple of patch_size={patch_size}")
        self.num_patches = (image_size // patch_size) ** 2
        self.patches = torch.nn.Conv2d(3, hidden_size, kernel_size=patch_size, stride=patch_size)
        self.positions = torch.nn.Parameter(torch.zeros(1, self.num_patches, hidden_size))
        self.mlp = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(hidden_size, hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.patches(pixel_values).flatten(2).transpose(1, 2) + self.positions)


class TinyVLM(TinyCausalLM):
    """``TinyCausalLM`` whose token embeddings at ``image_positions`` are replaced by a patch
    encoder's outputs; training, validation and the optimizer are the LM's.

    Args:
        vocab_size, hidden_size, num_layers, num_heads, learning_rate: see ``TinyCausalLM``.
        max_seq_len: longest sequence (the DataModule's ``max_text_len``).
        image_size: pixels per side.
        patch_size: pixels per patch side; the DataModule's ``num_image_tokens`` must be
            ``(image_size // patch_size) ** 2``.
    """

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        max_seq_len: int = 64,
        image_size: int = 64,
        patch_size: int = 16,
        learning_rate: float = 3e-3,
    ) -> None:
        super().__init__(vocab_size, hidden_size, num_layers, num_heads, max_seq_len, learning_rate)
        self.vision = PatchEncoder(image_size, patch_size, hidden_size)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        features = self.vision(batch["pixel_values"])
        positions = batch["image_positions"]
        if positions.shape[1] != features.shape[1]:
            raise ValueError(
                f"the batch has {positions.shape[1]} image positions but the encoder gives {features.shape[1]} "
                "patches: set the DataModule's num_image_tokens to (image_size // patch_size) ** 2"
            )
        return self.logits_with(batch, features, positions)

    def logits_with(
        self, batch: dict[str, torch.Tensor], features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The LM's logits with the token embeddings at ``positions`` replaced by ``features``."""
        embeds = self.model.get_input_embeddings()(batch["input_ids"])
        index = positions.unsqueeze(-1).expand(-1, -1, embeds.shape[-1])
        embeds = embeds.scatter(1, index, features.to(embeds.dtype))
        return self.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits


class TinyInterleavedVLM(TinyVLM):
    """``TinyVLM`` for interleaved documents: the batch's images (``pixel_values`` ``[N, 3, H, W]``, in
    order) through the patch encoder, their patches in turn into the placeholders (``input_ids`` equal
    to ``image_token_id``), row by row, as LLaVA-style models scatter them. Packed rows (with
    ``position_ids``) keep attention within each document, where its positions restart.

    Args:
        vocab_size, hidden_size, num_layers, num_heads, max_seq_len, image_size, patch_size,
            learning_rate: see ``TinyVLM``.
        image_token_id: the placeholders' id (the DataModule's ``image_token``).
    """

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        max_seq_len: int = 128,
        image_size: int = 64,
        patch_size: int = 16,
        image_token_id: int = 2,
        learning_rate: float = 3e-3,
    ) -> None:
        super().__init__(
            vocab_size, hidden_size, num_layers, num_heads, max_seq_len, image_size, patch_size, learning_rate
        )
        self.image_token_id = image_token_id

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(batch["input_ids"])
        placeholders = batch["input_ids"] == self.image_token_id
        features = self.vision(batch["pixel_values"]).reshape(-1, embeds.shape[-1])
        if int(placeholders.sum()) != len(features):
            raise ValueError(
                f"the batch has {int(placeholders.sum())} placeholders for {len(features)} image patches: set the "
                "DataModule's num_image_tokens to (image_size // patch_size) ** 2 and image_token_id to its image_token"
            )
        embeds = embeds.masked_scatter(placeholders.unsqueeze(-1), features.to(embeds.dtype))
        if "position_ids" in batch:  # packed documents: attention stays within each, where positions restart
            return self.model(inputs_embeds=embeds, position_ids=batch["position_ids"], use_cache=False).logits
        return self.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits


class TinyVideoLM(TinyVLM):
    """``TinyVLM`` for clips: each frame through the patch encoder, its patches averaged to one
    vector, plus a learned frame-position vector; the ``max_frames`` vectors go in at
    ``video_positions`` (a masked frame gives zeros), so the LM reads the frames in order.

    Args:
        vocab_size, hidden_size, num_layers, num_heads, max_seq_len, image_size, patch_size,
            learning_rate: see ``TinyVLM``.
        max_frames: the DataModule's ``max_frames``, which is also its ``num_video_tokens``.
    """

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        max_seq_len: int = 40,
        image_size: int = 32,
        patch_size: int = 8,
        max_frames: int = 4,
        learning_rate: float = 3e-3,
    ) -> None:
        super().__init__(
            vocab_size, hidden_size, num_layers, num_heads, max_seq_len, image_size, patch_size, learning_rate
        )
        self.frame_positions = torch.nn.Parameter(torch.zeros(1, max_frames, hidden_size))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = batch["pixel_values"]  # [B, F, 3, H, W]
        b, f = pixels.shape[:2]
        features = self.vision(pixels.flatten(0, 1)).mean(1).view(b, f, -1) + self.frame_positions[:, :f]
        features = features * batch["frame_mask"].unsqueeze(-1).to(features.dtype)
        positions = batch["video_positions"]
        if positions.shape[1] != f:
            raise ValueError(
                f"the batch has {positions.shape[1]} video positions for {f} frames: set the DataModule's "
                "num_video_tokens to its max_frames"
            )
        return self.logits_with(batch, features, positions)
