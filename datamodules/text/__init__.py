"""The text family: token shards (``.npy``, ``.bin``, Megatron ``.bin/.idx``), windows and packing,
``TokenShardSource``/``TokenShardDataModule`` and the prepare command."""
