"""A free TCP port for a listener (the master's rendezvous), taken outside the kernel's ephemeral range.

bind(("", 0)) hands out a port from the ephemeral range, the same range every outgoing connection on the
machine takes its local port from: between picking the port and the master's own bind, any connect can
take it, and the rendezvous fails with EADDRINUSE. A port outside that range is only ever taken by
another listener, and the pick checks that none holds it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LINUX_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default; also used where the range cannot be read
LOWEST = 20000  # below are the registered services' ports
_random = random.SystemRandom()  # a test's random.seed() must not make every pick the same


def ephemeral_range(path: Path = LINUX_RANGE) -> tuple[int, int]:
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def can_bind(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def free_port(address: str = "", tries: int = 200) -> int:
    """A port nothing listens on at `address` ("" = every address), outside the ephemeral range."""
    low, high = ephemeral_range()
    outside = [(LOWEST, low - 1), (high + 1, 65535)]
    spans = [(start, end) for start, end in outside if end >= start]
    for _ in range(tries if spans else 0):
        start, end = _random.choices(spans, weights=[end - start + 1 for start, end in spans])[0]
        port = _random.randint(start, end)
        if can_bind(address, port):
            return port
    with socket.socket() as sock:  # the whole range above LOWEST is the ephemeral one, or it is full
        sock.bind((address, 0))
        return sock.getsockname()[1]
