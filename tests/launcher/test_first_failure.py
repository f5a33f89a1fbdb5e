"""The first failure wins, whatever order srun's merged streams bring the news in (crew.launcher.job.holds).

A fake srun (one process for two nodes, as `--launcher slurm` starts) writes agent events and srun's own
lines in a chosen order; the real JobRun judges them. The real cluster: tests/launcher/test_slurm.py."""

from __future__ import annotations

import functools
import io
import json
import signal
import sys
import time

import pytest
from conftest import write_script

from crew.launcher.console.console import Console
from crew.launcher.job import run as job_run
from crew.launcher.job.holds import Holds, TaskEnd, srun_task_end
from crew.launcher.job.run import JobRun
from crew.launcher.preflight.gate import PreflightGate
from crew.launcher.transport.protocol import JobSpec, NodeSpec, encode_event
from crew.launcher.transport.runners import AgentLaunch

# Writes each step's line, in order: ("out", line), ("err", line), ("sleep", s), ("stdin",) waits for
# EOF (crew's stop), ("exit", code). The first stdin line (the job spec) is read first.
FAKE_SRUN = """
    import json, os, sys, time
    sys.stdin.buffer.readline()
    for step in json.loads(sys.argv[1]):
        if step[0] in ("out", "err"):
            stream = sys.stdout if step[0] == "out" else sys.stderr
            stream.write(step[1] + "\\n")
            stream.flush()
        elif step[0] == "sleep":
            time.sleep(step[1])
        elif step[0] == "stdin":
            sys.stdin.buffer.read()
        elif step[0] == "exit":
            sys.exit(step[1])
"""


def two_nodes(job_dir) -> JobSpec:
    nodes = (NodeSpec("gpu01", (0, 1), (0, 1)), NodeSpec("gpu02", (0, 1), (2, 3)))
    return JobSpec("holds001", nodes, "gpu01", 29500, ("train.py",), str(job_dir))


def out(kind: str, **fields) -> tuple[str, str]:
    return "out", encode_event(kind, **fields).decode().rstrip("\n")


def done(node: int, exit_code: int, stop_reason: str | None) -> tuple[str, str]:
    ranks = (2 * node, 2 * node + 1)
    code = -signal.SIGTERM if exit_code == 143 else exit_code
    return out("done", node=node, host=f"gpu0{node + 1}", codes={r: code for r in ranks}, exit_code=exit_code,
               stop_reason=stop_reason)


RANK_3_FAILS = out("rank_failed", node=1, host="gpu02", rank=3, local_rank=1, code=3, signal=None,
                   stderr_tail=["rank 3 gives up"], log=None, collective_timeout=False)


def run_fake_srun(job_dir, monkeypatch, steps, hold_s: float = 60.0, gate=None) -> tuple[int, str, JobRun, float]:
    """The fake srun's job under JobRun, news held `hold_s` at most (long: only the nodes' reports end a
    hold in time)."""
    monkeypatch.setattr(job_run, "Holds", functools.partial(Holds, hold_s))
    script = write_script(job_dir, "fake_srun.py", FAKE_SRUN)
    launch = AgentLaunch((0, 1), (sys.executable, str(script), json.dumps(steps)), "srun",
                         kill_signal=signal.SIGTERM, chatter=(b"srun: ", b"slurmstepd"))
    err = io.BytesIO()
    run = JobRun(two_nodes(job_dir), [launch], Console(io.BytesIO(), err, tty=False), gate=gate)
    began = time.monotonic()
    code = run.run()
    return code, err.getvalue().decode(), run, time.monotonic() - began


def test_a_rank_failure_behind_an_outside_stop_wins(job_dir, monkeypatch):
    """srun's kill of node 0 (or a cluster's KillOnBadExit=1) overtook node 1's report: node 1's is the
    first failure, and srun's line on node 1's task, ahead of node 1's own events, fails nothing."""
    code, err, run, seconds = run_fake_srun(job_dir, monkeypatch, [
        done(0, 143, "SIGTERM"), ("err", "srun: error: gpu02: task 1: Exited with exit code 3"), ("sleep", 0.3),
        RANK_3_FAILS, done(1, 3, "rank 3 failed"), ("exit", 3)])
    assert code == 3, err
    assert run.failure.rank == 3 and run.failure.host == "gpu02"
    assert "gpu02 rank 3 (local 1) exited with code 3 (first failure)" in err
    assert "without crew asking" not in err and "srun: error" not in err
    assert seconds < 30  # node 1's report ended the hold, not its time


