"""What the emulator's checks (`METRALE_EMU_CHECK=race,align`) did in this process, said on
stderr when it exits: how many launches of how many kernels ran checked, and what they
found. A finding also raises KernelError at the launch (library.py); the line at exit says
that the checks ran at all, which a green run otherwise never shows.

One tally per process (the checks are a property of the process's EmuBackends, chosen by
its environment), registered with `atexit` by the first checked launch.
"""
from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass, field


@dataclass
class CheckTally:
    checks: set = field(default_factory=set)        # check names seen ("align", "race")
    launches: int = 0
    kernels: set = field(default_factory=set)
    findings: list = field(default_factory=list)    # the first lines of the reports

    def record(self, kernel: str, checks, finding: str | None = None) -> None:
        self.checks.update(checks)
        self.launches += 1
        self.kernels.add(kernel)
        if finding is not None:
            self.findings.append(f"{kernel}: {finding.splitlines()[0]}")

    def summary(self) -> str:
        names = ",".join(sorted(self.checks))
        found = "nothing found" if not self.findings else \
            f"{len(self.findings)} launch(es) failed, the first: {self.findings[0]}"
        return (f"metrale: emulator checks ({names}) ran on {self.launches} launches of "
                f"{len(self.kernels)} kernels: {found}")


_TALLY: CheckTally | None = None


def tally() -> CheckTally:
    """This process's tally; the first call registers the summary line at exit."""
    global _TALLY
    if _TALLY is None:
        _TALLY = CheckTally()
        atexit.register(_say_summary)
    return _TALLY


def _say_summary() -> None:
    if _TALLY is not None and _TALLY.launches:
        print(_TALLY.summary(), file=sys.stderr, flush=True)
