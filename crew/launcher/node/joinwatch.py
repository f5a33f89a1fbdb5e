"""Has a rank joined the process group? Seen from outside the rank, in /proc: no help from the script.

`init_process_group` (env://, as every launcher sets it up) starts with a TCP connection to the store at
MASTER_ADDR:MASTER_PORT: rank 0 listens there (and connects to itself), every other rank connects.
So a rank's TCP sockets (its /proc/PID/fd links `socket:[INODE]`, looked up in /proc/PID/net/tcp and
tcp6) tell where it is:

- `joined`: an ESTABLISHED connection to the master port: it is in (or past) init_process_group;
- `connecting`: a SYN_SENT to the master port: it is trying, and nothing answers (firewall, route);
- `listening`: it listens on the master port (rank 0's store) but has no connection to it yet;
- `not connected`: none of these: it has not called init_process_group yet, or its connections are
  refused (a refused socket is gone before anyone can see it).

A rank's helper processes count as the rank: every process of the rank's session is looked at.

`JoinWatch` runs in each node's agent and sends a `join` event whenever a rank's state changes; the
launcher follows them (`hangs.HangWatch`), and `missing_cause` says why a rank did not join.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from crew.launcher.transport.protocol import JobSpec
from crew.launcher.node.ranks import Output, Rank

JOINED, CONNECTING, LISTENING, NOT_CONNECTED = "joined", "connecting", "listening", "not connected"
EXITED = "exited"  # reported by the agent when a rank ends before it was seen joined
_ESTABLISHED, _SYN_SENT, _LISTEN = 0x01, 0x02, 0x0A
# How often the sockets of ranks that have not joined yet are looked at: every 0.5 s at first, then
# less often (a twentieth of the time waited so far, at most every 5 s) for jobs that never join.
JOIN_POLL_S, JOIN_POLL_MAX_S = 0.5, 5.0


@dataclass(frozen=True)
class Conn:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    inode: int


@dataclass(frozen=True)
class Seen:
    state: str
    remote: str | None = None  # "addr:port" of the connection (attempt) to the master port


def decode_address(text: str) -> tuple[str, int]:
    """`0100007F:7389` (tcp) or the 32-digit tcp6 form: (address, port); IPv4-mapped shown as IPv4."""
    hex_addr, hex_port = text.split(":")
    raw = bytes.fromhex(hex_addr)
    # The kernel prints each 32-bit word in host byte order (little-endian here).
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return str(address), int(hex_port, 16)


def parse_tcp_table(text: str) -> list[Conn]:
    """The rows of /proc/net/tcp or tcp6."""
    conns = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            conns.append(Conn(decode_address(fields[1]), decode_address(fields[2]), int(fields[3], 16),
                              int(fields[9])))
        except ValueError:
            continue
    return conns


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open (empty when it is gone)."""
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def tcp_connections(pid: int) -> list[Conn]:
    """Every TCP socket of the network namespace of process `pid` (IPv4 and IPv6)."""
    conns = []
    for table in ("tcp", "tcp6"):
        try:
            conns += parse_tcp_table(Path(f"/proc/{pid}/net/{table}").read_text())
        except OSError:
            continue
    return conns


def classify(conns: Iterable[Conn], inodes: set[int], master_port: int) -> Seen:
    """The join state of a process holding the sockets `inodes`, given its namespace's TCP table."""
    best = Seen(NOT_CONNECTED)
    order = {NOT_CONNECTED: 0, LISTENING: 1, CONNECTING: 2, JOINED: 3}
    for conn in conns:
        if conn.inode not in inodes or conn.inode == 0:
            continue
        seen = None
        if conn.remote[1] == master_port and conn.state == _ESTABLISHED:
            seen = Seen(JOINED, format_address(*conn.remote))
        elif conn.remote[1] == master_port and conn.state == _SYN_SENT:
            seen = Seen(CONNECTING, format_address(*conn.remote))
        elif conn.local[1] == master_port and conn.state == _LISTEN:
            seen = Seen(LISTENING)
        if seen and order[seen.state] > order[best.state]:
            best = seen
    return best


