"""--bind_cores_to_rank and --bind_core_list: each local rank gets a block of cores of its own.

The arithmetic is DeepSpeed's (deepspeed/utils/numa.py, get_numactl_cmd): the node's cores divided into
contiguous blocks of `cores // ranks`, one per local rank, and OMP_NUM_THREADS set to the block's size.
crew does it without numactl: the rank's CPU affinity is set in its preexec (sched_setaffinity), and its
memory is bound (set_mempolicy, MPOL_BIND, as `numactl -m`) to the NUMA node(s) holding its whole block
when the machine has several. The cores are this process's own (its affinity: a container's cpuset), one
logical CPU per physical core as DeepSpeed counts them, taken NUMA node by NUMA node so that a block
straddles two nodes only when the ranks cannot fit otherwise. --bind_core_list names the cores to divide
instead, hyperthreads included if listed.

The /sys reading takes the root as a parameter so tests can give it a fake tree; everything but
`preexec` is a pure function of its arguments and that tree.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from crew.errors import CrewError
from crew.launcher.transport.proc import die_with_parent
from crew.launcher.transport.protocol import JobSpec

SYS_ROOT = "/sys"
BIND_FLAG = "--bind_cores_to_rank"
LIST_FLAG = "--bind_core_list"
MPOL_BIND = 2
# set_mempolicy's number per architecture (Linux's syscall tables); elsewhere memory is left unbound.
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "riscv64": 237, "loongarch64": 237, "ppc64le": 261,
                  "ppc64": 261, "s390x": 270, "i686": 276, "i386": 276}


@dataclass(frozen=True)
class Binding:
    """One local rank's share: its CPUs, and the NUMA nodes its memory is bound to (none: not bound)."""

    cpus: tuple[int, ...]
    mem_nodes: tuple[int, ...] = ()


# -------------------------------------------------------------------------------------------------
# parsing

def parse_range_list(text: str, flag: str = LIST_FLAG) -> list[int]:
    """DeepSpeed's parse_range_list: '1,3-5,7' -> [1, 3, 4, 5, 7]. Items are a number or two joined by a
    dash (both included), in ascending order, not overlapping, no spaces; an error names the flag."""
    numbers: list[int] = []
    for item in text.split(","):
        first, dash, last = item.partition("-")
        if not _is_digits(first) or (dash and not _is_digits(last)):
            raise CrewError(f"{flag} {text}: bad range '{item}': each item must be a core number or two "
                            "joined by a dash, e.g. 1,3-5,7 (no spaces).")
        low, high = int(first), int(last) if dash else int(first)
        if low > high:
            raise CrewError(f"{flag} {text}: bad range '{item}': the end must be at least the start "
                            f"(write {high}-{low}).")
        if numbers and low <= numbers[-1]:
            raise CrewError(f"{flag} {text}: the ranges must be in ascending order and must not overlap "
                            f"('{item}' comes after core {numbers[-1]}).")
        numbers.extend(range(low, high + 1))
    return numbers


def _is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's cpulist format ('0-3,8-11', or empty); ValueError if it is not one."""
    cpus: list[int] = []
    for item in filter(None, text.strip().split(",")):
        first, _, last = item.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def format_cpus(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    spans = []
    for _, run in itertools.groupby(enumerate(sorted(cpus)), key=lambda pair: pair[1] - pair[0]):
        values = [cpu for _, cpu in run]
        spans.append(str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}")
    return ",".join(spans)


# -------------------------------------------------------------------------------------------------
# the machine, from /sys

def numa_nodes(sys_root: str | Path = SYS_ROOT) -> dict[int, frozenset[int]]:
    """NUMA node -> its CPUs (node*/cpulist); memory-only nodes have none. Empty when /sys says nothing."""
    nodes = {}
    for path in Path(sys_root, "devices/system/node").glob("node*/cpulist"):
        number = path.parent.name[4:]
        try:
            if _is_digits(number):
                nodes[int(number)] = frozenset(parse_cpu_list(path.read_text()))
        except (OSError, ValueError):
            continue
    return dict(sorted(nodes.items()))


def physical_cores(cpus: Iterable[int], sys_root: str | Path = SYS_ROOT) -> list[int]:
    """One CPU per physical core (the lowest of its hyperthreads in `cpus`), as DeepSpeed counts cores
    (psutil's physical count); all of `cpus` when the topology cannot be read."""
    first_of_core: dict[frozenset[int], int] = {}
    for cpu in sorted(cpus):
        path = Path(sys_root, f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            siblings = frozenset(parse_cpu_list(path.read_text()))
        except (OSError, ValueError):
            return sorted(cpus)
        first_of_core.setdefault(siblings or frozenset([cpu]), cpu)
    return sorted(first_of_core.values())


# -------------------------------------------------------------------------------------------------
# the arithmetic

def divide(cores: list[int], ranks: int, numa: Mapping[int, frozenset[int]]) -> list[tuple[int, ...]]:
    """`ranks` blocks of len(cores) // ranks cores each, as DeepSpeed's contiguous blocks, but filled
    NUMA node by NUMA node: the blocks that fit whole in a node first, then the nodes' leftovers."""
    per_rank = len(cores) // ranks
    node_of = {cpu: node for node, cpus in numa.items() for cpu in cpus}
    ordered = sorted(cores, key=lambda cpu: node_of.get(cpu, -1))  # stable: the given order within a node
    blocks, leftovers = [], []
    for _, group in itertools.groupby(ordered, key=lambda cpu: node_of.get(cpu, -1)):
        group = list(group)
        whole = len(group) // per_rank * per_rank
        blocks += [tuple(group[i:i + per_rank]) for i in range(0, whole, per_rank)]
        leftovers += group[whole:]
    blocks += [tuple(leftovers[i:i + per_rank]) for i in range(0, len(leftovers) // per_rank * per_rank, per_rank)]
    return blocks[:ranks]


def memory_nodes(block: Iterable[int], numa: Mapping[int, frozenset[int]]) -> tuple[int, ...]:
    """The NUMA nodes holding the whole block (two or more only with fake NUMA, nodes that share CPUs);
    none when the machine has one node or the block straddles, as DeepSpeed gives numactl no -m then.
    Nor with memory-only nodes (HBM, CXL): DeepSpeed prefers those (-p), which MPOL_BIND cannot say."""
    if len(numa) < 2 or not all(numa.values()):
        return ()
    cpus = set(block)
    holding = tuple(node for node, node_cpus in numa.items() if cpus <= node_cpus)
    return holding if len(holding) < len(numa) else ()


def plan_bindings(ranks: int, allowed: Iterable[int], core_list: str | None,
                  sys_root: str | Path = SYS_ROOT) -> list[Binding]:
    """Each local rank's Binding; CrewError naming the flag when the cores cannot be divided (the
    launcher puts the node's name before it)."""
    allowed = set(allowed)
    if core_list:
        cores = parse_range_list(core_list)
        missing = [cpu for cpu in cores if cpu not in allowed]
        if missing:
            raise CrewError(f"{LIST_FLAG} {core_list}: core(s) {format_cpus(missing)} are not available here: "
                            f"crew's agent may run on CPUs {format_cpus(allowed)} only (its CPU affinity, e.g. "
                            "a container's cpuset). Pick cores from those.")
        what, fix = f"{LIST_FLAG} {core_list}: {len(cores)} core(s)", "list more cores"
    else:
        cores = physical_cores(allowed, sys_root)
        what = (f"{BIND_FLAG}: {len(cores)} core(s) here (one per physical core of CPUs "
                f"{format_cpus(allowed)}, crew's CPU affinity)")
        fix = f"leave out {BIND_FLAG}"
    if len(cores) < ranks:
        raise CrewError(f"{what} for this node's {ranks} ranks; each rank needs at least one. Run at most "
                        f"{len(cores)} rank(s) here (--num_gpus, --include), or {fix}.")
    numa = numa_nodes(sys_root)
    return [Binding(block, memory_nodes(block, numa)) for block in divide(cores, ranks, numa)]


# -------------------------------------------------------------------------------------------------
# the agent's side

def for_node(job: JobSpec, node_rank: int, sys_root: str | Path = SYS_ROOT,
             allowed: Iterable[int] | None = None) -> list[Binding] | str:
    """The bindings of this node's ranks (none unless the job asks: JobSpec.bind_cores), or why they
    cannot be made."""
    if not job.bind_cores:
        return []
    node = job.nodes[node_rank]
    try:
        bindings = plan_bindings(len(node.ranks), os.sched_getaffinity(0) if allowed is None else allowed,
                                 job.bind_core_list, sys_root)
    except CrewError as exc:
        return str(exc)
    if platform.machine() not in _SET_MEMPOLICY:
        bindings = [Binding(b.cpus) for b in bindings]
    return bindings


def rank_threads(env: dict[str, str], job_env: Mapping[str, str], bound: Binding | None) -> dict[str, str]:
    """OMP_NUM_THREADS = the rank's core count, as DeepSpeed sets it, unless the user set it (--env,
    .deepspeed_env)."""
    if bound is not None and "OMP_NUM_THREADS" not in job_env:
        env["OMP_NUM_THREADS"] = str(len(bound.cpus))
    return env


def preexec(bound: Binding | None) -> Callable[[], None]:
    """The rank's preexec_fn: die with the agent, and take its binding. libc is loaded here, in the
    agent, so that the forked child calls into it without loading anything."""
    if bound is None:
        return die_with_parent
    libc = ctypes.CDLL(None, use_errno=True) if bound.mem_nodes else None
    words = max(bound.mem_nodes, default=0) // 64 + 1
    mask = (ctypes.c_ulong * words)(*[sum(1 << (n % 64) for n in bound.mem_nodes if n // 64 == w)
                                      for w in range(words)])

    def start() -> None:
        die_with_parent()
        try:
            os.sched_setaffinity(0, bound.cpus)
        except OSError as exc:
            _warn(f"CPUs {format_cpus(bound.cpus)} not bound ({exc.strerror}); the rank runs unbound")
        # maxnode + 1: the kernel reads maxnode - 1 bits (numactl passes the same).
        if libc is not None and libc.syscall(_SET_MEMPOLICY[platform.machine()], MPOL_BIND, mask,
                                             words * 64 + 1) != 0:
            _warn(f"memory not bound to NUMA node {format_cpus(bound.mem_nodes)} "
                  f"({os.strerror(ctypes.get_errno())}; containers need CAP_SYS_NICE); its CPUs are bound")
    return start


def _warn(text: str) -> None:
    """A line on the rank's stderr (already its pipe in preexec): the agent streams it as the rank's."""
    os.write(2, f"crew: {BIND_FLAG}: {text}\n".encode())


def event_fields(bindings: list[Binding]) -> dict:
    """What the agent's `started` event says of them: each rank's CPUs and memory nodes."""
    if not bindings:
        return {}
    return {"binding": [[format_cpus(b.cpus), format_cpus(b.mem_nodes)] for b in bindings]}


# -------------------------------------------------------------------------------------------------
# the launcher's side

def startup_lines(started: Mapping[int, dict], verbose: bool = False, limit: int = 200) -> list[str]:
    """crew's line on the bindings the nodes reported (`started` events): every node while it fits in
    `limit` characters, then a count; --verbose: one line per node."""
    items = []
    for node, event in sorted(started.items()):
        if event.get("binding"):
            cpus = "|".join(cpus for cpus, _ in event["binding"])
            mems = "|".join(mem or "-" for _, mem in event["binding"])
            items.append((node, f"{event['host']} {cpus}" + (f" (memory: NUMA {mems})" if mems.strip("|-") else "")))
    if not items:
        return []
    head = f"cores per rank ({BIND_FLAG}): "
    if verbose:
        return [head.rstrip(": ") + ":", *(f"  node {node}: {text}" for node, text in items)]
    line = head
    for count, (_, text) in enumerate(items):
        more = f" (+{len(items) - count} more; --verbose lists every node)"
        room = limit - (len(more) if count + 1 < len(items) else 0)
        if count and len(line) + 2 + len(text) > room:
            return [line + more]
        line += (", " if count else "") + text
    return [line[:limit]]
