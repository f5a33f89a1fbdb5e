"""`crew run` across "nodes": real sshd on 127.0.0.2 and 127.0.0.3, through the real ssh runner."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess

import pytest
from conftest import STEPPER, crew, start_crew, wait_for_file, wait_until_gone, write_script
from sshnodes import _keygen

ALL_REDUCE = """
    import json, os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE",
                                       "CUDA_VISIBLE_DEVICES", "CREW_HOST", "MASTER_ADDR")}
    seen["sum"] = value.item()
    json.dump(seen, open(f"rank{dist.get_rank()}.json", "w"))
    dist.destroy_process_group()
    from crew import outputs  # what the engine calls on rank 0 when it saves
    outputs.report("checkpoint", "ckpt", tag=f"global_step{os.environ['RANK']}")
"""
# What a rank was started with, without torch (a test that asserts no collective needs no torch start-up)
SHOW_ENV = """
    import json, os
    seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
                                       "CREW_HOST", "MASTER_ADDR")}
    json.dump(seen, open(f"rank{os.environ['RANK']}.json", "w"))
"""

def ssh_run(cluster, *args, **kwargs):
    return crew("run", "--ssh_args", cluster.ssh_args, *args, **kwargs)


def ranks(folder, world_size):
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_two_nodes_two_ranks_all_reduce(cluster, job_dir):
    write_script(job_dir, "reduce.py", ALL_REDUCE)
    result = ssh_run(cluster, "-H", str(cluster.hostfile(slots=2)), "reduce.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = ranks(job_dir, 4)
    assert [s["sum"] for s in seen] == [10.0] * 4  # 1 + 2 + 3 + 4
    assert [s["CREW_HOST"] for s in seen] == ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2
    assert [s["NODE_RANK"] for s in seen] == ["0", "0", "1", "1"]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1"]
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.2"}
    assert "launcher ssh" in result.err and "connect" in result.err
    assert re.fullmatch(r"crew: job \w+ succeeded · 4 ranks on 2 nodes · \d+\.\d s · checkpoint ckpt/global_step0 "
                        r"on 127\.0\.0\.2", result.err.strip().splitlines()[-1])


def test_extended_hostfile_with_ports_and_device_ids(cluster, job_dir):
    hostfile = job_dir / "hosts"
    hostfile.write_text(f"# docker-style: mapped ssh ports, chosen devices\n"
                        f"127.0.0.2:{cluster.port} slots=2 gpu=1,3\n"
                        f"127.0.0.3:{cluster.port} slots=1 gpu=5   # one device here\n")
    write_script(job_dir, "reduce.py", ALL_REDUCE)
    result = ssh_run(cluster, "-H", str(hostfile), "reduce.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = ranks(job_dir, 3)
    assert [s["CUDA_VISIBLE_DEVICES"] for s in seen] == ["1,3", "1,3", "5"]
    assert [s["sum"] for s in seen] == [6.0] * 3


def test_include_selects_hosts_and_devices(cluster, job_dir):
    write_script(job_dir, "show.py", SHOW_ENV)
    result = ssh_run(cluster, "-H", str(cluster.hostfile(slots=2)),
                     "--include", "127.0.0.2:1@127.0.0.3", "show.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = ranks(job_dir, 3)
    assert [(s["CREW_HOST"], s["CUDA_VISIBLE_DEVICES"]) for s in seen] == [
        ("127.0.0.2", "1"), ("127.0.0.3", "0,1"), ("127.0.0.3", "0,1")]


def test_deepspeed_env_reaches_remote_ranks_literally(cluster, job_dir):
    marker = job_dir / "INJECTED"
    (job_dir / ".deepspeed_env").write_text(
        f"TRICKY=it's \"quoted\" $(touch {marker}) `touch {marker}`; echo x\nSPACED=a   b\n")
    write_script(job_dir, "show.py", """
        import json, os
        keys = ("TRICKY", "SPACED", "NCCL_FAKE", "FROM_FLAG")
        json.dump({k: os.environ.get(k) for k in keys}, open(f"rank{os.environ['RANK']}.json", "w"))
    """)
    result = ssh_run(cluster, "-H", str(cluster.hostfile(slots=1)), "--env", "FROM_FLAG=$HOME",
                     "show.py", cwd=job_dir, env={"NCCL_FAKE": "x y'z"})
    assert result.code == 0, result.err
    expected = {"TRICKY": f"it's \"quoted\" $(touch {marker}) `touch {marker}`; echo x",
                "SPACED": "a   b", "NCCL_FAKE": "x y'z", "FROM_FLAG": "$HOME"}
    assert ranks(job_dir, 2) == [expected, expected]
    assert not marker.exists()


def test_remote_failure_stops_every_node(cluster, job_dir):
    write_script(job_dir, "step.py", STEPPER)
    result = ssh_run(cluster, "-H", str(cluster.hostfile(slots=2)), "--env", "FAIL_RANK=3",
                     "step.py", cwd=job_dir)
    assert result.code == 7
    assert result.seconds < 15
    assert "127.0.0.3 rank 3 (local 1) exited with code 7 (first failure)" in result.err
    assert "fatal: rank 3 gives up at step 3" in result.err.split("first failure")[1]


PDSH = pytest.mark.skipif(not shutil.which("pdsh"), reason="pdsh not installed (apt-get install pdsh)")


@pytest.mark.parametrize("launcher", ["ssh", pytest.param("pdsh", marks=PDSH)])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupting_the_launcher_stops_every_node(cluster, job_dir, sig, launcher):
    write_script(job_dir, "step.py", STEPPER)
    proc = start_crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=2)),
                      "--launcher", launcher, "step.py", cwd=job_dir)
    for rank in range(4):
        wait_for_file(job_dir / f"started{rank}")
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode == (130 if sig == signal.SIGINT else -9)
    assert not wait_until_gone(job_dir, timeout=15)


def test_dropped_ssh_connection_stops_that_nodes_ranks(cluster, job_dir):
    write_script(job_dir, "step.py", STEPPER)
    proc = start_crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                      "step.py", cwd=job_dir)
    for rank in range(2):
        wait_for_file(job_dir / f"started{rank}")
    ssh_clients = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "^ssh .*127.0.0.3"],
                                 capture_output=True, text=True).stdout.split()
    assert ssh_clients, "no ssh client to 127.0.0.3 found"
    subprocess.run(["kill", "-9", *ssh_clients], check=True)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "127.0.0.3: the crew agent ended with code" in err
    assert not wait_until_gone(job_dir, timeout=15)


# The next three skip the preflight, which would refuse first (tests/test_doctor.py): the agents'
# own reports are what a standalone or --skip_preflight run gets.
def test_unreachable_node_is_reported_with_the_fix(cluster, job_dir):
    hostfile = job_dir / "hosts"
    hostfile.write_text(f"127.0.0.2:{cluster.port} slots=1\n127.0.0.9:{cluster.port} slots=1\n")
    write_script(job_dir, "step.py", STEPPER)
    result = ssh_run(cluster, "--skip_preflight", "-H", str(hostfile), "step.py", cwd=job_dir)
    assert result.code == 255
    assert "127.0.0.9: the crew agent ended with code 255" in result.err
    assert "Connection refused" in result.err and "Start sshd on 127.0.0.9" in result.err


def test_unauthorised_key_is_reported_with_ssh_copy_id(cluster, job_dir):
    _keygen(job_dir / "stranger_key")
    config = job_dir / "stranger_config"
    config.write_text(cluster.config.read_text().replace(
        str(cluster.root / "client_key"), str(job_dir / "stranger_key")))
    write_script(job_dir, "step.py", STEPPER)
    result = crew("run", "--skip_preflight", "--ssh_args", f"-F {config}", "-H",
                  str(cluster.hostfile(slots=1)), "step.py", cwd=job_dir)
    assert result.code == 255
    assert re.search(rf"ssh-copy-id -p {cluster.port} 127\.0\.0\.[23]'", result.err)


def test_code_missing_on_a_node_is_named(cluster, job_dir):
    write_script(job_dir, "reduce.py", ALL_REDUCE)
    result = ssh_run(cluster, "--skip_preflight", "-H", str(cluster.hostfile(slots=1)), "not_copied.py",
                     cwd=job_dir)
    assert result.code == 1
    assert re.search(r"not_copied.py not found on 127\.0\.0\.[23]\. Copy the code", result.err)


@PDSH
def test_pdsh_runner_all_reduce(cluster, job_dir):
    write_script(job_dir, "reduce.py", ALL_REDUCE)
    result = ssh_run(cluster, "--launcher", "pdsh", "-H", str(cluster.hostfile(slots=2)),
                     "reduce.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = ranks(job_dir, 4)
    assert [s["sum"] for s in seen] == [10.0] * 4
    assert [s["CREW_HOST"] for s in seen] == ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2


@PDSH
def test_pdsh_runner_failure_stops_every_node(cluster, job_dir):
    write_script(job_dir, "step.py", STEPPER)
    result = ssh_run(cluster, "--launcher", "pdsh", "-H", str(cluster.hostfile(slots=2)),
                     "--env", "FAIL_RANK=1", "step.py", cwd=job_dir)
    assert result.code == 7
    assert "127.0.0.2 rank 1 (local 1) exited with code 7 (first failure)" in result.err


def test_standalone_nodes_started_by_hand(cluster, job_dir):
    write_script(job_dir, "reduce.py", ALL_REDUCE)
    hostfile = str(cluster.hostfile(slots=1))
    common = ["--launcher", "standalone", "-H", hostfile, "--master_addr", "127.0.0.1"]
    port = crew("plan", "--json", cwd=job_dir).out  # any free port will do
    port = str(json.loads(port)["master_port"])
    procs = [start_crew("run", *common, "--master_port", port, "--node_rank", str(k), "reduce.py",
                        cwd=job_dir) for k in (0, 1)]
    for proc in procs:
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    assert [s["sum"] for s in ranks(job_dir, 2)] == [3.0, 3.0]
    assert [s["NODE_RANK"] for s in ranks(job_dir, 2)] == ["0", "1"]
