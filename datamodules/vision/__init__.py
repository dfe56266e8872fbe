"""Vision sources: image-text pairs (and video clips) for vision-language models."""