def test_every_agent_stopped_from_outside_is_a_cancelled_job_said_at_once(job_dir, monkeypatch):
    code, err, run, seconds = run_fake_srun(job_dir, monkeypatch, [
        done(0, 143, "SIGTERM"), done(1, 143, "SIGTERM"), ("err", "srun: error: gpu0[1-2]: tasks 0-1: Terminated"),
        ("stdin",), ("exit", 143)])
    assert code == 143, err
    assert "gpu01: the crew agent stopped every rank there (SIGTERM) without crew asking" in err
    assert run.failure.rank is None
    assert seconds < 30  # every node had reported: nothing left to wait for (the fake waits for crew's stop)


def test_an_agent_that_dies_without_a_word_is_named_from_sruns_line(job_dir, monkeypatch):
    """srun no longer ends the step for it (--kill-on-bad-exit=0): crew stops the other node."""
    code, err, run, seconds = run_fake_srun(job_dir, monkeypatch, [
        ("err", "Traceback (most recent call last):"), ("err", "srun: error: gpu02: task 1: Killed"),
        ("stdin",), done(0, 143, "the launcher closed the connection"), ("exit", 137)], hold_s=0.5)
    assert code == 137, err
    assert "gpu02: the crew agent ended (srun: Killed) before its ranks finished." in err
    assert "    Traceback (most recent call last):" in err  # the tail, srun's line with it
    assert run.failure.host == "gpu02" and seconds >= 0.5  # node 1's done might still have come


def test_an_agent_that_dies_before_the_preflight_verdict_is_judged_by_the_gate(job_dir, monkeypatch):
    seen = []

    def judge(facts, errors, seconds):
        seen.append((sorted(facts), errors))
        return False, "preflight: node 1 failed"

    code, err, _, _ = run_fake_srun(job_dir, monkeypatch, [
        out("probe", node=0, host="gpu01"), ("err", "No module named crew"),
        ("err", "srun: error: gpu02: task 1: Exited with exit code 1"), ("stdin",), ("exit", 1)],
        hold_s=0.5, gate=PreflightGate(2, judge))
    assert code == 1 and "preflight: node 1 failed" in err
    assert seen == [([0], {1: (1, ["No module named crew", "srun: error: gpu02: task 1: Exited with exit code 1"])})]


# -- the pieces ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, hosts, code", [
    ("srun: error: gpu02: task 1: Exited with exit code 3", ("gpu02",), 3),
    ("srun: error: gpu[01-02]: tasks 0-1: Killed\n", ("gpu01", "gpu02"), 128 + signal.SIGKILL),
    ("srun: error: 127.0.0.3: task 1: Segmentation fault (core dumped)", ("127.0.0.3",), 128 + signal.SIGSEGV),
    ("srun: error: gpu02: task 1: Something new", ("gpu02",), 1),
])
def test_sruns_line_on_a_task_end(line, hosts, code):
    end = srun_task_end(line)
    assert (end.hosts, end.code) == (hosts, code)


@pytest.mark.parametrize("line", ["srun: error: Unable to create step for job 7: Job/step already completing",
                                  "srun: Force Terminated StepId=2.0", "[gpu02:3] srun: error: x: task 1: Killed"])
def test_other_srun_lines_are_no_task_end(line):
    assert srun_task_end(line) is None


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outside_stop_waits_for_the_nodes_or_its_time():
    clock = Clock()
    holds = Holds(2.0, clock)
    holds.outside_stop({"node": 0})
    holds.outside_stop({"node": 1})  # the first one is what is said
    assert holds.due(settled=False) == (None, []) and holds.deadline() == 102.0
    assert holds.due(settled=True) == ({"node": 0}, [])
    assert holds.due(settled=True) == (None, [])  # given once
    holds.outside_stop({"node": 1})
    clock.now = 102.0
    assert holds.due(settled=False) == ({"node": 1}, [])


def test_a_task_end_waits_for_its_nodes_done_and_yields_to_an_outside_stop():
    clock = Clock()
    holds = Holds(2.0, clock)
    end = TaskEnd(("gpu02",), "Killed", 137)
    holds.task_end(1, end)
    holds.task_end(0, end)
    holds.reported(0)  # node 0's done came: moot
    clock.now = 101.0
    holds.outside_stop({"node": 0})
    clock.now = 102.5
    assert holds.due(settled=False) == (None, [])  # the outside stop is still held, and goes first
    clock.now = 103.0
    assert holds.due(settled=False) == ({"node": 0}, [])
    assert holds.due(settled=False) == (None, [(1, end)]) and holds.deadline() is None
