"""The merged preflight (crew.launcher.preflight.gate) with real agent processes on this machine: nothing starts
before the verdict, nothing at all when it refuses, and a silent or dead agent is judged, not waited on.
(Over real ssh nodes: tests/launcher/test_doctor.py and test_fanout.py.)"""

from __future__ import annotations

import io
import sys
import time

from conftest import processes_in, write_script

from crew.launcher.transport import runners
from crew.launcher.console.console import Console
from crew.launcher.preflight.gate import PreflightGate
from crew.launcher.job.run import JobRun
from crew.launcher.preflight.probe import script_hash
from crew.launcher.transport.protocol import JobSpec, NodeSpec
from crew.launcher.transport.runners import AgentLaunch

SCRIPT = """
    import os
    open(f"ran{os.environ['RANK']}", "w").close()
"""


def two_node_job(job_dir) -> JobSpec:
    return JobSpec(job_id="gate0001", nodes=(NodeSpec("node-a", (0,), (0,)), NodeSpec("node-b", (1,), (1,))),
                   master_addr="127.0.0.1", master_port=1, program=("train.py",), cwd=str(job_dir), env={})


def agents(job: JobSpec) -> list[AgentLaunch]:
    """Both nodes' agents on this machine, as `crew run` over ssh starts them (--preflight)."""
    return [AgentLaunch((n,), tuple(runners.agent_argv(sys.executable, job, n, "--preflight")), node.host)
            for n, node in enumerate(job.nodes)]


class Judge:
    def __init__(self, passed: bool):
        self.passed, self.calls = passed, []

    def __call__(self, facts, errors, seconds):
        self.calls.append((facts, errors))
        return self.passed, "preflight: verdict " + ("go" if self.passed else "no")


def run_job(job, launches, judge, timeout=20.0):
    err = io.BytesIO()
    gate = PreflightGate(len(job.nodes), judge, timeout)
    run = JobRun(job, launches, Console(io.BytesIO(), err, tty=False), gate=gate)
    code = run.run()
    return code, err.getvalue().decode(), gate


def test_ranks_start_only_after_every_node_passed(job_dir):
    write_script(job_dir, "train.py", SCRIPT)
    job = two_node_job(job_dir)
    judge = Judge(passed=True)
    # node 1's agent starts last: with a window of 1, node 0 waits for its facts before anything starts
    launches = agents(job)
    err = io.BytesIO()
    run = JobRun(job, launches, Console(io.BytesIO(), err, tty=False), fanout=1,
                 gate=PreflightGate(2, judge))
    assert run.run() == 0, err.getvalue()
    [(facts, errors)] = judge.calls
    assert sorted(facts) == [0, 1] and not errors
    assert facts[0]["script"] == script_hash(job) and facts[1]["crew"]
    assert sorted(p.name for p in job_dir.glob("ran*")) == ["ran0", "ran1"]
    assert run.started[0]["waited_s"] > 0  # it waited for node 1's agent to start and answer
    assert "preflight: verdict go" in err.getvalue().decode()


def test_a_refusal_starts_nothing_anywhere_and_leaves_nothing(job_dir):
    write_script(job_dir, "train.py", SCRIPT)
    job = two_node_job(job_dir)
    code, err, _ = run_job(job, agents(job), Judge(passed=False))
    assert code == 1 and "preflight: verdict no" in err
    assert not list(job_dir.glob("ran*")) and not processes_in(job_dir)


def test_an_agent_that_dies_is_judged_with_its_last_words(job_dir):
    write_script(job_dir, "train.py", SCRIPT)
    job = two_node_job(job_dir)
    dead = AgentLaunch((1,), ("sh", "-c", "echo 'Permission denied (publickey).' >&2; exit 255"), "node-b")
    judge = Judge(passed=False)
    code, err, _ = run_job(job, [agents(job)[0], dead], judge)
    [(facts, errors)] = judge.calls
    assert list(facts) == [0] and errors == {1: (255, ["Permission denied (publickey)."])}
    assert code == 1 and "Permission denied" not in err  # held back: the verdict says it, with the fix
    assert not list(job_dir.glob("ran*")) and not processes_in(job_dir)


def test_a_silent_agent_is_given_up_on_after_the_timeout(job_dir):
    write_script(job_dir, "train.py", SCRIPT)
    job = two_node_job(job_dir)
    silent = AgentLaunch((1,), ("sh", "-c", f"cd {job_dir} && sleep 60"), "node-b")
    judge = Judge(passed=False)
    began = time.monotonic()
    code, _, _ = run_job(job, [agents(job)[0], silent], judge, timeout=1.0)
    assert code == 1 and time.monotonic() - began < 10
    [(_, errors)] = judge.calls
    assert errors[1][1][-1] == "no answer within 1 s (timed out)"
    assert not list(job_dir.glob("ran*")) and not processes_in(job_dir)
