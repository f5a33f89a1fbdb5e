"""tests/dist.py's own promises: a hang or a rank that vanishes fails and says where, instead of a bare
queue.Empty after two minutes (as a CI run once showed, with nothing to go on)."""

from __future__ import annotations

import os
import time

import pytest
from dist import run_ranks


def wait_forever_in_rank_1(rank: int, pid_file: str) -> int:
    if rank == 1:
        with open(pid_file, "w") as handle:
            handle.write(str(os.getpid()))
        while True:
            time.sleep(0.05)
    return rank


def exit_quietly_in_rank_1(rank: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def test_a_hung_rank_fails_with_its_stack_and_is_killed(tmp_path):
    pid_file = tmp_path / "rank1.pid"
    assert run_ranks(exit_quietly_in_rank_1, 1) == [0]  # the fork server started: ranks start within the timeout
    with pytest.raises(AssertionError) as failed:
        run_ranks(wait_forever_in_rank_1, 2, str(pid_file), timeout=3.0)
    message = str(failed.value)
    assert "ranks [1] did not finish in time (the others: [0])" in message
    assert "wait_forever_in_rank_1" in message  # the hung rank's Python stack
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # killed and reaped


def test_a_rank_that_exits_without_a_result_fails_without_waiting_for_the_timeout():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"exited without returning or raising \(exit codes rank 1: 7\)"):
        run_ranks(exit_quietly_in_rank_1, 2, timeout=240.0)
    assert time.monotonic() - started < 120  # a loaded machine starts ranks in seconds, not minutes
