"""Benchmarks of the data path, each run as ``python -m benchmarks.<name>`` from the repository root.

Every script compares its contenders side by side in one run and writes ``benchmarks/results/<name>.{json,md}``.
"""
