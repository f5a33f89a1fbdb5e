"""Reading the job layout Slurm hands a job step: compressed node lists and per-node counts.

Slurm writes lists in a compressed form (SLURM_JOB_NODELIST=gpu[01-04,07],cpu7;
SLURM_TASKS_PER_NODE=2(x3),1). crew expands them itself instead of calling `scontrol show hostnames`,
which needs slurm.conf and a Slurm install on the node. The expansion follows Slurm 22.05's hostlist.c
(checked against `scontrol` in the tests), order included: one name may hold several bracket groups
(a[1-2]-b[3-4]), and nothing may follow the last group. Where scontrol guesses at a malformed value
(unbalanced brackets, `+1` or spaces in a range) this module refuses it: a job step's variables
never hold those, so one that does is corrupt and the launch should stop and say so.

The rest is what `--launcher slurm` reads from an allocation's variables: its nodes and their slots
(`allocation_hosts`), whether crew itself runs inside a job step (`step_tasks`), and the srun options
that give each node's agent the whole node (`srun_options`). On the node, each agent finds its node of
the job by name (`protocol.slurm_node`).

Standard library only: the launcher must not import torch to plan a job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from crew.errors import LaunchError, PlanError
from crew.launcher.plan.hostfile import Host, is_number

MAX_RANGE = 64 * 1024  # Slurm's own limit on one range ("Too many hosts in range")
_RANGE = re.compile(r"(\d+)(?:-(\d*))?")
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_nodelist(text: str, name: str = "node list") -> list[str]:
    """Every host of a Slurm host list, in Slurm's order, duplicates kept, as `scontrol show hostnames`.

    `name` is the variable the text came from (SLURM_JOB_NODELIST, ...), for the error message."""
    hosts = []
    for token in _tokens(text, name):
        hosts += _expand_name(token, text, name)
    if not hosts:
        raise LaunchError(f"{name}={text!r} names no host")
    return hosts


def _tokens(text: str, name: str) -> list[str]:
    """Split at commas and white space outside brackets; empty pieces are skipped, as Slurm does."""
    tokens, current, depth = [], "", 0
    for char in text:
        if char in "[]":
            depth += 1 if char == "[" else -1
            if depth not in (0, 1):
                what = "nested brackets" if depth > 1 else "a ']' without its '['"
                raise LaunchError(f"{name}={text!r}: {what}")
        if depth == 0 and (char == "," or char.isspace()):
            tokens.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise LaunchError(f"{name}={text!r}: a '[' is never closed")
    return [token for token in tokens + [current] if token]


def _expand_name(token: str, text: str, name: str) -> list[str]:
    """One name: `host7`, `gpu[01-04,07]` or `a[1-2]-b[3-4]`; the last bracket group must end it."""
    if "[" not in token:
        return [token]
    if not token.endswith("]"):
        raise LaunchError(f"{name}={text!r}: {token!r} has text after its last ']' (Slurm allows none)")
    start = token.rindex("[")
    return _with_prefix(token[:start], _numbers(token[start + 1:-1], text, name), text, name)


def _with_prefix(prefix: str, suffixes: list[str], text: str, name: str) -> list[str]:
    """Put each bracket group left of the last one in front of `suffixes`, in hostlist.c's order: it
    takes the groups from right to left, each one's loop outside the next, the last group innermost
    (n[1-2]-[01-02]-x[7] gives n1-01-x7 n2-01-x7 n1-02-x7 n2-02-x7)."""
    start = prefix.rfind("[")
    if start < 0:
        return [prefix + suffix for suffix in suffixes]
    end = prefix.index("]", start)
    head, middle = prefix[:start], prefix[end + 1:]
    return [host for number in _numbers(prefix[start + 1:end], text, name)
            for host in _with_prefix(head + number + middle, suffixes, text, name)]


def _numbers(group: str, text: str, name: str) -> list[str]:
    """`01-04,07` -> 01 02 03 04 07: each range padded to the width of its first number, as Slurm does."""
    numbers = []
    for part in group.split(","):
        match = _RANGE.fullmatch(part)
        if not match:
            raise LaunchError(f"{name}={text!r}: {part!r} in [{group}] is not a number or a range lo-hi")
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if lo > hi:
            raise LaunchError(f"{name}={text!r}: range {part!r} goes down (write {hi}-{lo})")
        if hi - lo + 1 > MAX_RANGE:
            raise LaunchError(f"{name}={text!r}: range {part!r} has more than {MAX_RANGE} hosts")
        width = len(match.group(1))
        numbers += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return numbers


def expand_tasks_per_node(text: str, name: str = "tasks per node") -> list[int]:
    """One count per node from Slurm's `2(x3),1` form (SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE):
    `N(xK)` is N on each of K nodes in a row."""
    counts = []
    for part in text.strip().split(","):
        match = _COUNT.fullmatch(part)
        if not match:
            raise LaunchError(f"{name}={text!r}: {part!r} is not a count N or N(xK)")
        repeat = int(match.group(2) or 1)
        if repeat == 0:
            raise LaunchError(f"{name}={text!r}: {part!r} repeats a count zero times")
        counts += [int(match.group(1))] * repeat
    return counts


# -- the allocation, as crew run sees it -----------------------------------------------------------------

# srun forwards its tasks' output in messages of at most 1 KiB, interleaving the tasks' longer lines: the
# agents send longer lines in pieces of this size (protocol.split_long_lines), which crew reassembles.
LINE_MAX = 960
_SPECIAL_STEPS = 0xFFFFFFF0  # step ids from here up are Slurm's batch, extern and interactive steps


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


def step_tasks(environ: Mapping[str, str]) -> int | None:
    """How many tasks the job step that crew runs in has; None outside a step (salloc's shell, a batch
    script, which set SLURM_JOB_ID but no numbered SLURM_STEP_ID)."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
    if not is_number(step) or int(step) >= _SPECIAL_STEPS:
        return None
    return _count(environ, "SLURM_STEP_NUM_TASKS") or 1


