"""Where was each rank? Python stacks from faulthandler dumps and tracebacks, said in one line.

The agent starts every rank with PYTHONFAULTHANDLER=1. To see where a stuck rank is, it sends the rank
SIGABRT: faulthandler's C-level handler prints every Python thread's stack to the rank's stderr (it works
while the rank is blocked in C code: gloo, NCCL, a socket) and the rank ends. This module reads such a
dump (and the traceback of a rank that failed on its own) and says where the rank was, e.g.
`waiting in torch.distributed init_process_group, called from train.py:12`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from crew.launcher.console.ranges import rank_list

_FATAL = "Fatal Python error:"
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+).*\(most recent call first\):$")
_STACK = "Stack (most recent call first):"
_DUMP_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_TB_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)$')
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")  # torch prefixes a rank's uncaught traceback with it
_TIMEOUT = re.compile(
    r"Timed out waiting|Watchdog caught collective operation timeout|collective operation timeout"
    r"|watchdog got stuck|DistStoreError|Socket Timeout|timed out after \d+|Timed out after \d+")
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3")
_DIST = ("/torch/distributed/", "/torch/nn/parallel/")
# Not collectives: a logging wrapper around them; RPC, and a launcher's agent loop (torchrun, accelerate
# launch run as a rank), which wait in torch.distributed for reasons of their own.
_DIST_WRAPPERS = ("/torch/distributed/c10d_logger.py",)
_NOT_COLLECTIVES = ("/torch/distributed/rpc/", "/torch/distributed/elastic/", "/torch/distributed/launcher/",
                    "/torch/distributed/run.py")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str


@dataclass(frozen=True)
class Thread:
    ident: str
    current: bool
    frames: tuple[Frame, ...]  # innermost (most recent call) first


@dataclass(frozen=True)
class Where:
    """Where a rank was: in a torch.distributed call (named) or not, and the script's line."""

    call: str | None  # e.g. "torch.distributed all_reduce", or None outside torch.distributed
    location: str  # e.g. "train.py:12 in step"

    @property
    def in_collective(self) -> bool:
        return self.call is not None


def parse_dump(lines: Iterable[str]) -> list[Thread] | None:
    """The threads of the last faulthandler dump in `lines` (the main thread last); None if none."""
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if line.startswith(_FATAL)]
    if not starts:
        return None
    threads: list[Thread] = []
    header: tuple[str, bool] | None = None
    frames: list[Frame] = []
    for line in lines[starts[-1] + 1:]:
        match = _THREAD.match(line)
        if match or line.strip() == _STACK:
            if header:
                threads.append(Thread(header[0], header[1], tuple(frames)))
            header = (match.group(2), match.group(1) == "Current thread") if match else ("", True)
            frames = []
        elif header and (frame := _DUMP_FRAME.match(line)):
            frames.append(Frame(frame["file"], int(frame["line"]), frame["func"]))
    if header:
        threads.append(Thread(header[0], header[1], tuple(frames)))
    return threads


def single_stack(text: str) -> tuple[Frame, ...] | None:
    """The frames of a one-thread faulthandler dump (`faulthandler.register(all_threads=False)`: a
    `Stack (most recent call first):` header, then frames), innermost first; None if `text` holds none."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == _STACK]
    if not starts:
        return None
    return tuple(Frame(m["file"], int(m["line"]), m["func"])
                 for line in lines[starts[-1] + 1:] if (m := _DUMP_FRAME.match(line)))


def main_frames(threads: Sequence[Thread]) -> tuple[Frame, ...]:
    """The main thread's frames: faulthandler lists the newest thread first, so the main one last."""
    return threads[-1].frames if threads else ()


def parse_traceback(lines: Iterable[str]) -> tuple[Frame, ...]:
    """The frames of the last Python traceback in `lines`, innermost first (as in a dump)."""
    frames: list[Frame] = []
    for line in lines:
        line = _RANK_PREFIX.sub("", line, count=1)
        if line.lstrip().startswith("Traceback (most recent call last):"):
            frames = []
        elif match := _TB_FRAME.match(line):
            frames.append(Frame(match["file"], int(match["line"]), match["func"]))
    return tuple(reversed(frames))


