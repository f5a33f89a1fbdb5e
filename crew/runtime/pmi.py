"""Share one value from rank 0 over PMI-1's wire protocol: how ranks that MPICH's or Intel MPI's Hydra started
(PMI_FD set) agree on a master address without mpi4py.

PMI-1 is a line protocol on the socket Hydra's proxy hands each rank (PMI_FD): `cmd=init ...`, then puts and
gets in the job's key-value space, separated by a barrier. The session ends with `finalize`, always: Hydra
kills the whole job when a rank that spoke PMI closes the socket without it.
"""

from __future__ import annotations

import os
import socket

from crew.errors import CrewError

KEY = "crew_master_addr"


class PmiError(CrewError):
    """The PMI server answered something PMI-1 does not, or went away."""


def share_from_rank0(fd: int, rank: int, value: str | None, timeout_s: float) -> str:
    """Rank 0 puts `value`; every rank gets it back after a barrier over all ranks."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        sock.settimeout(timeout_s)
        session = _Session(sock)
        session.ask("cmd=init pmi_version=1 pmi_subversion=1", "response_to_init")
        try:
            kvs = session.ask("cmd=get_my_kvsname", "my_kvsname")["kvsname"]
            if rank == 0:
                session.ask(f"cmd=put kvsname={kvs} key={KEY} value={value}", "put_result")
            session.ask("cmd=barrier_in", "barrier_out")
            shared = session.ask(f"cmd=get kvsname={kvs} key={KEY}", "get_result")["value"]
        except PmiError:
            try:
                session.ask("cmd=finalize", "finalize_ack")
            except PmiError:
                pass  # the first error is the one to report
            raise
        session.ask("cmd=finalize", "finalize_ack")
        return shared


class _Session:
    def __init__(self, sock: socket.socket):
        self.sock, self.pending = sock, b""

    def ask(self, line: str, expected: str) -> dict[str, str]:
        """Send one command; its answer's fields, checked to be `expected` with rc 0 (when it has one)."""
        try:
            self.sock.sendall(line.encode() + b"\n")
            answer = self._line()
        except TimeoutError:
            raise PmiError(f"PMI: no answer to {line.split()[0]} within {self.sock.gettimeout():.0f} s (a rank that "
                           "never reached init_distributed?)") from None
        except OSError as error:
            raise PmiError(f"PMI: {line.split()[0]} failed: {error}") from None
        fields = dict(item.partition("=")[::2] for item in answer.split())
        if fields.get("cmd") != expected or fields.get("rc", "0") != "0":
            raise PmiError(f"PMI: {line.split()[0]} answered {answer!r}, expected cmd={expected} rc=0")
        return fields

    def _line(self) -> str:
        while b"\n" not in self.pending:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise OSError("the PMI server closed the connection")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode(errors="replace")
