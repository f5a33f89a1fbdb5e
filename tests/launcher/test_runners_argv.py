"""Runner argv: ssh and pdsh command lines, and shell safety of the remote command text."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from crew.errors import LaunchError
from crew.launcher.transport import runners
from crew.launcher.transport.protocol import AGENT_MODULE, JobSpec, NodeSpec

NASTY = "a b 'single' \"double\" $(touch {marker}) `touch {marker}` ; touch {marker} & $HOME \\ \n"


def make_job(hosts=("w1", "w2"), cwd="/work/job", env=None, **fields) -> JobSpec:
    nodes, rank = [], 0
    for host in hosts:
        nodes.append(NodeSpec(host, (0, 1), (rank, rank + 1)))
        rank += 2
    return JobSpec(job_id="j0b1d", nodes=tuple(nodes), master_addr="10.0.0.1",
                   master_port=29500, program=("train.py", "--lr", "0.1"), cwd=cwd,
                   env=dict(env or {}), **fields)


@pytest.fixture
def pdsh_installed(monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: f"/usr/bin/{name}")


def option_values(argv, flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


# --------------------------------------------------------------------------------------------
# ssh

@pytest.mark.parametrize("port", [None, 2222])
def test_ssh_argv(port):
    job = make_job(hosts=("w1",))
    (launch,) = runners.ssh_launches(job, "/opt/py/bin/python", [port])
    argv = list(launch.argv)
    assert argv[0] == "ssh"
    assert "BatchMode=yes" in option_values(argv, "-o")
    assert option_values(argv, "-p") == ([str(port)] if port else [])
    assert argv[-3:-1] == ["--", "w1"]
    assert argv.index("--") > max((i for i, a in enumerate(argv) if a.startswith("-")
                                   and a != "--"), default=0)
    assert not any("StrictHostKeyChecking" in arg for arg in argv)
    assert launch.node_ranks == (0,)
    assert launch.label == "w1"
    assert launch.spec_on_stdin


def test_ssh_one_launch_per_node_with_own_port_and_rank():
    job = make_job(hosts=("w1", "w2", "w3"))
    launches = runners.ssh_launches(job, "python3", [None, 2201, 2202],
                                    ssh_args=["-F", "cfg", "-i", "key"])
    assert [l.node_ranks for l in launches] == [(0,), (1,), (2,)]
    assert [l.argv[-2] for l in launches] == ["w1", "w2", "w3"]
    assert [option_values(l.argv, "-p") for l in launches] == [[], ["2201"], ["2202"]]
    for node_rank, launch in enumerate(launches):
        argv = list(launch.argv)
        assert argv[argv.index("-F") + 1] == "cfg"                # user ssh args kept, in order
        assert argv.index("-F") < argv.index("--")
        remote = shlex.split(argv[-1])
        assert remote[remote.index("--node_rank") + 1] == str(node_rank)
        assert remote[remote.index("--job") + 1] == "j0b1d"
        assert remote[remote.index("-c") + 1] == runners.entry(AGENT_MODULE)


def test_remote_command_shape():
    job = make_job(cwd="/data/my job", env={"PYTHONPATH": "/src dir"})
    text = runners.remote_command("/usr/bin/python3", job, 1)
    assert shlex.split(text) == [
        "cd", "/data/my job;", "exec", "env", "PYTHONPATH=/src dir", "/usr/bin/python3", "-u",
        "-c", runners.entry(AGENT_MODULE), "--job", "j0b1d", "--node_rank", "1"]


def test_remote_command_without_pythonpath_sets_none():
    text = runners.remote_command("python3", make_job(env={"OTHER": "1"}), 0)
    assert "PYTHONPATH" not in text
    assert "OTHER" not in text                                 # env travels in the spec only


# --------------------------------------------------------------------------------------------
# shell safety: run the remote text under bash with a fake python that records what it got

def _fake_python(folder: Path, record: Path) -> Path:
    script = folder / "fake python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'pythonpath': os.environ.get('PYTHONPATH'),\n"
        f"           'cwd': os.getcwd()}}, open({str(record)!r}, 'w'))\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def marker():
    path = Path(f"/tmp/PWNED_{uuid.uuid4().hex}")
    yield path
    ran = path.exists()
    path.unlink(missing_ok=True)
    assert not ran, f"the remote command ran the touch of {path}"


def _remote_shell_argv(launcher: str, job: JobSpec, python: str) -> list[str]:
    if launcher == "ssh":
        (launch,) = runners.ssh_launches(job, python, [None])
        return ["bash", "-c", launch.argv[-1]]
    (launch,) = runners.pdsh_launches(job, python, [None])
    return ["bash", "-c", launch.argv[-1].replace("%n", "0")]  # what pdsh does for node 0


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_remote_command_is_shell_safe(tmp_path, marker, launcher, pdsh_installed):
    nasty = NASTY.format(marker=marker)
    cwd = tmp_path / "job" / nasty                             # its '/'s make subdirectories
    cwd.mkdir(parents=True)
    record = tmp_path / "record.json"
    python = _fake_python(tmp_path, record)
    pythonpath = f"{cwd}:{nasty}"
    job = make_job(hosts=("w1",), cwd=str(cwd), env={"PYTHONPATH": pythonpath, "X": nasty})
    subprocess.run(_remote_shell_argv(launcher, job, str(python)), check=True, timeout=30,
                   cwd=tmp_path)
    got = json.loads(record.read_text())
    assert got["cwd"] == str(cwd)
    assert got["pythonpath"] == pythonpath
    head = ["-u", "-c", runners.entry(AGENT_MODULE), "--job", "j0b1d", "--node_rank", "0"]
    assert got["argv"][:len(head)] == head
    if launcher == "pdsh":
        spec = got["argv"][got["argv"].index("--spec_b64") + 1]
        assert JobSpec.from_b64(spec) == job
    assert not marker.exists()


def test_remote_command_missing_cwd_still_starts_the_agent(tmp_path):
    record = tmp_path / "record.json"
    python = _fake_python(tmp_path, record)
    job = make_job(hosts=("w1",), cwd=str(tmp_path / "absent"))
    subprocess.run(["bash", "-c", runners.remote_command(str(python), job, 0)], check=True,
                   cwd=tmp_path, capture_output=True, timeout=30)
    assert json.loads(record.read_text())["argv"][-1] == "0"


# --------------------------------------------------------------------------------------------
# pdsh

def test_pdsh_argv(pdsh_installed):
    job = make_job(hosts=("w1", "w2", "w3"), env={"PYTHONPATH": "/src", "K": "v w"})
    (launch,) = runners.pdsh_launches(job, "python3", [2222, 2222, 2222], ssh_args=["-F", "c"])
    argv = list(launch.argv)
    assert argv[0] == "pdsh"
    assert option_values(argv, "-w") == ["w1,w2,w3"]
    assert option_values(argv, "-R") == ["ssh"]
    assert launch.node_ranks == (0, 1, 2)
    assert launch.label == "pdsh"
    assert not launch.spec_on_stdin
    remote = shlex.split(argv[-1])
    assert remote[remote.index("--node_rank") + 1] == "%n"
    assert remote[remote.index("--watch") + 1] == "stdout"
    assert JobSpec.from_b64(remote[remote.index("--spec_b64") + 1]) == job
    ssh = shlex.split(launch.env["PDSH_SSH_ARGS_APPEND"])
    assert option_values(ssh, "-p") == ["2222"]
    assert "BatchMode=yes" in option_values(ssh, "-o")
    assert ssh[ssh.index("-F") + 1] == "c"
    assert not any("StrictHostKeyChecking" in arg for arg in [*argv, *ssh])


def test_pdsh_hosts_in_plan_order(pdsh_installed):
    job = make_job(hosts=("zeta", "alpha", "mid"))
    (launch,) = runners.pdsh_launches(job, "python3", [None] * 3)
    assert option_values(launch.argv, "-w") == ["zeta,alpha,mid"]
    assert "-p" not in shlex.split(launch.env["PDSH_SSH_ARGS_APPEND"])


@pytest.mark.parametrize("ports", [[22, 2222], [None, 2222], [2222, None, 2222]])
def test_pdsh_different_ports_per_host(pdsh_installed, ports):
    job = make_job(hosts=[f"h{i}" for i in range(len(ports))])
    with pytest.raises(LaunchError) as info:
        runners.pdsh_launches(job, "python3", ports)
    message = str(info.value)
    assert "~/.ssh/config" in message
    assert "--launcher ssh" in message


def test_pdsh_missing(monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: None)
    with pytest.raises(LaunchError) as info:
        runners.pdsh_launches(make_job(), "python3", [None, None])
    message = str(info.value)
    assert "pdsh is not installed" in message
    assert "apt-get install pdsh" in message
    assert "--launcher ssh" in message


def test_local_launch_argv():
    job = make_job(hosts=("localhost",))
    (launch,) = runners.local_launches(job, "/py", 0)
    assert launch.argv == ("/py", "-u", "-c", runners.entry(AGENT_MODULE), "--job", "j0b1d", "--node_rank", "0")
    assert launch.node_ranks == (0,)
    assert launch.label == "localhost"


# --------------------------------------------------------------------------------------------
# JobSpec wire format

@pytest.mark.parametrize("fields", [
    {},
    {"mode": "module", "local_rank_arg": False, "log_dir": "/logs", "grace_s": 0.5,
     "restart_count": 3},
    {"env": {"A": "line1\nline2", "B": "ünïcödé", "C": "$(x) `y` 'z' \"w\""}},
    {"bind_cores": True, "bind_core_list": "1,3-5", "save_pid": 4242},
])
def test_jobspec_round_trip(fields):
    job = make_job(**fields)
    line = job.to_line()
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1                               # one line, whatever the values
    assert JobSpec.from_json(line) == job
    assert JobSpec.from_json(line.decode()) == job
    assert JobSpec.from_b64(job.to_b64()) == job
    assert JobSpec.from_json(line).nodes[1].slots == (0, 1)     # tuples again, not lists


def test_jobspec_from_an_older_launcher_takes_the_defaults():
    data = json.loads(make_job().to_line())
    for name in ("bind_cores", "bind_core_list", "save_pid"):
        del data[name]
    job = JobSpec.from_json(json.dumps(data))
    assert (job.bind_cores, job.bind_core_list, job.save_pid) == (False, None, 0)


def test_jobspec_world_size():
    assert make_job(hosts=("a", "b", "c")).world_size == 6
