"""Host selection (DeepSpeed's --include/--exclude/--num_nodes/--num_gpus), plans, `crew plan`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crew import cli
from crew.errors import PlanError
from crew.launcher.transport import runners
from crew.launcher.plan.hostfile import Host, parse_hostfile
from crew.launcher.plan.plan import build_plan, check_master_addr, parse_filter, select_hosts

HOSTS = parse_hostfile("""
a slots=4
b:2222 slots=2 gpu=2,3
c slots=3 gpu=4,5,6
""")


def select(**options) -> dict[str, tuple[int, ...]]:
    """{host: slots} after selection; dict order is the selection's order."""
    return {host.name: host.slots for host in select_hosts(HOSTS, **options)}


def plan_error(**options) -> str:
    with pytest.raises(PlanError) as info:
        select_hosts(HOSTS, **options)
    return str(info.value)


@pytest.mark.parametrize("options, expected", [
    ({}, {"a": (0, 1, 2, 3), "b": (2, 3), "c": (4, 5, 6)}),
    ({"include": "b"}, {"b": (2, 3)}),
    ({"include": "a:0,2"}, {"a": (0, 2)}),
    ({"include": "a:2,0"}, {"a": (0, 2)}),                     # slot order follows the hostfile
    ({"include": "c:6@a:1"}, {"a": (1,), "c": (6,)}),          # hostfile order, not include order
    ({"include": "c@b"}, {"b": (2, 3), "c": (4, 5, 6)}),
    ({"include": "a:0@a:3"}, {"a": (0, 3)}),                   # same host twice: slots add up
    ({"include": "a@a:1"}, {"a": (0, 1, 2, 3)}),               # whole host wins
    ({"include": "a:1@a"}, {"a": (0, 1, 2, 3)}),
    ({"exclude": "a:1"}, {"a": (0, 2, 3), "b": (2, 3), "c": (4, 5, 6)}),
    ({"exclude": "b"}, {"a": (0, 1, 2, 3), "c": (4, 5, 6)}),
    ({"exclude": "b:2,3@c:5"}, {"a": (0, 1, 2, 3), "c": (4, 6)}),  # all slots out: host gone
    ({"exclude": "a@c"}, {"b": (2, 3)}),
    ({"num_nodes": 2}, {"a": (0, 1, 2, 3), "b": (2, 3)}),
    ({"num_nodes": 3}, {"a": (0, 1, 2, 3), "b": (2, 3), "c": (4, 5, 6)}),
    ({"num_gpus": 1}, {"a": (0,), "b": (2,), "c": (4,)}),
    ({"num_gpus": 2}, {"a": (0, 1), "b": (2, 3), "c": (4, 5)}),
    ({"num_nodes": 1, "num_gpus": 3}, {"a": (0, 1, 2)}),
])
def test_selection(options, expected):
    selected = select(**options)
    assert selected == expected
    assert list(selected) == list(expected)


def test_num_gpus_takes_first_device_ids_of_the_host():
    hosts = parse_hostfile("x slots=3 gpu=4,5,6")
    assert select_hosts(hosts, num_gpus=2) == [Host("x", (4, 5))]


def test_selection_keeps_ssh_port():
    assert select_hosts(HOSTS, include="b:3") == [Host("b", (3,), 2222)]


@pytest.mark.parametrize("options, words", [
    ({"exclude": "a@b@c"}, ["leaves no slot"]),
    ({"exclude": "a:0,1,2,3@b@c:4,5,6"}, ["leaves no slot"]),
    ({"include": "a", "exclude": "b"}, ["--include and --exclude cannot be used together"]),
    ({"include": "a", "num_nodes": 1}, ["--num_nodes/--num_gpus", "--include"]),
    ({"include": "a", "num_gpus": 1}, ["--num_nodes/--num_gpus", "--include"]),
    ({"exclude": "a", "num_gpus": 1}, ["--num_nodes/--num_gpus", "--exclude"]),
    ({"include": "zz"}, ["--include zz", "host 'zz' is not in the hostfile", "a, b, c"]),
    ({"exclude": "a@zz:0"}, ["--exclude a@zz:0", "host 'zz' is not in the hostfile"]),
    ({"include": "A"}, ["host 'A' is not in the hostfile"]),   # names are exact
    ({"include": "b:0"}, ["host 'b' has no slot 0", "2,3"]),
    ({"exclude": "c:4,9"}, ["--exclude", "host 'c' has no slot 9", "4,5,6"]),
    ({"include": "a:x"}, ["--include a:x", "'x' must be device ids separated by commas"]),
    ({"include": "a:"}, ["must be device ids separated by commas"]),
    ({"include": "a:0,,1"}, ["'0,,1' must be device ids"]),
    ({"exclude": "a:-1"}, ["'-1' must be device ids"]),
    ({"include": "a@"}, ["host '' is not in the hostfile"]),
    ({"num_nodes": 0}, ["--num_nodes 0", "at least 1"]),
    ({"num_nodes": -1}, ["--num_nodes -1", "at least 1"]),
    ({"num_nodes": 4}, ["--num_nodes 4", "only 3 host(s)", "a, b, c"]),
    ({"num_gpus": 0}, ["--num_gpus 0", "at least 1"]),
    ({"num_gpus": 3}, ["--num_gpus 3", "host 'b' has only 2 slot(s)", "at most 2"]),
])
def test_selection_errors(options, words):
    message = plan_error(**options)
    for word in words:
        assert word in message


