"""Many nodes: crew's own lines stay short (counts, the slowest few), alike nodes are grouped, and the
launcher starts agents in a bounded window."""

from __future__ import annotations

import json

import pytest
from conftest import crew, write_script

from crew.errors import CrewError
from crew.launcher.preflight import doctor
from crew.launcher.job import run as job
from crew.launcher.plan.hostfile import Host
from crew.launcher.plan.launch import Launch, format_layout
from crew.launcher.plan.plan import build_plan
from crew.launcher.job.timing import Timing

LINE_MAX = 200
NOOP = """
    import os
    open(f"ran{os.environ['RANK']}", "w").close()
"""


def long_hosts(count: int) -> list[str]:
    return [f"gpu-node-{i:04d}.rack-{i // 16}.cluster.example.com" for i in range(count)]


def test_startup_line_names_the_slowest_few_within_the_limit():
    times = {n: {"host": host, "total": 1 + n / 100, "connect": 0.5, "agent": 0.4, "spawn": 0.01}
             for n, host in enumerate(long_hosts(64))}
    [line] = job.startup_lines(times)
    assert len(line) <= LINE_MAX
    assert line.startswith("all 64 node(s) started in 1.63s; per node (median): connect 0.50s")
    assert "slowest: gpu-node-0063.rack-3.cluster.example.com 1.63s" in line
    times[1]["waited"] = 0.25
    verbose = job.startup_lines(times, verbose=True)
    assert len(verbose) == 65 and verbose[1].startswith("  node 0: gpu-node-0000")
    assert "preflight" not in verbose[1] and "waited 0.25s for the other nodes' preflight" in verbose[2]


def test_startup_line_lists_every_node_when_it_fits():
    times = {n: {"host": f"10.0.0.{n}", "total": 1.0, "connect": 0.5, "agent": 0.4, "spawn": 0.1}
             for n in range(2)}
    [line] = job.startup_lines(times)
    assert line == ("all 2 node(s) started in 1.00s (10.0.0.0: connect 0.50s, agent 0.40s, ranks spawned "
                    "0.10s; 10.0.0.1: connect 0.50s, agent 0.40s, ranks spawned 0.10s)")


def test_fit_list_says_how_many_were_left_out():
    assert job.fit_list("x: ", ["aaaa", "bbbb", "cccc"], 16) == "x: aaaa (+2 more)"
    assert job.fit_list("x: ", ["aaaa", "bbbb"], 40) == "x: aaaa, bbbb"


def test_the_fanout_window_from_the_flag_or_the_environment(monkeypatch, job_dir):
    from crew.cli import build_parser

    assert build_parser().parse_args(["run", "x.py"]).fanout == job.FANOUT
    assert build_parser().parse_args(["run", "--fanout", "4", "x.py"]).fanout == 4
    monkeypatch.setenv("CREW_FANOUT", "6")
    assert build_parser().parse_args(["run", "x.py"]).fanout == 6
    refused = crew("run", "--fanout", "0", "x.py", cwd=job_dir)
    assert refused.code == 2 and "--fanout: '0' is not a whole number >= 1" in refused.err
    refused = crew("run", "x.py", cwd=job_dir, env={"CREW_FANOUT": "many"})
    assert refused.code == 2 and "'many' is not a whole number >= 1" in refused.err


def test_layout_of_many_nodes_is_summed_up_unless_verbose():
    hosts = [Host(name, (0, 1)) for name in long_hosts(64)]
    launch = Launch("ssh", hosts, build_plan(hosts, "10.0.0.1", 29500, {}), ())
    short = format_layout(launch, "abc", verbose=False).splitlines()
    assert len(short) == 1 + 8 and all(len(line) <= LINE_MAX for line in short)
    assert short[7] == "  ... nodes 6-62 (57 more, 2 rank(s) each; --verbose lists every node)"
    assert short[8].startswith("  node 63: gpu-node-0063")
    assert len(format_layout(launch, "abc", verbose=True).splitlines()) == 65


def reports(count: int, odd: dict[int, str]) -> list[doctor.NodeReport]:
    """`count` nodes alike, but those in `odd` have that torch version (a failed check)."""
    out = []
    for node, host in enumerate(long_hosts(count)):
        report = doctor.NodeReport(node, host, None)
        report.add(doctor.Check("ssh", "ok", "ok"))
        if node in odd:
            report.add(doctor.Check("torch", "fail", odd[node], f"torch {odd[node]} here (/v/bin/python), "
                                    "2.3.0 on others", f"on {host}: /v/bin/python -m pip install torch==2.3.0"))
        else:
            report.add(doctor.Check("torch", "ok", "2.3.0"))
        out.append(report)
    return out


