"""Speculative-decoding data: verifier hidden states on the chat family's packed rows, for training draft models."""
