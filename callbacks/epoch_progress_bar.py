"""``EpochProgressBar``: Lightning's rich progress bar, with an epoch resumed halfway shown as it is."""

from __future__ import annotations

from datamodules.callbacks.progress_lines import epoch_name
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class EpochProgressBar(RichProgressBar):
    """``RichProgressBar`` whose length is the epoch's number of batches, and whose label is ``Epoch 3``,
    or ``Epoch 3/9`` where ``max_epochs`` bounds the fit.

    Lightning's own bar takes the steps left before ``max_steps`` as the epoch's length, while its
    count goes on from the batch the epoch reached: resumed at batch 20 with 10 steps to go, it read
    ``30/10``; and with ``max_steps`` alone it labelled the epoch ``Epoch 1/-2``. The CLI uses this bar
    on a terminal. Arguments: ``RichProgressBar``'s.
    """

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.num_training_batches

    # Lightning's label of the training bar, which renders max_epochs=-1 as "/-2".
    def _get_train_description(self, current_epoch: int) -> str:
        return epoch_name(self.trainer).capitalize()
