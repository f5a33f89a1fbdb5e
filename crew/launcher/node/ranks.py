"""What the agent keeps for each rank it started, and the writer all its threads share.

The agent (agent.py) fills these in; the join watch (joinwatch.py) reads them.
"""

from __future__ import annotations

import collections
import os
import subprocess
import threading
from dataclasses import dataclass, field
from typing import BinaryIO

from crew.launcher.transport.protocol import encode_event, split_long_lines

STDERR_TAIL_LINES = 20


@dataclass
class Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    log: BinaryIO | None = None
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    stderr_done: threading.Event = field(default_factory=threading.Event)
    dump: list[str] | None = None  # its stderr lines since it was sent SIGABRT for its stack
    said_timeout: bool = False  # a stderr line said a torch.distributed operation timed out
    stack_pipe: int | None = None  # read end of the pipe its stacks come on, when asked (node/sampler)
    checkpoint: str | None = None  # where it saved when preempted (its stderr's PREEMPTED_MARK line)
    outputs_file: str | None = None  # global rank 0: where its engine lists its checkpoints (crew/outputs.py)

    @property
    def code(self) -> int | None:
        return self.proc.returncode


class Output:
    """Writes whole lines from many threads to the agent's stdout/stderr and to rank logs; lines longer
    than `line_max` go in pieces tagged with `node` (under srun, see protocol.split_long_lines)."""

    def __init__(self, on_broken, node: int = 0, line_max: int = 0):
        self._lock = threading.Lock()
        self._on_broken = on_broken
        self.node, self.line_max = node, line_max

    def write(self, fd: int, data: bytes, log: BinaryIO | None = None, log_data: bytes = b""):
        data = split_long_lines(data, self.node, self.line_max)
        with self._lock:
            if log is not None:
                log.write(log_data)
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:  # the launcher (or ssh) is gone
                self._on_broken()

    def event(self, kind: str, **fields) -> None:
        self.write(1, encode_event(kind, **fields))
