"""`--launcher slurm`: one srun starts every node's agent. Real slurmctld, slurmd and munged
(tests/slurmcluster.py: two nodes, 127.0.0.2 and 127.0.0.3, on this machine), plus the pieces that need
no cluster: the allocation's variables, the srun command line, node ranks and long output lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import slurmcluster
from conftest import crew_command, wait_for_file, wait_until_gone, write_script

from crew import cli
from crew.errors import LaunchError, PlanError
from crew.launcher.transport import runners
from crew.launcher.plan import slurm
from crew.launcher.transport.proc import children
from crew.launcher.transport.protocol import (SLURM_NODE_RANK, JobSpec, NodeSpec, slurm_node, split_long_lines,
                                    whole_lines)

NODES = ["127.0.0.2", "127.0.0.3"]
LONG = "x" * 3000  # srun cuts lines over 1 KiB into messages that interleave between nodes

ALL_REDUCE = f"""
    import json, os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    seen = {{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "CREW_HOST",
                                          "SLURMD_NODENAME", "MASTER_ADDR")}}
    seen["sum"] = value.item()
    json.dump(seen, open(f"rank{{dist.get_rank()}}.json", "w"))
    print(f"rank {{dist.get_rank()}} {LONG}")
    print(f"err {{dist.get_rank()}} {LONG}", file=sys.stderr)
    dist.destroy_process_group()
"""

# Node 1's second rank fails with code 3 once every rank has started; the others would sleep a minute.
FAIL_ON_NODE_1 = """
    import os, sys, time
    rank = int(os.environ["RANK"])
    open(f"started{rank}", "w").close()
    while rank == 3 and sum(os.path.exists(f"started{r}") for r in range(4)) < 4:
        time.sleep(0.05)
    if rank == 3:
        print("rank 3 gives up", file=sys.stderr)
        sys.exit(3)
    time.sleep(60)
"""

SLEEPER = """
    import os, time
    open(f"started{os.environ['RANK']}", "w").close()
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One two-node Slurm cluster for the whole module (it starts in about 1.5 s)."""
    reason = slurmcluster.slurm_missing_reason()
    if reason:
        pytest.skip(reason)
    nodes = slurmcluster.start_cluster(tmp_path_factory.mktemp("slurm"), nodes=2, loopback_names=True)
    yield nodes
    nodes.stop()


def salloc_argv(*crew_args: str) -> list[str]:
    return ["salloc", "--quiet", "-N2", *crew_command(*crew_args)]


def salloc(cluster, *crew_args: str, cwd, timeout: float = 90) -> subprocess.CompletedProcess:
    """`salloc -N2 crew ARGS`: crew in the allocation's shell, as a user types it."""
    return subprocess.run(salloc_argv(*crew_args), cwd=cwd, env=cluster.env(), capture_output=True,
                          text=True, timeout=timeout)


def rank_files(folder, world_size: int) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]


