"""Speculative-decoding data: verifier hidden states and multipack rows for training draft models."""
