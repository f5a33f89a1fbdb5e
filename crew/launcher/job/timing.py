"""CREW_TIMING=1: `crew run` ends with one line saying when each phase of the launch ended.

    crew: timing (s since crew started): preflight 0.91, agents up 1.52, ranks done 1.60, exit 1.71

Seconds since the `crew` process was exec'd (Python start-up included), so a harness that knows when it
started crew can place each phase on its own clock (benchmarks/fanout.py). A restarted job
(--max_restarts) shows its last attempt.
"""

from __future__ import annotations

import os
import time

from crew.errors import CrewError
from crew.launcher.transport.proc import seconds_since_exec

TIMING_ENV = "CREW_TIMING"
PHASES = ("preflight", "agents up", "ranks done", "exit")


class Timing:
    def __init__(self, environ: dict[str, str] | None = None):
        value = (os.environ if environ is None else environ).get(TIMING_ENV, "").lower()
        if value not in ("", "0", "false", "no", "1", "true", "yes"):
            raise CrewError(f"{TIMING_ENV}={value!r}: expected 1 (print the phase times) or 0.")
        self.enabled = value in ("1", "true", "yes")
        self.origin = time.monotonic() - seconds_since_exec()
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        """`phase` ended at monotonic time `at` (default: now)."""
        self.marks[phase] = (time.monotonic() if at is None else at) - self.origin

    def elapsed(self) -> float:
        """Seconds since the `crew` process was exec'd."""
        return time.monotonic() - self.origin

    def line(self) -> str | None:
        if not self.enabled:
            return None
        parts = [f"{phase} {self.marks[phase]:.2f}" for phase in PHASES if phase in self.marks]
        return "timing (s since crew started): " + ", ".join(parts)
