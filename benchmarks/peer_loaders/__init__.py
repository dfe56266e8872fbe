"""Contenders of ``benchmarks.peers``: one module per loader, all speaking ``protocol``."""
