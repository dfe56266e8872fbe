"""The peer benchmark's measurements can tell a loader that resumes exactly from one that does not,
and count the memory a loader's workers add."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.peer_loaders import peer_plain, protocol
from benchmarks.peer_loaders.corpus import write_corpus
from benchmarks.peer_loaders.protocol import PeakMemory, Setup


def restarting(loader: object) -> SimpleNamespace:
    """A contender module around ``peer_plain`` whose resume ignores the state: it starts over."""

    class Contender(peer_plain.Contender):
        def __init__(self, setup: Setup, state: dict | None) -> None:
            super().__init__(setup, None)

    return SimpleNamespace(Contender=Contender)


def test_exact_resume_is_told_apart_from_a_restart(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path, 200_000)
    setup = Setup(data=str(tmp_path), corpus=str(corpus), seq_len=64, batch_size=4)
    assert protocol.exact(peer_plain, setup, steps=10, stop=4) == {"exact resume": "yes"}
    assert protocol.exact(restarting(peer_plain), setup, steps=10, stop=4) == {
        "exact resume": "no: 6 of 6 batches after the resume differ"
    }


class Alternating:
    """Batches of 8 with 6 then 5 samples of source0 (token ids below the split), and no state."""

    def __init__(self, setup: Setup, state: object) -> None:
        self.yielded = 0 if state is None else state

    def batches(self):
        while True:
            count = 6 if self.yielded % 2 == 0 else 5
            self.yielded += 1
            yield np.array([[self.yielded]] * count + [[protocol.SOURCE_SPLIT + self.yielded]] * (8 - count))

    def state_dict(self) -> int:
        return self.yielded

    def close(self) -> None:
        pass


def test_mixture_deviation_is_the_largest_of_any_batch(tmp_path: Path) -> None:
    setup = Setup(data=str(tmp_path), corpus=str(tmp_path), batch_size=8, mixture=True, weights=[0.7, 0.3])
    result = protocol.exact(SimpleNamespace(Contender=Alternating), setup, steps=6, stop=3, mixture_batches=10)
    assert result["exact resume"] == "yes"
    assert abs(result["max deviation"] - 0.6) < 1e-9  # 5 where 0.7 * 8 = 5.6 is expected
    assert result["source0 share"] == 55 / 80  # 6 + 5 in every two batches of 8


def test_peak_memory_counts_what_child_processes_add() -> None:
    # A fresh interpreter (not a fork of this one, whose pages a fork would share and then copy),
    # holding 200 MB it wrote, so they are resident and its own.
    hold = "import time, numpy as np; block = np.ones(200 * 2**20, dtype=np.uint8); time.sleep(0.6)"
    with PeakMemory() as memory:
        subprocess.run([sys.executable, "-c", hold], check=True)
    added = memory.megabytes()["added MB"]
    assert 200 <= added < 260, added