@pytest.mark.parametrize("spec, expected", [
    ("a", {"a": None}),
    ("a:1", {"a": (1,)}),
    ("b:3,2@c", {"b": (3, 2), "c": None}),
])
def test_parse_filter(spec, expected):
    assert parse_filter(spec, "--include", HOSTS) == expected


def test_include_ipv6_host_by_its_hostfile_name():
    hosts = parse_hostfile("fe80::1 slots=2\nworker slots=1")
    assert select_hosts(hosts, include="fe80::1") == [Host("fe80::1", (0, 1))]


# --------------------------------------------------------------------------------------------
# build_plan

def test_build_plan_numbers_ranks_in_hostfile_order():
    plan = build_plan(select_hosts(HOSTS, exclude="a:1"), "a", 29500, {"K": "v"})
    assert plan.world_size == 8
    assert [(n.node_rank, n.host, n.ssh_port, n.slots, n.ranks) for n in plan.nodes] == [
        (0, "a", None, (0, 2, 3), (0, 1, 2)),
        (1, "b", 2222, (2, 3), (3, 4)),
        (2, "c", None, (4, 5, 6), (5, 6, 7)),
    ]
    assert plan.env == {"K": "v"}


def test_build_plan_copies_env():
    env = {"K": "v"}
    plan = build_plan(HOSTS, "a", 1, env)
    env["K"] = "changed"
    assert plan.env == {"K": "v"}
    assert build_plan(HOSTS, "a", 1).env == {}


def test_plan_to_json_shape():
    hosts = parse_hostfile("worker-1 slots=2\nworker-2:2222 slots=2")
    data = build_plan(hosts, "worker-1", 29500).to_json()
    assert {"world_size", "master_addr", "master_port", "nodes"} <= set(data)
    assert data["world_size"] == 4
    assert data["master_addr"] == "worker-1"
    assert data["master_port"] == 29500
    assert data["nodes"] == [
        {"host": "worker-1", "ssh_port": None, "slots": [0, 1], "ranks": [0, 1]},
        {"host": "worker-2", "ssh_port": 2222, "slots": [0, 1], "ranks": [2, 3]},
    ]
    assert json.loads(json.dumps(data)) == data                # plain JSON values only


@pytest.mark.parametrize("port", [0, -1, 65536, 70000])
def test_build_plan_rejects_bad_master_port(port):
    with pytest.raises(PlanError, match=f"--master_port {port}.*1-65535"):
        build_plan(HOSTS, "a", port)


@pytest.mark.parametrize("port", [1, 65535])
def test_build_plan_accepts_edge_ports(port):
    assert build_plan(HOSTS, "a", port).master_port == port


def test_build_plan_checks_master_addr():
    with pytest.raises(PlanError, match="master_port"):
        build_plan(HOSTS, "a:2222", 29500)


# --------------------------------------------------------------------------------------------
# check_master_addr

@pytest.mark.parametrize("addr", ["10.0.0.1", "worker-1", "node.example.com", "fe80::1", "::1",
                                  "2001:db8::2:1"])
def test_master_addr_accepted(addr):
    assert check_master_addr(addr) == addr


@pytest.mark.parametrize("addr", ["10.0.0.1:2222", "worker-1:22", "[fe80::1]:2222"])
def test_master_addr_with_port_is_explained(addr):
    with pytest.raises(PlanError) as info:
        check_master_addr(addr)
    message = str(info.value)
    port = addr.rsplit(":", 1)[1]
    assert f"--master_addr {addr}" in message
    assert f"without ':{port}'" in message
    assert "--master_port" in message
    assert "ssh port" in message