def format_address(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def sessions() -> dict[int, list[int]]:
    """Process ids by session id, for every process this user can see."""
    found: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found.setdefault(int(fields[3]), []).append(int(name))
    return found


def observe(pids: dict[int, int], master_port: int) -> dict[int, Seen]:
    """The join state of each rank, given {rank: pid of its process, which leads its own session}."""
    by_session = sessions()
    tables: dict[str, list[Conn]] = {}
    seen = {}
    for rank, pid in pids.items():
        members = [pid, *(p for p in by_session.get(pid, ()) if p != pid)]
        inodes = set().union(*(socket_inodes(member) for member in members))
        if not inodes:
            seen[rank] = Seen(NOT_CONNECTED)
            continue
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            namespace = str(pid)
        if namespace not in tables:
            tables[namespace] = tcp_connections(pid)
        seen[rank] = classify(tables[namespace], inodes, master_port)
    return seen


class JoinWatch:
    """Sends a `join` event whenever a rank's join state changes, until every rank joined or ended.

    A state ends at `joined` or `exited` (a rank that ended before it was seen joined); the launcher
    counts neither as missing. The agent's ranks need only `.rank`, `.proc` and `.code`, its output
    only `.event(kind, **fields)`.
    """

    def __init__(self, job: JobSpec, node_rank: int, ranks: Sequence[Rank], output: Output):
        self.job, self.node_rank, self.ranks, self.output = job, node_rank, ranks, output
        self.host = job.nodes[node_rank].host
        self.states: dict[int, str] = {}
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.is_set() and self._waiting():
            pids = {rank.rank: rank.proc.pid for rank in self._waiting()}
            try:
                seen = observe(pids, self.job.master_port)
            except OSError:
                seen = {}
            for rank in self._waiting():
                if rank.rank in seen and rank.proc.poll() is None:
                    self._report(rank, seen[rank.rank].state, seen[rank.rank].remote)
            waited = time.monotonic() - started
            self.stopped.wait(min(JOIN_POLL_MAX_S, max(JOIN_POLL_S, waited / 20)))

    def exited(self, rank: Rank) -> None:
        self._report(rank, EXITED, code=rank.code)

    def _waiting(self) -> list[Rank]:
        return [rank for rank in self.ranks if self.states.get(rank.rank) not in (JOINED, EXITED)]

    def _report(self, rank: Rank, state: str, remote: str | None = None, **extra) -> None:
        with self._lock:
            if self.stopped.is_set() or self.states.get(rank.rank) in (state, JOINED, EXITED):
                return
            self.states[rank.rank] = state
            self.output.event("join", node=self.node_rank, host=self.host, rank=rank.rank, state=state,
                              remote=remote, **extra)


def missing_cause(state: str, remote: str | None, host: str, master_addr: str, master_port: int,
                  rank0_state: str | None, stack_taken: bool, in_init: bool) -> str:
    """Why a rank in `state` on `host` is not in the process group, and the fix, in one sentence.

    rank0_state: rank 0's own join state (None when unknown); stack_taken: whether the rank's stack
    was taken, and then in_init: whether it was inside torch.distributed.
    """
    master = format_address(master_addr, master_port)
    fix_addr = ("set --master_addr to an address of the first node that every node can reach; check "
                "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME")
    if state == CONNECTING:
        target = remote or master
        return (f"connecting to {target} with no answer: a firewall drops it, or "
                f"{target.rsplit(':', 1)[0].strip('[]')} is not reachable from {host} ({fix_addr})")
    if state == LISTENING:
        return (f"its store listens on port {master_port}, but it has not connected to {master} itself: "
                f"{master_addr} may not be an address of {host} ({fix_addr})")
    if not stack_taken:
        return (f"not connected to {master}: it has not called init_process_group (still in start-up "
                "code, or stuck before it), or its connections are refused")
    if not in_init:
        return (f"not connected to {master}: it has not called init_process_group (still in start-up "
                "code, or stuck before it: see where it was below)")
    if rank0_state in (JOINED, LISTENING):
        return (f"in init_process_group, but its connections to {master} are refused or reset: "
                f"{master_addr} is not rank 0's node as seen from {host}, or a firewall rejects them "
                f"({fix_addr})")
    return (f"in init_process_group, waiting for rank 0's store at {master}, which does not listen: "
            "rank 0 has not called init_process_group, or the master address is wrong")
