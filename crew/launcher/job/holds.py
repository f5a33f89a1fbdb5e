"""Verdicts on a job's end that wait a moment for a better one.

srun merges its tasks' output with no order between tasks: node 1's rank failure can reach crew after
node 0's agent said it was stopped from outside, and srun's own line on a task's end (its stderr) can come
before that task's last events (its stdout). So two kinds of news wait before they end the job:

- an agent that stopped its ranks on a signal from outside (scancel, a time limit, a kill by hand): until
  every node has reported or its agent ended, or HOLD_S. A rank failure that arrives meanwhile wins; a
  true scancel (every agent signalled, no rank failure) ends the job as before.
- an srun task that ended before its node said `done` (its agent died, or never started): until that
  `done` comes, which makes it moot, or HOLD_S. It yields to an outside stop held at the same time.

`job.JobRun` feeds this and acts on what falls due; nothing here touches a process.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from crew.errors import LaunchError
from crew.launcher.plan.slurm import expand_nodelist

HOLD_S = 2.5
# srun's account of tasks that ended badly: "srun: error: gpu02: task 1: Exited with exit code 3",
# "srun: error: gpu[01-02]: tasks 0-1: Killed" (Slurm's launch/slurm _task_finish).
_SRUN_TASK_END = re.compile(r"srun: error: (\S+): tasks? [0-9,-]+: (.+)")
_EXITED = re.compile(r"Exited with exit code (\d+)")
_SIGNALS = {signal.strsignal(sig): sig for sig in signal.Signals}


@dataclass(frozen=True)
class TaskEnd:
    """srun's line on tasks that ended badly: their hosts, what srun said, as an exit code."""

    hosts: tuple[str, ...]
    status: str
    code: int


def srun_task_end(line: str) -> TaskEnd | None:
    """The task end that `line` (one line of srun's stderr) reports, else None."""
    match = _SRUN_TASK_END.fullmatch(line.strip())
    if not match:
        return None
    try:
        hosts = tuple(expand_nodelist(match[1]))
    except LaunchError:
        return None
    status = match[2].removesuffix(" (core dumped)")
    exited = _EXITED.fullmatch(status)
    sig = _SIGNALS.get(status)
    code = int(exited[1]) if exited else 128 + sig if sig else 1
    return TaskEnd(hosts, match[2], code)


class Holds:
    def __init__(self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s, self.clock = hold_s, clock
        self.outside: tuple[float, dict] | None = None  # (until, the agent's `done` event)
        self.tasks: dict[int, tuple[float, TaskEnd]] = {}  # node -> (until, srun's line on it)

    def outside_stop(self, done_event: dict) -> None:
        if self.outside is None:
            self.outside = (self.clock() + self.hold_s, done_event)

    def task_end(self, node: int, end: TaskEnd) -> None:
        self.tasks.setdefault(node, (self.clock() + self.hold_s, end))

    def reported(self, node: int) -> None:
        """The node's `done` arrived: srun's line on its task says nothing more."""
        self.tasks.pop(node, None)

    def deadline(self) -> float | None:
        until = [t for t, _ in self.tasks.values()] + ([self.outside[0]] if self.outside else [])
        return min(until) if until else None

    def due(self, settled: bool) -> tuple[dict | None, list[tuple[int, TaskEnd]]]:
        """What ends the job now: the held outside stop (when `settled`, every node reported or its agent
        ended, or once its time is up), else the task ends whose time is up. Each is given once."""
        now = self.clock()
        if self.outside is not None:
            if not settled and now < self.outside[0]:
                return None, []
            event, self.outside = self.outside[1], None
            return event, []
        ended = sorted((node, end) for node, (until, end) in self.tasks.items() if now >= until)
        for node, _ in ended:
            del self.tasks[node]
        return None, ended

    def clear(self) -> None:
        """The job is stopping for another reason: nothing held counts any more."""
        self.outside, self.tasks = None, {}