def check_step(environ: Mapping[str, str]) -> None:
    """Refuse to start a job from each task of a multi-task step: that would be N jobs, not one."""
    tasks = step_tasks(environ)
    if tasks and tasks > 1:
        step = f"{environ.get('SLURM_JOB_ID')}.{environ.get('SLURM_STEP_ID', environ.get('SLURM_STEPID'))}"
        raise PlanError(
            f"crew is running as one of {tasks} tasks of Slurm job step {step} (SLURM_STEP_NUM_TASKS="
            f"{tasks}), so each task would start the whole job. crew starts srun itself: run `crew run "
            "...` once, in the salloc shell or the sbatch script, without srun in front of it.")


def allocation_hosts(environ: Mapping[str, str], num_gpus: int | None = None) -> list[Host]:
    """The allocation's nodes, in SLURM_JOB_NODELIST's order, with their slots: --num_gpus when given,
    else the GPUs each node has for the job, else its task count, else 1."""
    names = _job_nodes(environ)
    gpus = _gpus_per_node(environ, len(names))
    if num_gpus is not None:
        if num_gpus < 1:
            raise PlanError(f"--num_gpus {num_gpus}: must be at least 1.")
        if gpus and num_gpus > min(gpus[0]):
            raise PlanError(f"--num_gpus {num_gpus}: the allocation has {min(gpus[0])} GPU(s) per node "
                            f"({gpus[1]}). Ask for at most that many, or allocate more GPUs per node.")
        counts = [num_gpus] * len(names)
    else:
        counts = gpus[0] if gpus else _tasks_per_node(environ, len(names))
    return [Host(host, tuple(range(count))) for host, count in zip(names, counts, strict=True)]


def _job_nodes(environ: Mapping[str, str]) -> list[str]:
    name = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    return expand_nodelist(environ.get(name, ""), name)


def _gpus_per_node(environ: Mapping[str, str], nodes: int) -> tuple[list[int], str] | None:
    """Each node's GPU count and the variable it came from, or None when the allocation names no GPUs
    (salloc's shell says nothing of --gres=gpu:N; a batch script's SLURM_GPUS_ON_NODE does)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if count := _gpu_count(environ, name):
            return [count] * nodes, f"{name}={environ[name]}"
    if per_task := _gpu_count(environ, "SLURM_GPUS_PER_TASK"):
        tasks = _tasks_per_node(environ, nodes)
        return [per_task * t for t in tasks], f"SLURM_GPUS_PER_TASK={environ['SLURM_GPUS_PER_TASK']}"
    return None


def _gpu_count(environ: Mapping[str, str], name: str) -> int:
    """`2`, `a100:2` or `a100:2,v100:1` (Slurm's [type:]count list) -> the count; 0 when unset."""
    text = environ.get(name, "").strip()
    if not text:
        return 0
    counts = [part.rpartition(":")[2] for part in text.split(",")]
    if not all(is_number(count) for count in counts):
        raise LaunchError(f"{name}={text!r}: expected a GPU count such as 8 or a100:8. Fix or unset "
                          f"{name}, or pass --num_gpus N.")
    return sum(map(int, counts))


def _count(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not is_number(text) or int(text) < 1:
        raise LaunchError(f"{name}={text!r}: expected a whole number >= 1. Fix or unset {name}.")
    return int(text)


def _tasks_per_node(environ: Mapping[str, str], nodes: int) -> list[int]:
    if count := _count(environ, "SLURM_NTASKS_PER_NODE"):
        return [count] * nodes
    text = environ.get("SLURM_TASKS_PER_NODE", "").strip()
    if not text:
        return [1] * nodes
    counts = expand_tasks_per_node(text, "SLURM_TASKS_PER_NODE")
    if len(counts) != nodes or 0 in counts:
        raise LaunchError(f"SLURM_TASKS_PER_NODE={text!r} gives {len(counts)} count(s) for {nodes} node(s) "
                          "in SLURM_JOB_NODELIST. Fix or unset it, or pass --num_gpus N.")
    return counts


def srun_options(environ: Mapping[str, str]) -> list[str]:
    """What the agents' srun needs beyond the usual: `--overlap` inside a job step (else the new step
    waits for the resources the current one holds), and the node's GPUs for the one agent per node when
    the allocation gave GPUs per task (a step gets one task's GPUs per task, even with --whole)."""
    options = ["--overlap"] if step_tasks(environ) else []
    if environ.get("SLURM_GPUS_PER_TASK"):
        gpus = _gpus_per_node(environ, len(_job_nodes(environ)))
        options += [f"--gres=gpu:{max(gpus[0])}"] if gpus else []
    return options
