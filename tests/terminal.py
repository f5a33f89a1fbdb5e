"""Run a command on a pseudo-terminal, and replay what it wrote there as a screen.

`run_in_terminal` gives the command a real terminal for stdout and stderr (os.openpty, a set window size)
and returns every byte it wrote. `replay` applies those bytes the way a terminal would (carriage return,
line feed, cursor up, erase to the end of the line or screen) and returns the screen's lines, scrollback
included, and the column the cursor ended in.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time

_TOKEN = re.compile(r"\x1b\[(\d*)([A-Za-z])|\r|\n|[^\x1b\r\n]+")


def run_in_terminal(argv: list[str], cwd, env: dict, rows: int = 40, columns: int = 160,
                    timeout: float = 60.0) -> tuple[int, bytes]:
    """(exit code, bytes written to the terminal) of `argv` with stdout and stderr on a new terminal."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, env={**env, "TERM": "xterm"}, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                raise AssertionError(f"{argv} did not finish within {timeout}s")
            if not select.select([master], [], [], left)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=10), b"".join(chunks)


def replay(data: bytes) -> tuple[list[str], int]:
    """The screen (every line written, top to bottom) and the cursor's final column."""
    lines, row, col = [""], 0, 0
    for match in _TOKEN.finditer(data.decode(errors="replace")):
        token = match.group()
        if match.group(2):
            count = int(match.group(1) or 1)
            if match.group(2) == "A":
                row = max(0, row - count)
            elif match.group(2) == "J":
                lines[row] = lines[row][:col]
                del lines[row + 1:]
            elif match.group(2) == "K":
                lines[row] = lines[row][:col]
            else:
                raise AssertionError(f"unexpected escape sequence {token!r}")
        elif token == "\r":
            col = 0
        elif token == "\n":
            row += 1
            if row == len(lines):
                lines.append("")
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    return lines, col