@pytest.mark.parametrize("addr", ["", "-x", "-oProxyCommand=x", "a b", "host\tname", "a\nb"])
def test_master_addr_rejected(addr):
    with pytest.raises(PlanError, match="is not a host name or address"):
        check_master_addr(addr)


# --------------------------------------------------------------------------------------------
# the command line: `crew plan`

TWO_NODES = "worker-1 slots=2\nworker-2:2222 slots=3 gpu=4,5,6\n"


def hostfile(folder: Path, text: str = TWO_NODES) -> str:
    path = folder / "hosts"
    path.write_text(text)
    return str(path)


def crew_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_json(here, capsys):
    code, out, err = crew_main(capsys, "plan", "--json", "-H", hostfile(here), "--master_addr",
                               "10.0.0.1", "--master_port", "29555", "--env", "K=a b",
                               "train.py", "--lr", "1")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["world_size"] == 5
    assert data["master_addr"] == "10.0.0.1"
    assert data["master_port"] == 29555
    assert data["launcher"] == "ssh"
    assert data["env"]["K"] == "a b"
    nodes = [{key: node[key] for key in ("host", "ssh_port", "slots", "ranks")}
             for node in data["nodes"]]
    assert nodes == [
        {"host": "worker-1", "ssh_port": None, "slots": [0, 1], "ranks": [0, 1]},
        {"host": "worker-2", "ssh_port": 2222, "slots": [4, 5, 6], "ranks": [2, 3, 4]},
    ]
    second = data["nodes"][1]["command"]
    assert second[0] == "ssh"
    assert second[second.index("-p") + 1] == "2222"
    assert "-p" not in data["nodes"][0]["command"]


@pytest.mark.parametrize("options, nodes", [
    (["--num_nodes", "1"], [("worker-1", [0, 1], [0, 1])]),
    (["--num-gpus", "1"], [("worker-1", [0], [0]), ("worker-2", [4], [1])]),
    (["--nproc_per_node", "2"], [("worker-1", [0, 1], [0, 1]), ("worker-2", [4, 5], [2, 3])]),
    (["-i", "worker-2:6@worker-1:1"], [("worker-1", [1], [0]), ("worker-2", [6], [1])]),
    (["--exclude", "worker-1"], [("worker-2", [4, 5, 6], [0, 1, 2])]),
])
def test_cli_plan_selection(here, capsys, options, nodes):
    code, out, _ = crew_main(capsys, "plan", "--json", "-H", hostfile(here), "--master_addr",
                             "m", *options)
    assert code == 0
    data = json.loads(out)
    assert [(n["host"], n["slots"], n["ranks"]) for n in data["nodes"]] == nodes
    assert data["world_size"] == sum(len(ranks) for _, _, ranks in nodes)


