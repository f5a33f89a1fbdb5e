"""Stalls: a rank that waits in a collective for a rank that does not come is reported in seconds, without
stopping the job (job/stalls.py), from what the agents' samplers see in /proc and in stacks the ranks write
without stopping (node/sampler.py); --collective_timeout ends such a stall."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, crew, ranks_saying, write_script
from crew.launcher.job.stalls import StallWatch, format_duration
from crew.launcher.node import sampler
from crew.launcher.node.ranks import Rank

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch(report_after=10.0, end_after=0.0, can_ask=True):
    said, clock = [], Clock()
    stalls = StallWatch(HOSTS, 2, report_after, end_after, can_ask, said.append, clock)
    return stalls, said, clock


def places(node, ranks, where=False):
    return {"event": "places", "node": node, "host": HOSTS[ranks[0]["rank"]], "where": where, "ranks": ranks}


def blocked(rank, for_s, call="torch.distributed all_reduce", at="train.py:12 in step"):
    return {"rank": rank, "state": "blocked", "for_s": for_s, "call": call, "at": at}


def busy(rank, at=None):
    return {"rank": rank, "state": "busy", **({"call": None, "at": at} if at else {})}


def test_a_wait_shorter_than_the_threshold_is_not_a_stall():
    stalls, said, _ = watch()
    stalls.on_places(places(0, [blocked(0, 9.0), blocked(1, 9.0)]))
    stalls.on_places(places(1, [busy(2), busy(3)]))
    assert stalls.check() is None and said == []


def test_a_stall_asks_every_node_then_says_who_waits_where_and_who_did_not_arrive():
    stalls, said, clock = watch()
    stalls.on_places(places(0, [blocked(0, 10.5), blocked(1, 10.5)]))
    stalls.on_places(places(1, [blocked(2, 11.0), busy(3)]))
    assert stalls.check() == "ask" and said == []  # the report waits for the nodes' answers
    stalls.on_places(places(0, [blocked(0, 11.0), blocked(1, 11.0)], where=True))
    stalls.on_places(places(1, [blocked(2, 11.5), busy(3, at="data.py:40 in load_shards")], where=True))
    clock.now += 0.5
    assert stalls.check() is None
    report = said[0].splitlines()
    assert report[0] == ("stall: ranks 0-2 waited up to 12s in torch.distributed all_reduce; the job goes on. "
                         "Where each rank is:")
    assert "  ranks 0-1 (node-a): waiting in torch.distributed all_reduce, called from train.py:12 in step" in report
    assert "  rank 3 (node-b): running at data.py:40 in load_shards" in report
    assert report[-2].startswith("did not arrive: rank 3 ")
    assert "torch's collective timeout ends the job" in report[-1]


def test_without_answers_the_report_comes_after_a_few_seconds_with_what_is_known():
    stalls, said, clock = watch()
    stalls.on_places(places(0, [blocked(0, 12.0), busy(1)]))
    assert stalls.check() == "ask"
    clock.now += 1.0
    assert stalls.check() is None and said == []
    clock.now += 2.5
    stalls.check()
    assert "rank 1 (node-a): busy, no stack" in said[0]
    assert "ranks 2-3 (node-b): no word from its node yet" in said[0]


def test_the_stall_is_over_when_every_rank_moved_on():
    stalls, said, clock = watch()
    stalls.on_places(places(0, [blocked(0, 10.0), busy(1)]))
    stalls.check()
    clock.now += 3.5
    stalls.check()
    assert len(said) == 1
    clock.now += 20.0
    stalls.on_places(places(0, [busy(0), busy(1)]))
    stalls.check()
    assert said[1] == f"the stall is over: every rank moved on after {format_duration(33.5)}."


def test_collective_timeout_ends_a_stall_that_lasts():
    stalls, said, clock = watch(end_after=30.0, can_ask=False)
    stalls.on_places(places(0, [blocked(0, 12.0), busy(1, at="train.py:30 in evaluate")]))
    assert stalls.check() is None  # pdsh: no one to ask; the report is made at once from every look's stacks
    assert "crew ends the job after 30s of this (--collective_timeout)" in said[0]
    clock.now += 18.5
    assert stalls.check() == "end"


@pytest.mark.parametrize("report_after", [0.0, 30.0, 40.0])
def test_no_report_unless_it_comes_before_the_collective_timeout(report_after):
    stalls, said, clock = watch(report_after=report_after, end_after=30.0)
    stalls.on_places(places(0, [blocked(0, 29.0), busy(1)]))
    assert stalls.check() is None
    clock.now += 1.5
    assert stalls.check() == "end" and said == []


def test_a_stall_that_clears_while_the_agents_answer_is_not_reported():
    stalls, said, clock = watch()
    stalls.on_places(places(0, [blocked(0, 10.5), busy(1)]))
    assert stalls.check() == "ask"
    stalls.on_places(places(0, [busy(0, at="train.py:20 in step"), busy(1)], where=True))
    stalls.on_places(places(1, [busy(2), busy(3)], where=True))
    clock.now += 1.0
    assert stalls.check() is None and said == []
    stalls.on_places(places(0, [blocked(0, 11.0), busy(1)]))  # a new stall is a new report
    assert stalls.check() == "ask"


def test_a_finished_nodes_last_wait_does_not_age_into_a_stall():
    stalls, said, clock = watch(end_after=60.0)
    stalls.on_places(places(1, [blocked(2, 5.0, call="torch.distributed barrier"), blocked(3, 5.0)]))
    stalls.node_done({"node": 1, "codes": {"2": 0, "3": 0}})  # its ranks ended; its sampler said no more
    clock.now += 120.0
    assert stalls.check() is None and said == []


def test_a_busy_rank_inside_a_collective_is_said_once_as_running():
    stalls, said, clock = watch(can_ask=False)
    stalls.on_places(places(0, [blocked(0, 12.0), busy(1, at="train.py:9 in step")]))
    stalls.places[1].call = "torch.distributed all_reduce"
    stalls.check()
    assert "rank 1 (node-a): running in torch.distributed all_reduce, called from train.py:9 in step" in said[0]


@pytest.mark.parametrize("entry", [
    blocked(0, 500.0, call="torch.distributed init_process_group"),  # the join watch's (--init_timeout)
    {"rank": 0, "state": "blocked", "for_s": 500.0, "at": "train.py:3 in <module>"},  # a sleep, no collective
    {"rank": 0, "state": "exited", "code": 0},
])
def test_waits_that_are_no_collective_stall(entry):
    stalls, said, _ = watch()
    stalls.on_places(places(0, [entry, busy(1)]))
    assert stalls.check() is None and said == []


# -- the agent's side, on real processes -------------------------------------------------------------

HOOKED = {"PYTHONPATH": str(REPO / "crew" / "launcher" / "node" / "site")}


def start(code: str, env: dict | None = None, pass_fds=()) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **(env or {})}, pass_fds=pass_fds)
    time.sleep(0.5)  # past start-up: blocked, or busy
    return proc


def test_a_blocked_main_thread_keeps_its_counters_and_a_busy_one_does_not():
    sleeper, spinner = start("import time; time.sleep(30)"), start("while True: pass")
    try:
        first = [sampler.main_thread_counters(p.pid) for p in (sleeper, spinner)]
        time.sleep(0.3)
        second = [sampler.main_thread_counters(p.pid) for p in (sleeper, spinner)]
        assert first[0] == second[0] and first[1] != second[1]
    finally:
        sleeper.kill(), spinner.kill()
    assert sampler.main_thread_counters(2 ** 22 + 7) is None


def test_a_rank_says_where_it_is_and_goes_on_and_one_without_crews_hook_is_not_signalled():
    read_end, write_end = sampler.stack_pipe()
    hooked = start("import time\ndef nap():\n    time.sleep(30)\nnap()",
                   {**HOOKED, **sampler.rank_stacks_env(write_end)},
                   pass_fds=(write_end,))
    os.close(write_end)
    plain = start("import time; time.sleep(30)")
    try:
        looks = sampler.Sampler([Rank(0, 0, hooked, stack_pipe=read_end), Rank(1, 1, plain)], None, 0, "h", "/x", 1.0)
        hooked_look, plain_look = looks.watched
        assert looks.where(hooked_look) == sampler.stacks.Where(None, "<string>:4 in <module>")  # no file: outermost
        assert looks.where(plain_look) is None  # no handler: a real-time signal would have killed it
        time.sleep(0.2)
        assert hooked.poll() is None and plain.poll() is None
    finally:
        hooked.kill(), plain.kill()
        os.close(read_end)


def test_looks_count_a_spell_of_blocking_once_and_take_one_stack_for_it():
    read_end, write_end = sampler.stack_pipe()
    proc = start("import time\nwhile True:\n    time.sleep(30)", {**HOOKED, **sampler.rank_stacks_env(write_end)},
                 pass_fds=(write_end,))
    os.close(write_end)
    try:
        looks = sampler.Sampler([Rank(0, 0, proc, stack_pipe=read_end)], None, 0, "h", "/x", 1.0)
        w = looks.watched[0]
        assert looks.look(w, 10.0, False)["state"] == "busy"  # first look: nothing to compare with yet
        second = looks.look(w, 11.0, False)
        third = looks.look(w, 12.5, False)  # the stack taken at the second look did not count as a move
        assert (second["state"], second["for_s"], second["at"]) == ("blocked", 1.0, "<string>:3 in <module>")
        assert (third["state"], third["for_s"]) == ("blocked", 2.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert looks.look(w, 13.0, False) == {"rank": 0, "state": "exited", "code": -9}
    finally:
        proc.kill()
        os.close(read_end)


# -- end to end ------------------------------------------------------------------------------------

STALLS_THEN_GOES_ON = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
for _ in range(3000):  # a healthy loop of collectives: never a stall
    dist.all_reduce(t)
if dist.get_rank() == 1:
    end = time.time() + 6
    while time.time() < end: pass  # rank 1 is busy elsewhere (one line: one place); rank 0 waits below
dist.all_reduce(t)
print("finished", flush=True)
"""

