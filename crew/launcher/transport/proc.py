"""Process-tree helpers shared by the launcher and the agent (Linux /proc and prctl)."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """preexec_fn: SIGKILL (or `sig`) this child when the thread that started it dies, however it dies."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            found.append(int(entry.name))
    return found


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """Signal a process's group and each of its direct children.

    pdsh starts each ssh client in a session of its own, out of reach of its group's signals.
    """
    kids = children(pid)
    signal_group(pid, sig)
    for child in kids:
        try:
            os.kill(child, sig)
        except (ProcessLookupError, PermissionError):
            pass


def seconds_since_exec() -> float:
    """How long this process has run since exec: Python start-up and imports, when asked early."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
