"""Errors crew raises for bad input or a failed launch.

Every message says what is wrong, where (file:line, flag, config key) and how to fix it; the command
line prints it without a traceback.
"""

import sys
import traceback

# A job stopped for a preemption notice after its ranks saved a checkpoint: run it again to continue
# (sysexits' EX_TEMPFAIL, "try again later"). `crew run` does not count it as a failure to restart on.
PREEMPTED_EXIT_CODE = 75
STOPPED_EXIT_CODE = 143  # 128 + SIGTERM: stopped before anything was saved, nothing to resume
# The line a preempted rank 0 writes to stderr last, followed by the checkpoint's folder: the node agent reads
# the folder from it for `crew run`'s closing line.
PREEMPTED_MARK = "crew: preempted (exit code 75); checkpoint saved in "


class CrewError(Exception):
    """A problem the user can fix; the message says what, where and how."""


class HostfileError(CrewError):
    """A hostfile line crew cannot use."""


class PlanError(CrewError):
    """Launch options that select no valid world (--include, --num_nodes, --master_addr, ...)."""


class LaunchError(CrewError):
    """A runner cannot start the job (pdsh missing, ssh refused, working directory absent, ...)."""


class ConfigError(CrewError, ValueError):
    """A DeepSpeed config that crew cannot use; names the key(s) and values that would work."""


def install_excepthook() -> None:
    """An uncaught CrewError prints as one message plus where the user's code called crew,
    not as a traceback through crew's insides. Every other exception keeps the usual hook."""
    previous = sys.excepthook
    if getattr(previous, "crew", False):
        return

    def hook(kind, error, tb):
        if not isinstance(error, CrewError):
            return previous(kind, error, tb)
        frames = []  # the caller's frames, up to the first call into crew
        for frame in traceback.extract_tb(tb):
            if "/crew/" in frame.filename:
                break
            frames.append(frame)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        print(f"crew: error{where}: {error}", file=sys.stderr)

    hook.crew = True
    sys.excepthook = hook
