"""Run a launcher (`crew run`, `deepspeed`, `torchrun`) from a benchmark so that nothing outlives it.

The launcher starts in a session of its own; on a timeout or Ctrl-C its whole process group is stopped:
SIGTERM (both launchers then stop their ranks), and SIGKILL for whatever is left 30 s later. Plain
subprocess.run(timeout=...) would SIGKILL only the launcher and leave its ranks running.
"""

from __future__ import annotations

import os
import signal
import subprocess

GRACE_S = 30.0


def run_job(command: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout), with the group stopped on
    the way out of a timeout (TimeoutExpired is raised as before) or an interrupt."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        _stop_group(proc)
        raise
    _signal_group(proc.pid, signal.SIGKILL)  # a rank its launcher left behind
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _stop_group(proc: subprocess.Popen) -> None:
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.communicate()


def _signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone
