"""Hosts + launch options -> a Plan: which node runs which global ranks on which devices.

Pure functions, no I/O: the command line reads the hostfile, picks the master port and gathers the
environment, then hands plain values in here. Selection follows DeepSpeed's launcher
(`--include host1:0,2@host2`, `--exclude`, `--num_nodes`, `--num_gpus`), with errors where DeepSpeed
would silently do something else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from crew.errors import PlanError
from crew.launcher.plan.hostfile import Host, is_number

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class NodePlan:
    node_rank: int
    host: str
    ssh_port: int | None
    slots: tuple[int, ...]  # device ids used on this node
    ranks: tuple[int, ...]  # global ranks placed here, in order of slots

    def to_json(self) -> dict:
        return {"host": self.host, "ssh_port": self.ssh_port, "slots": list(self.slots),
                "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Plan:
    nodes: tuple[NodePlan, ...]
    master_addr: str
    master_port: int
    env: dict[str, str] = field(default_factory=dict)  # what every rank gets on top of its node's

    @property
    def world_size(self) -> int:
        return sum(len(node.ranks) for node in self.nodes)

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "master_addr": self.master_addr,
                "master_port": self.master_port, "nodes": [n.to_json() for n in self.nodes],
                "env": dict(self.env)}


def select_hosts(hosts: list[Host], include: str = "", exclude: str = "",
                 num_nodes: int | None = None, num_gpus: int | None = None,
                 source: str = "the hostfile") -> list[Host]:
    """Apply --include/--exclude, then --num_nodes and --num_gpus, keeping hostfile order. `source` is
    where the hosts came from, for the messages (a Slurm allocation's nodes work the same way)."""
    if include and exclude:
        raise PlanError("--include and --exclude cannot be used together; use one of them.")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise PlanError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude (as in DeepSpeed): "
            "name the hosts and devices in --include instead, e.g. --include worker-1:0,1@worker-2."
        )
    if include:
        hosts = _include(hosts, parse_filter(include, "--include", hosts, source))
    elif exclude:
        hosts = _exclude(hosts, parse_filter(exclude, "--exclude", hosts, source))
    if not hosts:
        raise PlanError(f"--exclude {exclude} leaves no slot to run on. Exclude fewer hosts or slots.")
    if num_nodes is not None:
        hosts = _first_nodes(hosts, num_nodes, source)
    if num_gpus is not None:
        hosts = [_first_devices(host, num_gpus) for host in hosts]
    return hosts


def parse_filter(spec: str, flag: str, hosts: list[Host],
                 source: str = "the hostfile") -> dict[str, tuple[int, ...] | None]:
    """'host1:0,2@host2' -> {'host1': (0, 2), 'host2': None}; None means every slot of that host."""
    known = {host.name: host for host in hosts}
    chosen: dict[str, tuple[int, ...] | None] = {}
    for part in spec.split("@"):
        name, colon, slot_text = _split_host_slots(part, known)
        if name not in known:
            raise PlanError(
                f"{flag} {spec}: host '{name}' is not in {source} (hosts: "
                f"{', '.join(known)}). Use the host names exactly as {source} writes them."
            )
        if not colon:
            chosen[name] = None
            continue
        slots = _parse_slot_list(slot_text, flag, spec)
        missing = [slot for slot in slots if slot not in known[name].slots]
        if missing:
            raise PlanError(
                f"{flag} {spec}: host '{name}' has no slot {missing[0]} (its slots are "
                f"{','.join(map(str, known[name].slots))})."
            )
        if name in chosen and chosen[name] is None:
            continue  # the whole host is already chosen
        chosen[name] = (*(chosen.get(name) or ()), *slots)
    return chosen


def _split_host_slots(part: str, known: dict[str, Host]) -> tuple[str, str, str]:
    """'host:0,1' -> ('host', ':', '0,1'); IPv6 hosts are named whole or as '[fe80::1]:0,1'."""
    if part in known:
        return part, "", ""
    if part.startswith("["):
        name, bracket, rest = part[1:].partition("]")
        if bracket:
            return name, ":" if rest.startswith(":") else "", rest[1:]
    return part.partition(":")


def _parse_slot_list(text: str, flag: str, spec: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not all(is_number(part) for part in parts):
        raise PlanError(
            f"{flag} {spec}: '{text}' must be device ids separated by commas, e.g. "
            f"{flag} worker-1:0,2@worker-2."
        )
    return tuple(int(part) for part in parts)


def _include(hosts: list[Host], chosen: dict[str, tuple[int, ...] | None]) -> list[Host]:
    kept = []
    for host in hosts:
        if host.name in chosen:
            wanted = chosen[host.name]
            slots = host.slots if wanted is None else tuple(s for s in host.slots if s in wanted)
            kept.append(replace(host, slots=slots))
    return kept


def _exclude(hosts: list[Host], chosen: dict[str, tuple[int, ...] | None]) -> list[Host]:
    kept = []
    for host in hosts:
        dropped = chosen.get(host.name, ())
        if dropped is None:
            continue
        slots = tuple(slot for slot in host.slots if slot not in dropped)
        if slots:
            kept.append(replace(host, slots=slots))
    return kept


def _first_nodes(hosts: list[Host], num_nodes: int, source: str = "the hostfile") -> list[Host]:
    if num_nodes < 1:
        raise PlanError(f"--num_nodes {num_nodes}: must be at least 1.")
    if num_nodes > len(hosts):
        raise PlanError(
            f"--num_nodes {num_nodes}: only {len(hosts)} host(s) available "
            f"({', '.join(h.name for h in hosts)}). Add hosts to {source} or ask for fewer nodes."
        )
    return hosts[:num_nodes]


def _first_devices(host: Host, num_gpus: int) -> Host:
    if num_gpus < 1:
        raise PlanError(f"--num_gpus {num_gpus}: must be at least 1.")
    if num_gpus > len(host.slots):
        raise PlanError(
            f"--num_gpus {num_gpus}: host '{host.name}' has only {len(host.slots)} slot(s). "
            f"Ask for at most {len(host.slots)}, or raise its slots in the hostfile."
        )
    return replace(host, slots=host.slots[:num_gpus])


def check_master_addr(addr: str) -> str:
    """Reject 'host:port': the port after the colon is almost always the ssh port by mistake."""
    name, colon, port = addr.rpartition(":")
    bracketed = name.startswith("[") and name.endswith("]")
    if colon and is_number(port) and (":" not in name or bracketed):
        name = name[1:-1] if bracketed else name
        raise PlanError(
            f"--master_addr {addr}: give the address alone, without ':{port}'. master_addr is where "
            f"rank 0 listens for the other ranks; its port is --master_port (default: a free port). "
            f"A ':{port}' in the hostfile is the ssh port, used only to reach the node. Use "
            f"--master_addr {name} --master_port <port>."
        )
    if not addr or addr.startswith("-") or any(c.isspace() for c in addr):
        raise PlanError(f"--master_addr '{addr}' is not a host name or address.")
    return addr


def build_plan(hosts: list[Host], master_addr: str, master_port: int,
               env: dict[str, str] | None = None) -> Plan:
    """Number the nodes and global ranks in hostfile order."""
    if not 1 <= master_port <= 65535:
        raise PlanError(f"--master_port {master_port}: must be a port number (1-65535).")
    nodes, next_rank = [], 0
    for node_rank, host in enumerate(hosts):
        ranks = tuple(range(next_rank, next_rank + len(host.slots)))
        nodes.append(NodePlan(node_rank, host.name, host.ssh_port, host.slots, ranks))
        next_rank += len(ranks)
    return Plan(tuple(nodes), check_master_addr(master_addr), master_port, dict(env or {}))


def is_local_name(name: str, this_host: str) -> bool:
    """Whether `name` means the launching machine (so no ssh is needed to reach it)."""
    return name in LOCAL_NAMES or name == this_host or name == this_host.split(".")[0]
