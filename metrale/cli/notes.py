"""What the commands say on stderr besides errors: notes (a setting changed or ignored) and
progress lines. stdout carries only results (text, tables, JSON), so a pipe or a file gets
nothing else; stderr gets one line per unit of long work, terminal or not, so a log shows
where a run is."""
from __future__ import annotations

import sys
import time


def note(text: str) -> None:
    """One line on stderr: `metrale: text`."""
    print(f"metrale: {text}", file=sys.stderr, flush=True)


class Progress:
    """`metrale COMMAND: [i/n] what (elapsed s)` lines on stderr, one per unit of work
    (`total` None: units not counted ahead, `metrale COMMAND: what (elapsed s)`)."""

    def __init__(self, command: str, total: int | None) -> None:
        self.command, self.done = command, 0
        self.total = None if total is None else int(total)
        self._t0 = time.perf_counter()

    def step(self, what: str) -> None:
        """One unit finished (`what` says which)."""
        self.done += 1
        count = "" if self.total is None else \
            f"[{self.done:>{len(str(self.total))}}/{self.total}] "
        print(f"metrale {self.command}: {count}{what} "
              f"({time.perf_counter() - self._t0:.1f} s)", file=sys.stderr, flush=True)
