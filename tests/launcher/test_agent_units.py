"""The agent's pure parts: a rank's environment and argv, preflight messages (line splitting: test_streams)."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from crew.launcher.plan.ports import free_port
from crew.launcher.node.agent import preflight, rank_argv, rank_env
from crew.launcher.transport.protocol import JobSpec, NodeSpec


# --------------------------------------------------------------------------------------------
# rank_env / rank_argv

def make_job(**fields) -> JobSpec:
    values = dict(
        job_id="abc123",
        nodes=(NodeSpec("n0", (0, 1), (0, 1)), NodeSpec("n1", (2, 3), (2, 3)),
               NodeSpec("n2", (5,), (4,))),
        master_addr="10.1.2.3", master_port=29511, program=("train.py", "--lr", "0.1"),
        cwd="/nonexistent/crew-test-dir", env={"FROM_JOB": "job"})
    values.update(fields)
    return JobSpec(**values)


@pytest.mark.parametrize("node_rank, local_rank, expected", [
    (0, 0, {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
            "GROUP_RANK": "0", "CUDA_VISIBLE_DEVICES": "0,1", "CREW_HOST": "n0"}),
    (1, 1, {"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1",
            "GROUP_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3", "CREW_HOST": "n1"}),
    (2, 0, {"RANK": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "2",
            "GROUP_RANK": "2", "CUDA_VISIBLE_DEVICES": "5", "CREW_HOST": "n2"}),
])
def test_rank_env(node_rank, local_rank, expected):
    base = {"PATH": "/bin", "RANK": "99", "CUDA_VISIBLE_DEVICES": "7", "FROM_JOB": "base"}
    env = rank_env(make_job(), node_rank, local_rank, base)
    for key, value in {**expected, "WORLD_SIZE": "5", "GROUP_WORLD_SIZE": "3",
                       "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511",
                       "CREW_JOB_ID": "abc123", "PATH": "/bin", "FROM_JOB": "job",
                       "PYTHONUNBUFFERED": "1"}.items():
        assert env[key] == value, key
    assert all(isinstance(v, str) for v in env.values())
    assert base["RANK"] == "99"                                # the caller's dict is untouched


def test_rank_env_omp_default_divides_the_cores():
    cores = len(os.sched_getaffinity(0))
    env_two = rank_env(make_job(), 0, 0, {})                   # 2 ranks on node 0
    env_one = rank_env(make_job(), 2, 0, {})                   # 1 rank on node 2
    assert env_two["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert env_one["OMP_NUM_THREADS"] == str(cores)


@pytest.mark.parametrize("where", ["base", "job"])
def test_rank_env_user_omp_kept(where):
    base = {"OMP_NUM_THREADS": "7"} if where == "base" else {}
    job = make_job(env={"OMP_NUM_THREADS": "7"} if where == "job" else {})
    assert rank_env(job, 0, 0, base)["OMP_NUM_THREADS"] == "7"


def test_rank_env_turns_faulthandler_on_unless_the_user_chose():
    assert rank_env(make_job(), 0, 0, {})["PYTHONFAULTHANDLER"] == "1"   # stacks of stuck ranks
    assert rank_env(make_job(), 0, 0, {"PYTHONFAULTHANDLER": ""})["PYTHONFAULTHANDLER"] == ""
    assert rank_env(make_job(env={"PYTHONFAULTHANDLER": "0"}), 0, 0, {})["PYTHONFAULTHANDLER"] == "0"


def test_rank_env_restart_count():
    assert rank_env(make_job(restart_count=2), 0, 0, {})["CREW_RESTART_COUNT"] == "2"


@pytest.mark.parametrize("mode, local_rank_arg, local_rank, expected", [
    ("python", True, 1, [sys.executable, "-u", "train.py", "--local_rank=1", "--lr", "0.1"]),
    ("python", False, 1, [sys.executable, "-u", "train.py", "--lr", "0.1"]),
    ("module", True, 0, [sys.executable, "-u", "-m", "train.py", "--local_rank=0", "--lr",
                         "0.1"]),
    ("module", False, 0, [sys.executable, "-u", "-m", "train.py", "--lr", "0.1"]),
    ("exec", True, 3, ["train.py", "--local_rank=3", "--lr", "0.1"]),
    ("exec", False, 3, ["train.py", "--lr", "0.1"]),
])
def test_rank_argv(mode, local_rank_arg, local_rank, expected):
    job = make_job(mode=mode, local_rank_arg=local_rank_arg)
    assert rank_argv(job, local_rank) == expected


def test_rank_argv_script_without_arguments():
    assert rank_argv(make_job(program=("x.py",)), 0) == [sys.executable, "-u", "x.py",
                                                         "--local_rank=0"]


# --------------------------------------------------------------------------------------------
# preflight

@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def test_preflight_all_well(workdir):
    assert preflight(make_job(cwd=str(workdir), master_port=free_port()), 0) is None


def test_preflight_missing_cwd(tmp_path):
    missing = tmp_path / "gone"
    message = preflight(make_job(cwd=str(missing)), 1)
    assert f"working directory {missing} does not exist on n1" in message
    assert "copy the code to the same path on n1" in message


@pytest.mark.parametrize("node_rank", [0, 2])
def test_preflight_missing_script(tmp_path, node_rank):
    message = preflight(make_job(cwd=str(tmp_path), program=("nope.py", "--x")), node_rank)
    host = make_job().nodes[node_rank].host
    assert f"script {tmp_path / 'nope.py'} not found on {host}" in message
    assert "every node" in message


@pytest.mark.parametrize("mode", ["module", "exec"])
def test_preflight_does_not_look_for_a_script_file(tmp_path, mode):
    job = make_job(cwd=str(tmp_path), program=("pkg.mod",), mode=mode, master_port=free_port())
    assert preflight(job, 0) is None


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_preflight_master_port_in_use(workdir, busy_port):
    message = preflight(make_job(cwd=str(workdir), master_port=busy_port), 0)
    assert f"master port {busy_port} is already in use on n0" in message
    assert "--master_port" in message


def test_preflight_port_only_checked_on_node_zero(workdir, busy_port):
    assert preflight(make_job(cwd=str(workdir), master_port=busy_port), 1) is None
