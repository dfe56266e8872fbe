"""Argument checks every DataModule, source and command shares (no torch: the prepare command uses them)."""

from __future__ import annotations


def require_int(name: str, value: object, minimum: int, error: type[Exception] = ValueError) -> int:
    """``value`` if it is an integer ``>= minimum``; a float such as ``64.0`` is refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise error(f"{name} must be {what}, got {value!r}")
    return value
