"""The launcher's console: the ranks' output on crew's stdout and stderr, and crew's own messages.

Rank lines come from the agents prefixed `[host:rank] `; progress-bar updates come marked (`streams`,
`protocol.PROGRESS_MARK`). What the console does with them:

- The same line from several ranks is printed once, as `[host:0] text (and on ranks 1-63)`: while the
  world has more than one rank, an ordinary line is held for MERGE_WINDOW_S and the same text from the
  other ranks joins it. Different lines are never merged; lines keep the order in which they first
  appeared, and each rank's own order on each stream (a line joins only a line later than the rank's
  previous one there; stdout and stderr come through separate pipes, so their relative order is loose).
  A line on stdout and the same on stderr are not merged. A line said by every rank is printed at once.
  crew's own messages (`say`) are never held: what is held is printed first.
- When crew's stdout is a terminal, progress bars are drawn in place below the scrolling lines, one line
  per rank and stream, and the ranks that do not fit share one summary line (`ranks 5-63: 41% … 47%`).
  A rank's ordinary line ends its bar on that stream: it is what a terminal would leave on the screen,
  the bar's final state (tqdm's close), printed once like any line.
- Otherwise (a file, a pipe, CI) a bar's updates are thinned to one line per rank and stream every
  PROGRESS_INTERVAL_S; its final state comes as an ordinary line, and a bar that clears itself (tqdm
  leave=False) leaves its last state.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import shutil
import threading
import time
import unicodedata
from dataclasses import dataclass, field
from typing import BinaryIO

from crew.errors import CrewError
from crew.launcher.transport.protocol import PROGRESS_MARK
from crew.launcher.console.ranges import rank_list, spans

MERGE_WINDOW_S = 0.5  # how long a rank's line waits for the same line from other ranks
PROGRESS_INTERVAL_S = 30.0  # not a terminal: at most one progress line per rank and stream this often
REDRAW_S = 0.1  # a terminal's progress area is redrawn at most this often
MERGE_WINDOW_ENV = "CREW_MERGE_WINDOW"
PROGRESS_INTERVAL_ENV = "CREW_PROGRESS_INTERVAL"

_PREFIX = re.compile(rb"\[([^\]]*):(\d+)\] ")
_PERCENT = re.compile(r"(\d{1,3}(?:\.\d+)?)%")
_INVISIBLE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x1f\x7f]")  # escape sequences, controls

Key = tuple[int, int]  # (rank, 1 for stdout or 2 for stderr)


def is_terminal(stream: BinaryIO) -> bool:
    """Whether `stream` is a terminal that understands cursor movement."""
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise CrewError(f"{name}={text!r}: expected a number of seconds >= 0 (default {default:g}).")
    return value


def also_on(ranks: list[int]) -> bytes:
    """The suffix of a merged line: ' (and on rank 1)', ' (and on ranks 1-63)'."""
    return f" (and on {rank_list(ranks)})".encode() if ranks else b""


# ---------------------------------------------------------------------------------------------
# the same line from many ranks

@dataclass
class _Group:
    seq: int
    fd: int  # 1: stdout, 2: stderr
    text: bytes
    prefix: bytes  # the first rank's `[host:rank] `
    due: float
    ranks: list[int] = field(default_factory=list)
    alone: bool = False  # joined by no other rank (a thinned progress line)


class Merger:
    """Rank lines held for `window` seconds, the same text from other ranks on the same stream joining
    them; they come out in the order they went in."""

    def __init__(self, window: float, world_size: int):
        self.window, self.world_size = window, world_size
        self._groups: collections.deque[_Group] = collections.deque()
        self._held: dict[tuple[int, bytes], list[_Group]] = {}  # (fd, text) -> its groups held, in order
        self._last_seq: dict[tuple[int, int], int] = {}  # (fd, rank) -> the group of its previous line
        self._seq = 0

    def add(self, fd: int, rank: int, prefix: bytes, text: bytes, now: float, alone: bool = False) -> None:
        after = self._last_seq.get((fd, rank), 0)  # a line joins none before the rank's previous line
        same = [] if alone else self._held.get((fd, text), [])
        group = next((g for g in same if g.seq > after), None)
        if group is None:
            self._seq += 1
            group = _Group(self._seq, fd, text, prefix, now + self.window, alone=alone)
            self._groups.append(group)
            if not alone:
                self._held.setdefault((fd, text), []).append(group)
        group.ranks.append(rank)
        self._last_seq[(fd, rank)] = group.seq

    def pop_ready(self, now: float, everything: bool = False) -> list[tuple[int, bytes]]:
        """(fd, line) for the lines whose time has come, in order: expired, said by every rank, or all."""
        out = []
        while self._groups:
            head = self._groups[0]
            if not (everything or head.alone or now >= head.due or len(head.ranks) >= self.world_size):
                break
            self._groups.popleft()
            if not head.alone:
                same = self._held[(head.fd, head.text)]
                same.pop(0)  # the oldest group of its text: groups leave in order
                if not same:
                    del self._held[(head.fd, head.text)]
            out.append((head.fd, head.prefix + head.text + also_on(head.ranks[1:]) + b"\n"))
        return out

    def next_due(self) -> float | None:
        return self._groups[0].due if self._groups else None


# ---------------------------------------------------------------------------------------------
# progress: drawn on a terminal, thinned elsewhere

class Board:
    """The progress bars drawn at the bottom of a terminal: each rank's and stream's newest state."""

    def __init__(self) -> None:
        self.bars: dict[Key, tuple[str, str]] = {}  # key -> (prefix, text)

    def update(self, key: Key, prefix: str, text: str) -> None:
        if text.strip():
            self.bars[key] = (prefix, text)
        else:  # the bar cleared itself
            self.bars.pop(key, None)

    def end(self, key: Key) -> bool:
        return self.bars.pop(key, None) is not None

    def lines(self, width: int, height: int) -> list[str]:
        """One line per bar; those that do not fit in half the screen share one summary line."""
        keys = sorted(self.bars)
        room = max(2, height // 2)
        shown, rest = (keys, []) if len(keys) <= room else (keys[:room - 1], keys[room - 1:])
        lines = [prefix + text for prefix, text in (self.bars[key] for key in shown)]
        if rest:
            lines.append(summary([key[0] for key in rest], [self.bars[key][1] for key in rest]))
        return [fit(line, width) for line in lines]


def summary(ranks: list[int], texts: list[str]) -> str:
    """'ranks 5-63: 41% … 47%' (the least and most done), or how many bars when they show no percentage."""
    percents = [float(m.group(1)) for m in map(_PERCENT.search, texts) if m]
    head = f"ranks {spans(ranks)}: "
    if not percents:
        return head + f"{len(texts)} bars"
    low, high = min(percents), max(percents)
    return head + (f"{low:g}%" if low == high else f"{low:g}% … {high:g}%")


def fit(line: str, width: int) -> str:
    """The line as one terminal row: no escape sequences or control characters, cut to the width (one
    column spare; wide characters count two), so that it never wraps and the area can be erased."""
    text, used = _INVISIBLE.sub("", line.replace("\t", " ")), 0
    for index, char in enumerate(text):
        used += 2 if unicodedata.east_asian_width(char) in "WF" else 1
        if used > width - 1:
            return text[:index]
    return text


class Thinner:
    """Not a terminal: which progress updates to print, at most one per rank and stream every `interval`."""

    def __init__(self, interval: float):
        self.interval = interval
        self._printed_at: dict[Key, float] = {}
        self._unprinted: dict[Key, bytes] = {}

    def update(self, key: Key, text: bytes, now: float) -> bytes | None:
        """The text to print now, or None."""
        if not text.strip():  # the bar cleared itself: its last state, if not printed yet
            return self._unprinted.pop(key, None)
        last = self._printed_at.get(key)
        if last is not None and now - last < self.interval:
            self._unprinted[key] = text
            return None
        self._printed_at[key] = now
        self._unprinted.pop(key, None)
        return text

    def end(self, key: Key) -> None:
        """An ordinary line ended the bar: it is the final state, the unprinted one is stale."""
        self._unprinted.pop(key, None)


# ---------------------------------------------------------------------------------------------
# the console

class Console:
    """crew's stdout (the ranks' stdout) and stderr (the ranks' stderr and crew's own messages)."""

    def __init__(self, out: BinaryIO, err: BinaryIO, tty: bool | None = None, level: str = "info"):
        self.out, self.err = out, err
        self.level = level  # --log_level: above info, `info` lines are not said
        self.tty = is_terminal(out) if tty is None else tty
        self.window = env_seconds(MERGE_WINDOW_ENV, MERGE_WINDOW_S)
        self.interval = env_seconds(PROGRESS_INTERVAL_ENV, PROGRESS_INTERVAL_S)
        self._cond = threading.Condition(threading.RLock())
        self._merger = Merger(self.window, 1)
        self._board, self._thinner = Board(), Thinner(self.interval)
        self._drawn = 0  # rows of the progress area on the screen now
        self._dirty = False
        self._drawn_at = 0.0
        self._wake_at: float | None = None  # when the ticker wakes next (None: when told)
        self._ticker: threading.Thread | None = None
        self._closing = False

    # ---- the job's life

    def begin(self, world_size: int) -> None:
        """A job of `world_size` ranks starts: hold lines for merging when there is more than one."""
        with self._cond:
            self._merger = Merger(self.window, world_size)
            self._closing = False
            if self._ticker is None and (self.tty or world_size > 1):
                self._ticker = threading.Thread(target=self._tick, name="crew-console", daemon=True)
                self._ticker.start()

    def end(self) -> None:
        """The job is over: print what is held and leave the terminal clean (no progress area)."""
        with self._cond:
            self._flush(time.monotonic(), everything=True)
            self._board = Board()
            self._put(self.out, self._erase())
            self._closing = True
            self._cond.notify()
            ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.join(timeout=2.0)

    # ---- what comes in

    def say(self, text: str) -> None:
        """crew's own message, at once (after the rank lines held so far), one `crew: ` line per line."""
        data = "".join(f"crew: {line}\n" for line in text.splitlines()).encode()
        with self._cond:
            self._flush(time.monotonic(), everything=True)
            self._show([(2, data)])

    def info(self, text: str) -> None:
        """An informational line (the layout, start-up times, a passed preflight): said as `say` does, unless
        --log_level is warning or above. Warnings, failures and reports go through `say` at every level."""
        if self.level in ("debug", "info"):
            self.say(text)

    def agent_line(self, fd: int, line: bytes) -> None:
        """One line of an agent's stdout (fd 1) or stderr (fd 2), events excepted."""
        line = line[:-1] if line.endswith(b"\n") else line
        progress = line.startswith(PROGRESS_MARK)
        if progress:
            line = line[len(PROGRESS_MARK):]
        match = _PREFIX.match(line)
        with self._cond:
            if match is None:  # not a rank's line: ssh's or pdsh's own words, as they came
                self._show([(fd, line + b"\n")])
                return
            rank, prefix, text, now = int(match.group(2)), line[:match.end()], line[match.end():], time.monotonic()
            if progress:
                self._progress((rank, fd), prefix, text, now)
            else:
                self._end_bar((rank, fd))
                self._hold(fd, rank, prefix, text, now)
            self._flush(now)

    def _progress(self, key: Key, prefix: bytes, text: bytes, now: float) -> None:
        if self.tty:
            self._board.update(key, prefix.decode(errors="replace"), text.decode(errors="replace"))
            self._mark_dirty(now)
            return
        shown = self._thinner.update(key, text, now)
        if shown is not None:  # behind the lines held before it
            self._hold(key[1], key[0], prefix, shown, now, alone=True)

    def _end_bar(self, key: Key) -> None:
        if not self.tty:
            self._thinner.end(key)
        elif self._board.end(key):
            self._mark_dirty(time.monotonic())

    def _hold(self, fd: int, rank: int, prefix: bytes, text: bytes, now: float, alone: bool = False) -> None:
        self._merger.add(fd, rank, prefix, text, now, alone)
        if self._wake_at is None:  # the ticker sleeps until told
            self._cond.notify()

    def _mark_dirty(self, now: float) -> None:
        if not self._dirty:
            self._dirty = True
            if self._wake_at is None or self._wake_at > self._drawn_at + REDRAW_S:
                self._cond.notify()

    # ---- what goes out

    def _flush(self, now: float, everything: bool = False) -> None:
        lines = self._merger.pop_ready(now, everything)
        if lines:
            self._show(lines)

    def _show(self, lines: list[tuple[int, bytes]]) -> None:
        """Print (fd, data) in order, above the progress area: erase it, print, draw it again."""
        if self.tty:  # erasing and drawing join the stdout writes around them: no flicker
            lines = [(1, self._erase()), *lines]
            lines.append((1, self._draw()))
        streams = {1: self.out, 2: self.err}
        for fd, run in itertools.groupby(lines, key=lambda line: line[0]):
            self._put(streams[fd], b"".join(data for _, data in run))

    def _redraw(self) -> None:
        self._put(self.out, self._erase() + self._draw())

    def _erase(self) -> bytes:
        """Back to the first row of the progress area, and clear from there to the end of the screen."""
        if not self._drawn:
            return b""
        up = f"\x1b[{self._drawn - 1}A" if self._drawn > 1 else ""
        self._drawn = 0
        return f"\r{up}\x1b[J".encode()

    def _draw(self) -> bytes:
        """The progress area, its cursor left at the end of its last row."""
        size = shutil.get_terminal_size()
        lines = self._board.lines(size.columns, size.lines)
        self._drawn, self._dirty, self._drawn_at = len(lines), False, time.monotonic()
        return "\n".join(lines).encode()

    def _put(self, stream: BinaryIO, data: bytes) -> None:
        if not data:
            return
        try:
            stream.write(data)
            stream.flush()
        except (OSError, ValueError):
            pass  # our own terminal or pipe is gone; keep tearing down regardless

    def _tick(self) -> None:
        """Print held lines when their window ends, and redraw the progress area when it changed."""
        with self._cond:
            while not self._closing:
                now = time.monotonic()
                self._flush(now)
                if self._dirty and now >= self._drawn_at + REDRAW_S:
                    self._redraw()
                self._wake_at = self._next_wake()
                self._cond.wait(None if self._wake_at is None else max(0.005, self._wake_at - now))
                self._wake_at = None

    def _next_wake(self) -> float | None:
        times = [due] if (due := self._merger.next_due()) is not None else []
        if self._dirty:
            times.append(self._drawn_at + REDRAW_S)
        return min(times) if times else None
