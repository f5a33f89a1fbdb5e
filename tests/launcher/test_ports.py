"""The master port crew picks lies outside the kernel's ephemeral range, where no outgoing connection can take it."""

from __future__ import annotations

import random
import socket

from crew.launcher.plan import ports


def test_range_read_from_the_kernels_file(tmp_path):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("40000\t50000\n")
    assert ports.ephemeral_range(range_file) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL


def test_picks_are_outside_the_ephemeral_range_and_free():
    low, high = ports.ephemeral_range()
    random.seed(0)  # a test seeding the random module must not make the picks repeat
    picks = {ports.free_port("127.0.0.1") for _ in range(20)}
    assert len(picks) > 10
    for port in picks:
        assert ports.LOWEST <= port <= 65535 and not low <= port <= high
        assert ports.can_bind("127.0.0.1", port)


def test_a_port_a_listener_holds_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        # the only port outside the "ephemeral" range is the busy one: the pick falls back to the kernel's
        monkeypatch.setattr(ports, "LOWEST", busy)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy + 1, 65535))
        assert not ports.can_bind("127.0.0.1", busy)
        assert ports.free_port("127.0.0.1") != busy
