"""``ConversationDataModule``: chat fine-tuning (SFT) on conversations packed into rows, loss on the
assistant's tokens, through the sample plan."""

from __future__ import annotations

from typing import Any

from datamodules.chat.conversation_rows import ConversationRows
from datamodules.chat.conversation_source import ConversationSource
from datamodules.plan.arguments import require_int
from datamodules.plan.datamodule import PlanDataModule


class ConversationDataModule(PlanDataModule):
    """Fine-tunes on conversations: ``batch_size`` rows of ``total_seq_len`` tokens per rank per step.

    Conversations are rendered with the tokenizer's chat template and masked to the assistant's turns
    once per node, in ``prepare_data``, into ``cache_dir`` (``prepare_conversations``); a folder
    prepared already (by it or by speculators) is read as it is. Multipack packs them into rows,
    afresh every pass; the rows are the plan's samples, so the order, exact and elastic resume and
    coverage are the plan's, and no row depends on the number of ranks. Batches: see
    ``ConversationRows`` (``labels`` already shifted; ``position_ids``, ``cu_seqlens`` and
    ``document_ids`` keep the conversations of a row apart).

    Args:
        data, tokenizer, chat_template, system_prompt, split, val_split, val_fraction, test_split,
            test_fraction, max_length, over_long, train_on_prompt, attention_mask, length_quantum,
            cache_dir, num_proc: see ``ConversationSource``.
        total_seq_len: tokens per packed row.
        batch_size: rows per data-parallel rank per micro-batch.
        seed, num_workers, allow_plan_change, pin_memory, prefetch_factor, in_order, broadcast_within,
            split_sequence_for, sequence_split: see
            ``PlanDataModule``.

    Example::

        dm = ConversationDataModule("chats.jsonl", total_seq_len=4096, tokenizer="meta-llama/Llama-3.2-1B-Instruct")
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        data: str | list[str],
        total_seq_len: int,
        tokenizer: str | None = None,
        batch_size: int = 1,
        chat_template: str | None = None,
        system_prompt: str | None = None,
        split: str | None = None,
        val_split: str | None = None,
        val_fraction: float = 0.0,
        test_split: str | None = None,
        test_fraction: float = 0.0,
        max_length: int | None = None,
        over_long: str = "truncate",
        train_on_prompt: bool = False,
        attention_mask: str = "none",
        length_quantum: int | None = None,
        cache_dir: str = ".cache/datamodules/conversations",
        num_proc: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        allow_plan_change: bool = False,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        broadcast_within: str | list[str] | None = None,
        split_sequence_for: str | list[str] | None = None,
        sequence_split: str = "head_tail",
        in_order: bool = True,
    ) -> None:
        super().__init__(
            batch_size,
            seed=seed,
            num_workers=num_workers,
            allow_plan_change=allow_plan_change,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            broadcast_within=broadcast_within,
            split_sequence_for=split_sequence_for,
            sequence_split=sequence_split,
            in_order=in_order,
        )
        self.total_seq_len = require_int("total_seq_len", total_seq_len, 1)
        self.source = ConversationSource(
            data, tokenizer, chat_template, system_prompt, split, val_split, val_fraction, test_split,
            test_fraction, max_length, over_long, train_on_prompt, attention_mask, length_quantum, cache_dir,
            num_proc,
        )  # fmt: skip
        self.save_hyperparameters()

    test_options = "give it test_fraction or test_split"

    def sequence_length(self) -> int:
        return self.total_seq_len

    def source_specs(self) -> list[ConversationSource]:
        return [self.source]

    def build_sources(self) -> list[tuple[str, ConversationRows, dict[str, ConversationRows]]]:
        return [("train", *self.source.build(self.total_seq_len))]

    def packing(self) -> dict[str, Any]:
        """How full the rows of the first pass are: rows, conversations, token efficiency."""
        train = self._require_setup()
        tokens = train.packed.row_tokens(0)
        return {
            "rows": len(tokens),
            "conversations": train.packed.num_kept,
            "token_efficiency": float(tokens.sum() / (len(tokens) * self.total_seq_len)),
        }
