"""Where is each rank while the job runs? The agent's half of the stall report (the launcher's: job/stalls.py).

Every `interval` seconds the sampler reads each live rank's main-thread counters in /proc: CPU time and
voluntary context switches. A main thread whose counters did not move since the last look has been
blocked all that time (in a collective that waits for a rank that does not come, on a lock, in a sleep).
Then, once per blocked spell, the sampler asks the rank where it is: the rank's sitecustomize
(node/site) registered faulthandler on STACK_SIGNAL, writing the main thread's stack to a pipe that only
the agent reads, so the rank is not stopped and prints nothing. Busy ranks are left alone; a training
loop, even one that calls the same all_reduce on every step, blocks and wakes between looks and so counts
as busy. One `places` event per look says, for each rank: busy, blocked (where, and for how long), or
exited. When the launcher asks (`where` on stdin) every live rank's stack is taken, busy or not, so that a
stall report can say where the ranks that did not arrive are. Under pdsh, which gives the agents no
stdin, every look takes every stack.
"""

from __future__ import annotations

import ctypes
import os
import queue
import select
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from crew.launcher.node import stacks
from crew.launcher.node.ranks import Output, Rank

STACK_SIGNAL = signal.SIGRTMIN + 6  # a real-time signal no script uses; its default action would kill
DUMP_WAIT_S = 1.0  # for a rank to start writing its stack
DUMP_QUIET_S = 0.05  # the dump is whole once the pipe has been quiet this long
_TGKILL = {"x86_64": 234, "aarch64": 131, "ppc64le": 250, "s390x": 241, "riscv64": 131}.get(os.uname().machine)


def look_interval(stall_report_s: float) -> float:
    """How often to look: a sixth of the time after which a stall is reported, between 0.5 and 10 s."""
    return min(10.0, max(0.5, stall_report_s / 6))


def stack_pipe() -> tuple[int, int]:
    """(read end, write end) of a rank's stack pipe; the write end goes to the rank (pass_fds)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    return read_end, write_end


def rank_stacks_env(write_end: int) -> dict[str, str]:
    """What tells the rank's sitecustomize to serve stacks on STACK_SIGNAL into `write_end`."""
    return {"CREW_STACKS": f"{write_end}:{int(STACK_SIGNAL)}"}


def main_thread_counters(pid: int) -> tuple[int, int, int] | None:
    """(user ticks, system ticks, voluntary context switches) of a process's main thread; None if gone."""
    task = Path(f"/proc/{pid}/task/{pid}")
    try:
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        status = (task / "status").read_text()
    except (OSError, IndexError):
        return None
    switches = next((line.split()[1] for line in status.splitlines()
                     if line.startswith("voluntary_ctxt_switches:")), "0")
    return int(fields[11]), int(fields[12]), int(switches)


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (SigCgt in /proc/PID/status): only then may it be sent
    a real-time signal, whose default action ends the process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (sig - 1) & 1)


def signal_main_thread(pid: int, sig: int) -> None:
    """Send `sig` to the process's main thread itself (tgkill), not to any of its threads (kill)."""
    if _TGKILL is None or ctypes.CDLL(None, use_errno=True).syscall(_TGKILL, pid, pid, sig) != 0:
        os.kill(pid, sig)


def read_dump(fd: int, wait_s: float = DUMP_WAIT_S, quiet_s: float = DUMP_QUIET_S) -> str:
    """What arrives on a stack pipe: up to `wait_s` for the first bytes, then until it is quiet."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    data, timeout = b"", wait_s
    while poller.poll(timeout * 1000):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            chunk = b""
        if not chunk:
            break
        data, timeout = data + chunk, quiet_s
    return data.decode(errors="replace")


def drain(fd: int) -> None:
    """Drop what a late dump left in the pipe, so that the next read holds the next dump only."""
    while True:
        try:
            if not os.read(fd, 65536):
                return
        except BlockingIOError:
            return


@dataclass
class Watched:
    rank: Rank
    counters: tuple[int, int, int] | None = None
    looked_at: float = 0.0
    blocked_since: float | None = None  # monotonic: the look since which its counters have not moved
    place: stacks.Where | None = None  # where it was at its last stack


class Sampler:
    """Looks at the node's ranks every `interval` s (see the module docstring) until stopped; then closes
    the ranks' stack pipes."""

    def __init__(self, ranks: Sequence[Rank], output: Output, node: int, host: str, cwd: str, interval: float,
                 every_stack: bool = False):
        self.watched = [Watched(rank) for rank in ranks]
        self.output, self.node, self.host, self.cwd = output, node, host, cwd
        self.interval, self.every_stack = interval, every_stack
        self.stopped = threading.Event()
        self._wake: queue.SimpleQueue = queue.SimpleQueue()  # "where" (the launcher asks) or "stop"

    def ask(self) -> None:
        """The launcher wants every rank's place now (a stall report is being written)."""
        self._wake.put("where")

    def stop(self) -> None:
        self.stopped.set()
        self._wake.put("stop")

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                asked = self._woken()
                entries = []
                for w in self.watched:
                    if self.stopped.is_set():
                        return
                    entries.append(self.look(w, time.monotonic(), asked or self.every_stack))
                self.output.event("places", node=self.node, host=self.host, where=asked, ranks=entries)
        finally:
            for w in self.watched:
                if w.rank.stack_pipe is not None:
                    os.close(w.rank.stack_pipe)
                    w.rank.stack_pipe = None

    def _woken(self) -> bool:
        """Wait for the next look; True when the launcher asked for it (every ask before it is answered)."""
        try:
            asked = self._wake.get(timeout=self.interval) == "where"
        except queue.Empty:
            return False
        while not self._wake.empty():
            asked = self._wake.get() == "where" or asked
        return asked

    def look(self, w: Watched, now: float, want_stack: bool) -> dict:
        entry = {"rank": w.rank.rank}
        counters = None if w.rank.proc.poll() is not None else main_thread_counters(w.rank.proc.pid)
        if counters is None:
            return {**entry, "state": "exited", "code": w.rank.proc.returncode}
        blocked = counters == w.counters
        if not blocked:
            w.blocked_since, w.place = None, None
        elif w.blocked_since is None:
            w.blocked_since = w.looked_at
            want_stack = True  # once per blocked spell: it is where it is until it moves
        w.counters, w.looked_at = counters, now
        if want_stack:
            w.place = self.where(w)
            w.counters = main_thread_counters(w.rank.proc.pid) or counters  # the dump woke it: not a move
        if w.place is not None:
            entry.update(call=w.place.call, at=w.place.location)
        if blocked:
            return {**entry, "state": "blocked", "for_s": round(now - w.blocked_since, 1)}
        return {**entry, "state": "busy"}

    def where(self, w: Watched) -> stacks.Where | None:
        """The rank's main-thread place, from a stack it writes without stopping; None if it cannot say."""
        pid, pipe = w.rank.proc.pid, w.rank.stack_pipe
        if pipe is None or not catches(pid, STACK_SIGNAL):
            return None
        drain(pipe)
        try:
            signal_main_thread(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return None
        frames = stacks.single_stack(read_dump(pipe))
        return stacks.where(frames, self.cwd) if frames else None
