"""Chat fine-tuning data: conversations rendered by a chat template, the loss on the assistant's turns,
packed by multipack into rows of a fixed length (``ConversationDataModule``); ``speculative`` builds
its hidden-state rows on these."""
