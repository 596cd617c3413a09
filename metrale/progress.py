"""Lines on stderr about long work, terminal or not: `say` for one line, `Ticker` for work
that may take long (loading weights, scoring a text, a 30 s audio window) and should say how
far it got only once it has taken long, so quick runs stay silent.

Imported by every layer that does long work (it imports nothing of metrale): the device's
builds (gpu_runtime/cxx.py), the weight upload (formats/upload.py), the command line.
"""
from __future__ import annotations

import sys
import time


def say(text: str) -> None:
    """One line on stderr: `metrale: text`."""
    print(f"metrale: {text}", file=sys.stderr, flush=True)


class Ticker:
    """`metrale: what: text (elapsed s)` lines for one piece of work: `tick(text)` prints
    once `after_s` seconds have passed since the start and then at most every `every_s`
    seconds; `done(text)` prints the last line, only if an earlier one was printed."""

    def __init__(self, what: str, after_s: float = 2.0, every_s: float = 5.0) -> None:
        self.what, self.after_s, self.every_s = what, after_s, every_s
        self.t0 = time.perf_counter()
        self._last = None      # when the last line was printed

    def _line(self, text: str) -> None:
        now = time.perf_counter()
        self._last = now
        say(f"{self.what}: {text} ({now - self.t0:.1f} s)")

    def tick(self, text: str) -> None:
        now = time.perf_counter()
        if now - self.t0 < self.after_s:
            return
        if self._last is None or now - self._last >= self.every_s:
            self._line(text)

    def done(self, text: str) -> None:
        if self._last is not None:
            self._line(text)
