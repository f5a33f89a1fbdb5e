"""--save_pid, as DeepSpeed's launch.py: each node's per-node process (crew's agent) prints `launcher pid: N`
and writes its pid to /tmp/<pid of the `crew run` the user started>.deepspeed while it runs."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

PID_DIR = "/tmp"  # DeepSpeed's PID_FILE_BASEPATH


def pid_path(launcher_pid: int, folder: str | Path = PID_DIR) -> Path:
    return Path(folder, f"{launcher_pid}.deepspeed")


@contextlib.contextmanager
def saved(launcher_pid: int, folder: str | Path = PID_DIR) -> Iterator[Path | None]:
    """While the block runs, `folder`/<launcher_pid>.deepspeed holds this process's pid (a stale file of
    that name is replaced); it is removed on the way out, however the block ends, unless another process
    has written its own pid there since. Nothing happens for launcher_pid 0 (--save_pid not given)."""
    if not launcher_pid:
        yield None
        return
    path, mine = pid_path(launcher_pid, folder), str(os.getpid())
    os.write(1, f"launcher pid: {mine}\n".encode())
    try:
        _write(path, mine)
    except OSError as exc:
        os.write(2, f"crew: --save_pid: cannot write {path} ({exc.strerror}); the job goes on without it.\n".encode())
        yield None
        return
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            if path.read_text() == mine:
                path.unlink()


def _write(path: Path, text: str) -> None:
    """A new file renamed over the name: a stale file goes, and a link planted at the name is not followed."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            os.fchmod(handle.fileno(), 0o644)  # mkstemp's 0600; DeepSpeed's open() leaves it readable
        os.replace(temp, path)
    except OSError:
        Path(temp).unlink(missing_ok=True)
        raise