def crew_child(pid: int) -> int:
    """The crew process under salloc, which gets the SIGINT a terminal would send it on Ctrl-C."""
    (child,) = [c for c in children(pid) if b"crew" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return child


def no_steps_left(cluster) -> bool:
    deadline = time.monotonic() + 10
    while cluster.run("squeue", "-h", "-s").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not cluster.run("squeue", "-h", "-s").stdout.strip()


# -- against the cluster ---------------------------------------------------------------------------------

def test_salloc_two_nodes_all_reduce_with_whole_long_lines(cluster, job_dir):
    write_script(job_dir, "reduce.py", ALL_REDUCE)
    done = salloc(cluster, "run", "--num_gpus", "2", "reduce.py", cwd=job_dir)
    assert done.returncode == 0, done.stderr
    seen = rank_files(job_dir, 4)
    assert [s["sum"] for s in seen] == [10.0] * 4  # gloo across both nodes: 1 + 2 + 3 + 4
    assert [s["CREW_HOST"] for s in seen] == [NODES[0]] * 2 + [NODES[1]] * 2
    assert [s["SLURMD_NODENAME"] for s in seen] == [s["CREW_HOST"] for s in seen]  # each on its own node
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1"]
    assert [s["NODE_RANK"] for s in seen] == ["0", "0", "1", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"4"} and {s["MASTER_ADDR"] for s in seen} == {NODES[0]}
    assert "launcher slurm" in done.stderr and "preflight: 2 node(s) agree" in done.stderr
    for rank in range(4):  # each 3 KiB line arrives whole, however the nodes' output interleaved
        host = NODES[rank // 2]
        assert f"[{host}:{rank}] rank {rank} {LONG}\n" in done.stdout
        assert f"[{host}:{rank}] err {rank} {LONG}\n" in done.stderr
    assert "\x1e" not in done.stdout + done.stderr


def test_plan_json_shows_the_allocation_and_filters_trim_it(cluster, job_dir):
    done = salloc(cluster, "plan", "--launcher", "slurm", "--json", "--num_gpus", "2", cwd=job_dir)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["launcher"] == "slurm" and plan["world_size"] == 4 and plan["master_addr"] == NODES[0]
    assert [(n["host"], n["slots"], n["ranks"]) for n in plan["nodes"]] == [
        (NODES[0], [0, 1], [0, 1]), (NODES[1], [0, 1], [2, 3])]
    command = plan["nodes"][0]["command"]
    assert command[0] == "srun" and f"--nodelist={','.join(NODES)}" in command
    assert command[command.index("--node_rank") + 1] == SLURM_NODE_RANK
    excluded = json.loads(salloc(cluster, "plan", "--json", "--exclude", NODES[0], cwd=job_dir).stdout)
    assert [(n["host"], n["ranks"]) for n in excluded["nodes"]] == [(NODES[1], [0])]
    assert excluded["master_addr"] == NODES[1]
    first = json.loads(salloc(cluster, "plan", "--json", "--num_nodes", "1", cwd=job_dir).stdout)
    assert [n["host"] for n in first["nodes"]] == [NODES[0]]
    unknown = salloc(cluster, "plan", "--include", "127.0.0.9", cwd=job_dir)
    assert unknown.returncode == 2 and "not in the allocation (SLURM_JOB_NODELIST)" in unknown.stderr


def test_a_failing_rank_on_node_1_stops_every_node_and_sets_the_exit_code(cluster, job_dir):
    write_script(job_dir, "fail.py", FAIL_ON_NODE_1)
    started = time.monotonic()
    done = salloc(cluster, "run", "--num_gpus", "2", "fail.py", cwd=job_dir)
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - started < 30  # the other three ranks did not sleep out their minute
    assert f"{NODES[1]} rank 3 (local 1) exited with code 3 (first failure)" in done.stderr
    assert "rank 3 gives up" in done.stderr
    assert "srun: error" not in done.stderr  # srun's own account of its tasks' ends: crew said it
    assert wait_until_gone(job_dir) == []
    assert no_steps_left(cluster)


def sleeping_job(cluster, job_dir, interrupt) -> tuple[int, str]:
    """`salloc -N2 crew run` of 4 sleeping ranks; once all have started, `interrupt(salloc's pid)`. Returns
    salloc's exit code (crew's) and crew's stderr."""
    write_script(job_dir, "sleep.py", SLEEPER)
    proc = subprocess.Popen(salloc_argv("run", "--num_gpus", "2", "sleep.py"), cwd=job_dir,
                            env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for rank in range(4):
            wait_for_file(job_dir / f"started{rank}", timeout=60)
        interrupt(proc.pid)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def test_ctrl_c_stops_every_rank_on_every_node(cluster, job_dir):
    code, err = sleeping_job(cluster, job_dir, lambda pid: os.kill(crew_child(pid), signal.SIGINT))
    assert code == 130, err
    assert "SIGINT received: stopping every rank on every node" in err
    assert wait_until_gone(job_dir) == []
    assert no_steps_left(cluster)


def test_scancel_is_no_success(cluster, job_dir):
    """Slurm SIGTERMs the agents (scancel, a time limit): they stop their ranks, and crew says so."""
    def scancel(_pid: int) -> None:
        (job_id,) = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
        cluster.run("scancel", job_id)

    code, err = sleeping_job(cluster, job_dir, scancel)
    assert code == 143, err
    assert "the crew agent stopped every rank there (SIGTERM) without crew asking" in err
    assert wait_until_gone(job_dir) == []


def test_an_agent_killed_without_a_word_is_named_and_the_other_node_stopped(cluster, job_dir):
    """srun does not end the step for it (--kill-on-bad-exit=0): crew reads srun's line on the task."""
    write_script(job_dir, "kill.py", FAIL_ON_NODE_1.replace(
        "sys.exit(3)", "import signal; time.sleep(0.2); os.kill(os.getppid(), signal.SIGKILL)"))
    done = salloc(cluster, "run", "--num_gpus", "2", "kill.py", cwd=job_dir)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    assert f"{NODES[1]}: the crew agent ended (srun: Killed) before its ranks finished." in done.stderr
    assert wait_until_gone(job_dir) == []
    assert no_steps_left(cluster)


def test_sbatch_script_runs_crew_once(cluster, job_dir):
    write_script(job_dir, "hello.py", """
        import os
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "on", os.environ["SLURMD_NODENAME"])
        """)
    crew = " ".join(crew_command("run", "--num_gpus", "2", "hello.py"))
    script = write_script(job_dir, "job.sh", f"""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        {crew}
        echo $? > exit_code
        """)
    submitted = cluster.run("sbatch", "--parsable", "-o", str(job_dir / "job.out"), str(script), cwd=job_dir)
    assert submitted.returncode == 0, submitted.stderr
    wait_for_file(job_dir / "exit_code", timeout=60)  # sbatch --wait polls every ~10 s: too slow here
    time.sleep(0.2)
    output = (job_dir / "job.out").read_text()
    assert (job_dir / "exit_code").read_text().strip() == "0", output
    assert "launcher slurm" in output
    for rank in range(4):
        assert f"[{NODES[rank // 2]}:{rank}] rank {rank} of 4 on {NODES[rank // 2]}" in output
    assert no_steps_left(cluster)


def test_doctor_over_srun(cluster, job_dir):
    write_script(job_dir, "train.py", "print('hi')\n")
    done = salloc(cluster, "doctor", "--json", "train.py", cwd=job_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["launcher"] == "slurm"
    assert [node["host"] for node in report["nodes"]] == NODES


# -- without a cluster: the allocation's variables --------------------------------------------------------

def allocation(**variables: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-02]", **variables}


def slots(environ, num_gpus=None) -> list[tuple[str, tuple[int, ...]]]:
    return [(h.name, h.slots) for h in slurm.allocation_hosts(environ, num_gpus)]


@pytest.mark.parametrize("variables, expected", [
    ({}, [1, 1]),
    ({"SLURM_TASKS_PER_NODE": "3,1"}, [3, 1]),
    ({"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS_PER_NODE": "4"}, [4, 4]),
    ({"SLURM_GPUS_PER_NODE": "a100:8", "SLURM_TASKS_PER_NODE": "1(x2)"}, [8, 8]),
    ({"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "8"}, [4, 4]),
    ({"SLURM_GPUS_PER_TASK": "1", "SLURM_TASKS_PER_NODE": "2(x2)"}, [2, 2]),
])
def test_slots_per_node_from_the_allocation(variables, expected):
    assert slots(allocation(**variables)) == [("gpu01", tuple(range(expected[0]))),
                                              ("gpu02", tuple(range(expected[1])))]


def test_num_gpus_sets_the_slots_but_not_beyond_the_allocations_gpus():
    assert slots(allocation(), num_gpus=3) == [("gpu01", (0, 1, 2)), ("gpu02", (0, 1, 2))]
    with pytest.raises(PlanError, match=r"--num_gpus 9: the allocation has 8 GPU\(s\) per node "
                                        r"\(SLURM_GPUS_PER_NODE=8\)"):
        slurm.allocation_hosts(allocation(SLURM_GPUS_PER_NODE="8"), 9)


@pytest.mark.parametrize("variables, named", [
    ({"SLURM_JOB_NODELIST": "gpu[01-"}, "SLURM_JOB_NODELIST='gpu[01-'"),
    ({"SLURM_TASKS_PER_NODE": "2(x3"}, "SLURM_TASKS_PER_NODE='2(x3'"),
    ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "SLURM_TASKS_PER_NODE='2(x3)' gives 3 count(s) for 2 node(s)"),
    ({"SLURM_GPUS_PER_NODE": "many"}, "SLURM_GPUS_PER_NODE='many'"),
    ({"SLURM_NTASKS_PER_NODE": "0"}, "SLURM_NTASKS_PER_NODE='0'"),
])
def test_a_variable_that_cannot_be_read_is_named(variables, named):
    with pytest.raises(LaunchError) as error:
        slurm.allocation_hosts(allocation(**variables))
    assert named in str(error.value)


def cli_error(capsys, monkeypatch, environ: dict[str, str], *argv: str) -> str:
    for name in [n for n in os.environ if n.startswith("SLURM")]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert cli.main(list(argv)) == 2
    return capsys.readouterr().err


def test_malformed_nodelist_fails_the_command_naming_the_variable(capsys, monkeypatch):
    err = cli_error(capsys, monkeypatch, allocation(SLURM_JOB_NODELIST="node[1-"), "plan", "--json")
    assert err.startswith("crew: error: SLURM_JOB_NODELIST='node[1-': a '[' is never closed")


@pytest.mark.parametrize("environ, argv, words", [
    ({}, ["--launcher", "slurm"], ["not inside a Slurm allocation (SLURM_JOB_ID is not set)", "salloc"]),
    (allocation(), ["--launcher", "slurm", "-H", "hosts"], ["leave out --hostfile"]),
    (allocation(), ["--launcher", "slurm", "--node_rank", "1"], ["Leave out --node_rank"]),
    (allocation(SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2"), [],
     ["one of 2 tasks of Slurm job step 7.0", "without srun in front of it"]),
])
def test_slurm_misuse_is_one_clear_message(capsys, monkeypatch, environ, argv, words):
    err = cli_error(capsys, monkeypatch, environ, "plan", *argv)
    for word in words:
        assert word in err


@pytest.mark.parametrize("variables, inside", [
    ({}, None), ({"SLURM_STEP_ID": "batch"}, None), ({"SLURM_STEP_ID": "4294967290"}, None),
    ({"SLURM_STEP_ID": "0"}, 1), ({"SLURM_STEPID": "3", "SLURM_STEP_NUM_TASKS": "4"}, 4),
])
def test_a_step_is_told_from_salloc_and_batch(variables, inside):
    assert slurm.step_tasks(allocation(**variables)) == inside


def test_srun_options_nest_in_a_step_and_give_per_task_gpus_to_the_node():
    assert slurm.srun_options(allocation()) == []
    assert slurm.srun_options(allocation(SLURM_STEP_ID="0")) == ["--overlap"]
    per_task = allocation(SLURM_GPUS_PER_TASK="1", SLURM_TASKS_PER_NODE="4(x2)")
    assert slurm.srun_options(per_task) == ["--gres=gpu:4"]


# -- without a cluster: srun's command line, node ranks, long lines ---------------------------------------

def job(hosts=("gpu01", "gpu02"), slots=(0, 1), line_max=0) -> JobSpec:
    nodes = tuple(NodeSpec(h, slots, (2 * i, 2 * i + 1)) for i, h in enumerate(hosts))
    return JobSpec("j0b", nodes, "gpu01", 29500, ("train.py",), "/work/dir", line_max=line_max)


def test_one_srun_for_every_node(monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: f"/usr/bin/{name}")
    (launch,) = runners.slurm_launches(job(), "/opt/py", ["--overlap"])
    argv = list(launch.argv)
    assert argv[0] == "srun" and launch.node_ranks == (0, 1) and launch.label == "srun"
    for option in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu01,gpu02",
                   "--kill-on-bad-exit=0", "--export=ALL", "--input=all", "--chdir=/work/dir", "--overlap"):
        assert option in argv
    assert argv[argv.index("/opt/py"):] == ["/opt/py", "-u", "-c", runners.entry("crew.launcher.node.agent"),
                                            "--job", "j0b", "--node_rank", "slurm"]
    assert launch.spec_on_stdin and launch.kill_signal == signal.SIGTERM
    (probe,) = runners.slurm_launches(job(), "/opt/py", module="crew.launcher.preflight.probe")
    assert "--input=none" in probe.argv and "--spec_b64" in probe.argv and not probe.spec_on_stdin


def test_srun_missing_is_an_error_with_the_fix(monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: None)
    with pytest.raises(LaunchError, match="srun is not installed here"):
        runners.slurm_launches(job(), "/opt/py")


def test_each_agent_finds_its_node_by_name_and_maps_its_devices():
    spec = job(slots=(0, 1))
    assert slurm_node(spec, {"SLURMD_NODENAME": "gpu02"}) == (1, spec)
    index, mapped = slurm_node(spec, {"SLURMD_NODENAME": "gpu02", "CUDA_VISIBLE_DEVICES": "4,6"})
    assert index == 1 and mapped.nodes[1].slots == (4, 6) and mapped.nodes[0].slots == (0, 1)
    assert "SLURMD_NODENAME is not set" in slurm_node(spec, {})
    assert "(gpu09, SLURMD_NODENAME) is not one of the job's nodes (gpu01, gpu02)" in slurm_node(
        spec, {"SLURMD_NODENAME": "gpu09"})
    too_few = slurm_node(spec, {"SLURMD_NODENAME": "gpu02", "CUDA_VISIBLE_DEVICES": "5"})
    assert too_few == ("this node (gpu02) has the GPUs 5 in this job (CUDA_VISIBLE_DEVICES), too few for its "
                       "slots 0,1. Pass --num_gpus 1, or ask Slurm for more GPUs per node.")


def test_long_lines_go_in_pieces_and_come_back_whole():
    long_a, long_b = b"[a:0] " + b"a" * 2500 + b"\n", b"[b:1] " + b"b" * 1000 + b"\n"
    pieces_a = split_long_lines(b"short\n" + long_a, 0, 960).splitlines(keepends=True)
    pieces_b = split_long_lines(long_b, 1, 960).splitlines(keepends=True)
    assert all(len(piece) <= 960 for piece in pieces_a + pieces_b) and pieces_a[0] == b"short\n"
    merged = [pieces_a[0], pieces_a[1], pieces_b[0], b"other\n", pieces_a[2], pieces_b[1], pieces_a[3]]
    assert list(whole_lines(merged)) == [b"short\n", b"other\n", long_b, long_a]
    assert split_long_lines(long_a, 0, 0) == long_a
