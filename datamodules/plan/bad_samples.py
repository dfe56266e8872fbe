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
    """Counts the samples skipped so far in this process and logs each the first time it is seen.

    ``reasons``: each bad sample (``"<source>:<split> row <n> ..."``) and why, first seen first;
    ``replacements``: how many times a bad sample was met (a sample met again counts again).
    ``repr`` gives the counts per split and a few examples.
    """

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

    def __repr__(self) -> str:
        if not self.reasons:
            return "BadSampleLog(no bad samples)"
        splits: dict[str, int] = {}
        for sample in self.reasons:
            split = sample.split(" row ", 1)[0]
            splits[split] = splits.get(split, 0) + 1
        per_split = ", ".join(f"{count} in {split}" for split, count in splits.items())
        examples = "; ".join(f"{sample}: {reason}" for sample, reason in list(self.reasons.items())[:3])
        return (
            f"BadSampleLog({len(self.reasons)} bad samples met {self.replacements} times: {per_split}; e.g. {examples})"
        )