def looks_like_collective_timeout(lines: Iterable[str]) -> bool:
    """Whether a failed rank's last stderr lines say a torch.distributed operation timed out."""
    return any(_TIMEOUT.search(line) for line in lines)


def _is_dist(frame: Frame) -> bool:
    path = frame.file.replace("\\", "/")
    return (any(part in path for part in _DIST) and not path.endswith(_DIST_WRAPPERS)
            and not any(part in path for part in _NOT_COLLECTIVES))


def _is_backward(frame: Frame) -> bool:
    return "/torch/autograd/" in frame.file.replace("\\", "/")


def _is_users(frame: Frame, cwd: str) -> bool:
    path = os.path.normpath(frame.file)
    inside = os.path.isabs(path) and (path + os.sep).startswith(os.path.normpath(cwd) + os.sep)
    relative = not os.path.isabs(path) and not path.startswith("<")
    return (inside or relative) and not any(part in frame.file for part in _LIBRARY)


def show(frame: Frame, cwd: str) -> str:
    path = frame.file
    if os.path.isabs(path) and (os.path.normpath(path) + os.sep).startswith(os.path.normpath(cwd) + os.sep):
        path = os.path.relpath(path, cwd)
    return f"{path}:{frame.line} in {frame.func}"


def where(frames: Sequence[Frame], cwd: str) -> Where | None:
    """Where a rank whose stack is `frames` (innermost first) was; None without frames.

    The call: the outermost torch.distributed frame that is not a logging wrapper (the function the
    script called, e.g. all_reduce, not gloo's internals), or backward (where DDP reduces gradients).
    The location: the innermost frame in the job's own code (under `cwd`, outside installed packages),
    else the outermost frame.
    """
    if not frames:
        return None
    dist = [frame for frame in frames if _is_dist(frame)]
    call = f"torch.distributed {dist[-1].func}" if dist else None
    if call is None and any(_is_backward(frame) for frame in frames):
        call = "backward (DDP all-reduces gradients there)"
    own = [frame for frame in frames if _is_users(frame, cwd)]
    return Where(call, show(own[0] if own else frames[-1], cwd))


def describe(place: Where | None, verb: str = "waiting") -> str:
    """One line: `waiting in torch.distributed all_reduce, called from train.py:9 in step`."""
    if place is None:
        return "no Python stack (not a Python process, or faulthandler was turned off)"
    if place.call:
        return f"{verb} in {place.call}, called from {place.location}"
    return f"at {place.location}"


def grouped(items: Iterable[tuple[int, str, str]]) -> list[tuple[list[int], str, str]]:
    """(rank, host, text) grouped by (host, text): (ranks, host, text), in rank order."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, host, text in sorted(items):
        groups.setdefault((host, text), []).append(rank)
    return [(ranks, host, text) for (host, text), ranks in sorted(groups.items(), key=lambda g: min(g[1]))]


MANY_HOSTS = 3  # more hosts than this with the same text: one group, named by a count and a few hosts


def merged(items: Iterable[tuple[int, str, str]]) -> list[tuple[list[int], str, str]]:
    """Like grouped(), but a text shared by more than MANY_HOSTS hosts is one group whose host is
    `N nodes, e.g. a, b, c`: a report stays a few short lines on any number of nodes."""
    items = list(items)
    by_text: dict[str, set[str]] = {}
    for _, host, text in items:
        by_text.setdefault(text, set()).add(host)
    wide = {text for text, hosts in by_text.items() if len(hosts) > MANY_HOSTS}
    groups = grouped((rank, host, text) for rank, host, text in items if text not in wide)
    for text in wide:
        ranks = sorted(rank for rank, _, other in items if other == text)
        hosts = list(dict.fromkeys(host for rank, host, other in sorted(items) if other == text))
        groups.append((ranks, f"{len(hosts)} nodes, e.g. {', '.join(hosts[:MANY_HOSTS])}", text))
    return sorted(groups, key=lambda group: min(group[0]))


def group_lines(items: Iterable[tuple[int, str, str]]) -> list[str]:
    """(rank, host, text) as lines `ranks 0-3 (host): text`, one per host and text (hosts merged when
    many share a text), in rank order."""
    return [f"{rank_list(ranks)} ({host}): {text}" for ranks, host, text in merged(items)]