def test_cli_plan_without_hostfile_uses_visible_devices(here, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    code, out, _ = crew_main(capsys, "plan", "--json", "--num_gpus", "2")
    assert code == 0
    data = json.loads(out)
    assert data["launcher"] == "local"
    assert data["master_addr"] == "127.0.0.1"
    assert [(n["host"], n["slots"], n["ranks"]) for n in data["nodes"]] == [
        ("localhost", [4, 5], [0, 1])]


@pytest.mark.parametrize("num_gpus, words", [
    ("0", ["--num_gpus 0", "at least 1"]),
    ("-1", ["--num_gpus -1", "at least 1"]),
    ("4", ["--num_gpus 4", "only 3 GPU(s) visible"]),
])
def test_cli_bad_num_gpus_without_hostfile(here, capsys, monkeypatch, num_gpus, words):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    code, out, err = crew_main(capsys, "plan", "--json", "--num_gpus", num_gpus)
    assert (code, out) == (2, "")
    for word in words:
        assert word in err


def test_cli_plan_text(here, capsys):
    code, out, _ = crew_main(capsys, "plan", "-H", hostfile(here), "--master_addr", "m",
                             "--master_port", "1234")
    assert code == 0
    assert "5 rank(s) on 2 node(s)" in out
    assert "master m:1234" in out
    assert "node 1: worker-2 (ssh port 2222) → ranks 2-4 → devices 4,5,6" in out


@pytest.mark.parametrize("options, words", [
    (["--master_addr", "worker-1:2222"],
     ["--master_addr worker-1:2222", "--master_port", "ssh port"]),
    (["--master_addr", "m", "--include", "worker-3"], ["host 'worker-3' is not in the hostfile"]),
    (["--master_addr", "m", "--include", "worker-1", "--num_gpus", "1"],
     ["--num_nodes/--num_gpus"]),
    (["--master_addr", "m", "--num_nodes", "3"], ["--num_nodes 3", "only 2 host(s)"]),
    (["--master_addr", "m", "--launcher", "local"], ["--launcher local runs one node"]),
    (["--master_addr", "m", "--launcher", "standalone"], ["needs --node_rank"]),
    (["--master_addr", "m", "--launcher", "slurm"], ["--launcher slurm", "leave out --hostfile"]),
    (["--master_addr", "m", "--env", "1BAD=x"], ["--env 1BAD=x"]),
])
def test_cli_errors_are_one_message(here, capsys, options, words):
    code, out, err = crew_main(capsys, "plan", "-H", hostfile(here), *options)
    assert code == 2
    assert out == ""
    assert err.startswith("crew: error: ")
    assert "Traceback" not in err
    for word in words:
        assert word in err


def test_cli_missing_hostfile(here, capsys):
    code, _, err = crew_main(capsys, "plan", "-H", str(here / "missing"))
    assert code == 2
    assert err.startswith("crew: error: hostfile ")
    assert "not found" in err and "--hostfile" in err
    assert "Traceback" not in err


def test_cli_bad_hostfile_line(here, capsys):
    code, _, err = crew_main(capsys, "plan", "-H", hostfile(here, "a slots=2\nb slot=2\n"))
    assert code == 2
    assert "line 2" in err and "Did you mean 'slots=2'" in err


def test_cli_num_nodes_without_hostfile(here, capsys):
    code, _, err = crew_main(capsys, "plan", "--num_nodes", "2")
    assert code == 2
    assert "needs a --hostfile" in err


def test_cli_pdsh_missing(here, capsys, monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: None)
    code, _, err = crew_main(capsys, "plan", "-H", hostfile(here), "--master_addr", "m",
                             "--launcher", "pdsh")
    assert code == 2
    assert err.startswith("crew: error: --launcher pdsh")
    assert "apt-get install pdsh" in err
    assert "Traceback" not in err


def test_cli_module_and_no_python_conflict(here, capsys):
    code, _, err = crew_main(capsys, "plan", "--module", "--no_python", "x")
    assert code == 2
    assert "--module and --no_python" in err


@pytest.mark.parametrize("argv", [
    ["--num_gpus", "3", "--master_addr", "m", "--master_port", "5", "--log_dir", "L"],
    ["--num-gpus", "3", "--master-addr", "m", "--master-port", "5", "--log-dir", "L"],
    ["--nproc_per_node", "3", "--master_addr", "m", "--master_port", "5",
     "--enable_each_rank_log", "L"],
])
def test_cli_accepts_deepspeed_and_dashed_spellings(here, argv):
    args = cli.build_parser().parse_args(["plan", *argv])
    assert (args.num_gpus, args.master_addr, args.master_port, args.log_dir) == (3, "m", 5, "L")


def test_cli_crew_env_defaults(here, monkeypatch):
    monkeypatch.setenv("CREW_HOSTFILE", "/h")
    monkeypatch.setenv("CREW_NUM_GPUS", "2")
    monkeypatch.setenv("CREW_NO_LOCAL_RANK", "yes")
    args = cli.build_parser().parse_args(["plan"])
    assert (args.hostfile, args.num_gpus, args.no_local_rank) == ("/h", 2, True)


# `crew plan` starts fast: nothing on the launching side imports torch.

def _imported_modules(importtime_stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_crew_plan_does_not_import_torch(here):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "crew", "plan", "-H",
                           hostfile(here), "--master_addr", "m"],
                          capture_output=True, text=True, timeout=60, cwd=here)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "5 rank(s) on 2 node(s)" in proc.stdout
    modules = _imported_modules(proc.stderr)
    assert "crew.cli" in modules                               # the parse found the imports
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert seconds < 10, f"crew plan took {seconds:.1f}s"


def test_crew_entry_point_and_agent_do_not_import_torch(here):
    script = ("import sys, crew.cli, crew.launcher.node.agent; "
              f"code = crew.cli.main(['plan', '-H', {hostfile(here)!r}, '--master_addr', 'm']); "
              "assert code == 0, code; "
              "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=here)
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = Path(sys.executable).with_name("crew")
    if entry.exists():
        proc = subprocess.run([str(entry), "plan", "-H", hostfile(here), "--master_addr", "m"],
                              capture_output=True, text=True, timeout=60, cwd=here)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "worker-2 (ssh port 2222)" in proc.stdout