NEVER_COMES = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    while True: pass
dist.all_reduce(t)
"""


def test_a_stall_is_reported_within_seconds_and_the_job_goes_on(job_dir):
    write_script(job_dir, "train.py", STALLS_THEN_GOES_ON)
    done = crew("run", "--num_gpus", "2", "--stall_report", "2", "train.py", cwd=job_dir)
    assert done.code == 0, done.err
    assert ranks_saying(done.out, "finished") == [0, 1]
    assert done.err.count("crew: stall: rank 0 waited up to") == 1
    assert "crew:   rank 0 (localhost): waiting in torch.distributed all_reduce, called from train.py:10" in done.err
    assert "crew:   rank 1 (localhost): running at train.py:9 in <module>" in done.err
    assert "crew: did not arrive: rank 1 " in done.err
    assert "crew: the stall is over: every rank moved on after" in done.err


def test_collective_timeout_ends_a_stall_with_every_ranks_stack(job_dir):
    write_script(job_dir, "train.py", NEVER_COMES)
    done = crew("run", "--num_gpus", "2", "--stall_report", "1", "--collective_timeout", "4", "train.py",
                cwd=job_dir)
    assert done.code == 124, done.err
    assert "crew: the stall lasted 4s (--collective_timeout)." in done.err
    assert "crew:   rank 1 (localhost): at train.py:7 in <module>" in done.err  # from its SIGABRT stack
    assert "crew: did not arrive: rank 1 (localhost) at train.py:7 in <module>" in done.err
    assert done.seconds < 30
