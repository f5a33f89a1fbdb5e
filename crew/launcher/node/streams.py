"""One rank's output stream, cut into whole lines and progress-bar updates (the agent's side).

A progress bar (tqdm, keras, the engine's step line under CREW_CONSOLE=tty) redraws itself
by writing a carriage return: tqdm writes `\\r<state>` and leaves the newest state unterminated until its
next write, others write `<state>\\r`. Text ended by a bare `\\r` is an update; a line ended by `\\n`
(or `\\r\\n`) is an ordinary line, also when it follows updates: it is what a terminal would leave on the
screen, the bar's final state (tqdm's close writes `\\r<final>\\n`). A bar's newest state left without
a terminator is sent as an update after a short idle (`StreamSplitter.idle`), so that the display is not
one update behind; a stream that ends in a bar ends with its last state as an ordinary line.

Every byte is accounted for: each call returns the bytes it consumed, exactly as the rank wrote them,
for the rank's log file.
"""

from __future__ import annotations

import re

LINE = "line"
PROGRESS = "progress"
IDLE_FLUSH_S = 0.2  # a bar's unterminated newest state is shown after this long without output
MAX_LINE = 1 << 20  # longer text without a line end is passed on as a line
_LINE_END = re.compile(rb"\r\n|\n|\r")

Item = tuple[str, bytes]  # (LINE or PROGRESS, text without its line end)


def segments(buffer: bytes, final: bool = False) -> tuple[list[tuple[bytes, bytes]], int]:
    """The (text, line end) pieces of `buffer`, and how many bytes they consumed.

    A trailing \\r is kept back, as the start of a \\r\\n that may be split across reads, unless `final`
    (the stream has ended: then the unterminated rest is a piece too, with the end b"").
    """
    pieces, start = [], 0
    end = len(buffer) - 1 if buffer.endswith(b"\r") and not final else len(buffer)
    for match in _LINE_END.finditer(buffer, 0, end):
        pieces.append((buffer[start:match.start()], match.group()))
        start = match.end()
    if final and start < len(buffer):
        pieces.append((buffer[start:], b""))
        start = len(buffer)
    return pieces, start


class StreamSplitter:
    """Turns the chunks read from one rank stream into LINE and PROGRESS items."""

    def __init__(self) -> None:
        self.pending = b""
        self._in_bar = False  # the last line end was a bare \r: the pending text is a bar's state
        self._bar = b""  # the bar's newest state, until an ordinary line ends the bar
        self._shown = b""  # pending text already sent as an update by idle(); not sent again

    def feed(self, chunk: bytes) -> tuple[list[Item], bytes]:
        """The items completed by `chunk`, and the bytes they consumed (for the log)."""
        buffer = self.pending + chunk
        pieces, used = segments(buffer)
        if len(buffer) - used > MAX_LINE:
            pieces, used = [*pieces, (buffer[used:], b"")], len(buffer)
        self.pending = buffer[used:]
        return self._items(pieces), buffer[:used]

    def wants_idle(self) -> bool:
        """Whether the pending text is a bar's newest state not yet shown (then call idle() after a pause)."""
        text = self._pending_text()
        return bool(text) and text != self._shown and (self._in_bar or self.pending.endswith(b"\r"))

    def idle(self) -> list[Item]:
        """The pending bar state as an update; it stays pending (and unlogged) until its line end comes."""
        if not self.wants_idle():
            return []
        self._shown = self._bar = self._pending_text()
        return [(PROGRESS, self._shown)]

    def close(self) -> tuple[list[Item], bytes]:
        """At the stream's end: the rest, and a bar left open ends with its last state as a line."""
        pieces, _ = segments(self.pending, final=True)
        rest, self.pending = self.pending, b""
        items = self._items(pieces)
        if self._in_bar and self._bar.strip():  # not after a bar cleared itself (tqdm leave=False)
            items.append((LINE, self._bar))
        self._in_bar, self._bar = False, b""
        return items, rest

    def _pending_text(self) -> bytes:
        return self.pending[:-1] if self.pending.endswith(b"\r") else self.pending

    def _items(self, pieces: list[tuple[bytes, bytes]]) -> list[Item]:
        items: list[Item] = []
        for text, end in pieces:
            if end == b"\r":
                if text and text != self._shown:  # a \r with nothing before it is no update
                    items.append((PROGRESS, text))
                if text:
                    self._bar = text
                self._in_bar = True
            else:
                items.append((LINE, text))
                self._in_bar, self._bar = False, b""
            self._shown = b""
        return items
