"""Bad samples every source family shares: the error that names one, the policy check, and the
per-process log that counts the samples skipped and names each once."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class BadSample(ValueError):
    """A sample that cannot be trained on (an unreadable image, text that does not fit, hidden
    states that do not match their tokens), and why."""


def check_policy(policy: str, allowed: tuple[str, ...] = ("raise", "skip"), option: str = "on_bad_sample") -> str:
    if policy not in allowed:
        raise ValueError(f"{option} must be one of {allowed}, got {policy!r}")
    return policy


class BadSampleLog:
    """Counts the samples skipped so far in this process and logs each the first time it is seen."""

    def __init__(self, action: str = "skipped bad sample %s (%s) for a deterministic replacement") -> None:
        self.reasons: dict[str, str] = {}
        self.replacements = 0  # samples met bad, a sample met twice counting twice
        self.action = action

    def record(self, skipped: list[tuple[str, str]]) -> None:
        for sample, reason in skipped:
            self.replacements += 1
            if sample not in self.reasons:
                self.reasons[sample] = reason
                log.warning(
                    self.action + "; %d bad samples so far",
                    sample,
                    reason,
                    len(self.reasons),
                )