def test_doctor_table_groups_alike_nodes():
    rows = reports(64, {5: "2.1.0", 40: "2.1.0"})
    lines = doctor.format_table(rows, verbose=False).splitlines()
    assert lines[0] == ("62 node(s) ok; 2 fail: gpu-node-0005.rack-0.cluster.example.com (node 5), "
                        "gpu-node-0040.rack-2.cluster.example.com (node 40)")
    assert [line.split()[:3] for line in lines[2:]] == [
        ["0-4,6-39,41-63", "gpu-node-0000.rack-0.cluster.example.com", "+61"],
        ["5,40", "gpu-node-0005.rack-0.cluster.example.com", "+1"]]
    assert lines[3].endswith("✗ 2.1.0")
    assert all(len(line) <= LINE_MAX for line in lines)
    assert len(doctor.format_table(rows, verbose=True).splitlines()) == 65


def test_doctor_problems_said_once_for_alike_nodes():
    odd = {n: "2.1.0" for n in range(0, 64, 2)}
    text = doctor.format_problems(reports(64, odd), verbose=False)
    lines = text.splitlines()
    assert len(lines) == 2 and all(len(line) <= LINE_MAX for line in lines)
    assert lines[0] == ("✗ 32 nodes: gpu-node-0000.rack-0.cluster.example.com (node 0) (+31 more) torch: "
                        "torch 2.1.0 here (/v/bin/python), 2.3.0 on others")
    assert lines[1] == "    fix: on gpu-node-0000.rack-0.cluster.example.com: /v/bin/python -m pip install torch==2.3.0"
    assert doctor.format_table(reports(12, {}), verbose=False).splitlines()[0] == "12 node(s) ok, all alike"


def test_nine_nodes_short_lines_and_the_doctor_grouped(make_cluster, job_dir):
    nodes = 9  # the fewest past 8, where the layout and the doctor start to group nodes
    cluster = make_cluster(nodes)
    write_script(job_dir, "noop.py", NOOP)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                  "--log_dir", "logs", "noop.py", cwd=job_dir, env={"CREW_FANOUT": "4", "CREW_TIMING": "1"})
    assert result.code == 0, result.err
    assert sorted(p.name for p in job_dir.glob("ran*")) == sorted(f"ran{r}" for r in range(nodes))
    own = [line for line in result.err.splitlines() if line.startswith("crew: ")]
    assert own and max(map(len, own)) <= LINE_MAX, max(own, key=len)
    started = [line for line in own if "node(s) started" in line]
    assert len(started) == 1 and started[0].startswith(f"crew: all {nodes} node(s) started in ")
    assert "slowest: 127.0.0." in started[0]
    assert "crew:   ... nodes 6-7 (2 more, 1 rank(s) each; --verbose lists every node)" in own
    assert any(line.startswith("crew: timing (s since crew started): preflight ") for line in own)
    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    assert all(set(node["startup_s"]) == {"connect", "agent", "waited", "spawn", "total"}
               for node in record["nodes"])
    # One ssh login per node, preflight included: the first agents up waited for the last ones' facts.
    assert record["nodes"][0]["startup_s"]["waited"] > 0
    logins = [(cluster.root / f"sshd_{a}.log").read_text().count("Accepted publickey") for a in cluster.addresses]
    assert logins == [1] * nodes

    checked = crew("doctor", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                   "noop.py", cwd=job_dir)
    assert checked.code == 0, checked.out + checked.err
    lines = checked.out.splitlines()
    assert f"{nodes} node(s) ok, all alike" in lines
    grouped = [line.split()[:4] for line in lines if line.startswith("0-")]
    assert grouped == [[f"0-{nodes - 1}", "127.0.0.2", f"+{nodes - 1}", "ok"]]
    assert max(map(len, lines)) <= LINE_MAX



def test_crew_timing_takes_a_switch_and_names_a_bad_one():

    assert Timing({"CREW_TIMING": "1"}).enabled and not Timing({}).enabled and not Timing({"CREW_TIMING": "0"}).enabled
    with pytest.raises(CrewError, match=r"CREW_TIMING='maybe': expected 1"):
        Timing({"CREW_TIMING": "maybe"})
