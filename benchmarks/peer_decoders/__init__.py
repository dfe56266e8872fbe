"""Peer video decoders, each measured in a process of its own by ``benchmarks/video.py``."""
