"""Errors crew raises for bad input or a failed launch.

Every message says what is wrong, where (file:line, flag, config key) and how to fix it; the command
line prints it without a traceback.
"""


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
