"""`crew run --launcher openmpi|mpich` (one mpirun starts every node's agent) over real sshd "nodes" on
127.0.0.2 and 127.0.0.3, with Debian's Open MPI and MPICH; `crew plan` for all four MPI launchers."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import time

import pytest
from conftest import STEPPER, crew, start_crew, wait_for_file, write_script
from sshnodes import descendants

from crew.errors import LaunchError
from crew.launcher.transport import mpi
from crew.launcher.transport.protocol import JobSpec, NodeSpec, mpi_identity, mpi_node


def _missing(launcher: str) -> str | None:
    try:
        mpi.check(launcher)
    except LaunchError as exc:
        return str(exc)
    return None


MPIS = [pytest.param(name, marks=pytest.mark.skipif(bool(_missing(name)), reason=str(_missing(name))))
        for name in ("openmpi", "mpich")]

# A plain torch.distributed job (no crew import): a few SGD steps of DDP over gloo; each rank writes what
# its launcher gave it, the node it really ran on (sshd's SSH_CONNECTION), and the losses.
TRAIN = """
    import json, os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for step in range(5):
        inputs = torch.randn(16, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(round(total.item() / dist.get_world_size(), 6))
    seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                           "MASTER_ADDR", "MASTER_PORT", "CREW_HOST", "OMPI_COMM_WORLD_RANK",
                                           "PMI_RANK", "PMIX_RANK")}
    seen["node"] = os.environ.get("SSH_CONNECTION", "").split()[2:3]
    seen["cpus"] = len(os.sched_getaffinity(0))
    seen["losses"] = losses
    json.dump(seen, open(f"rank{dist.get_rank()}.json", "w"))
    dist.destroy_process_group()
"""


def run_on(cluster, launcher: str, *args: str, **kwargs):
    return crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=2)), "--launcher", launcher,
                *args, **kwargs)


def left_on_nodes(cluster, timeout: float = 15.0) -> list[str]:
    """What still runs under the nodes' sshd (orted, hydra_pmi_proxy, agents, ranks) once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for proc in cluster.procs.values():
            for pid in descendants(proc.pid):
                try:
                    left.append(f"{pid}: " + open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
                except OSError:
                    continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ssh_losses(cluster, tmp_path_factory):
    """The same job under the ssh runner: the losses every MPI run must reproduce."""
    folder = tmp_path_factory.mktemp("ssh_reference")
    write_script(folder, "train.py", TRAIN)
    result = run_on(cluster, "ssh", "--skip_preflight", "train.py", cwd=folder)
    assert result.code == 0, result.err
    return json.loads((folder / "rank0.json").read_text())["losses"]


@pytest.mark.parametrize("launcher", MPIS)
def test_torch_job_gets_torchrun_variables_and_the_ssh_runners_losses(cluster, job_dir, launcher, ssh_losses):
    write_script(job_dir, "train.py", TRAIN)
    result = run_on(cluster, launcher, "train.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = [json.loads((job_dir / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert [s["RANK"] for s in seen] == ["0", "1", "2", "3"]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1"]
    assert [s["NODE_RANK"] for s in seen] == ["0", "0", "1", "1"]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_ADDR"]) for s in seen} == {("4", "2", "127.0.0.2")}
    # each rank ran on the node crew says (the sshd it came through), and saw none of its agent's MPI rank
    assert [s["node"] for s in seen] == [[s["CREW_HOST"]] for s in seen] == [["127.0.0.2"]] * 2 + [["127.0.0.3"]] * 2
    assert {(s["OMPI_COMM_WORLD_RANK"], s["PMI_RANK"], s["PMIX_RANK"]) for s in seen} == {(None, None, None)}
    assert seen[0]["losses"] == ssh_losses
    assert {s["cpus"] for s in seen} == {len(os.sched_getaffinity(0))}  # mpirun bound no agent to a core
    assert f"launcher {launcher}" in result.err and "preflight: 2 node(s) agree" in result.err
    assert result.err.strip().splitlines()[-1].startswith("crew: job ")
    assert "succeeded · 4 ranks on 2 nodes" in result.err
    assert not left_on_nodes(cluster)


@pytest.mark.parametrize("launcher", MPIS)
def test_failing_rank_on_node_two_stops_every_node(cluster, job_dir, launcher):
    write_script(job_dir, "step.py", STEPPER)
    result = run_on(cluster, launcher, "--skip_preflight", "--env", "FAIL_RANK=3", "step.py", cwd=job_dir)
    assert result.code == 7, result.err
    assert result.seconds < 20
    assert "127.0.0.3 rank 3 (local 1) exited with code 7 (first failure)" in result.err
    assert "fatal: rank 3 gives up at step 3" in result.err.split("first failure")[1]
    assert "rank 3 on 127.0.0.3 failed first" in result.err.strip().splitlines()[-1]
    assert not left_on_nodes(cluster)  # job_dir: no rank, agent or mpirun left here either


# STEPPER whose ranks take 1.5 s to finish on SIGTERM: a stop must give them that (the agents' grace), not
# Open MPI's one second before SIGKILL.
SLOW_TO_STOP = STEPPER.replace("import os, sys, time", """import os, signal, sys, time
    def finish(*_):
        time.sleep(1.5)
        open(f"finished{os.environ['RANK']}", "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, finish)""")


@pytest.mark.parametrize("launcher, sig, code", [
    pytest.param("openmpi", signal.SIGINT, 130, marks=MPIS[0].marks),
    pytest.param("mpich", signal.SIGINT, 130, marks=MPIS[1].marks),
    pytest.param("openmpi", signal.SIGTERM, 143, marks=MPIS[0].marks),
    pytest.param("mpich", signal.SIGTERM, 143, marks=MPIS[1].marks),
    pytest.param("mpich", signal.SIGKILL, -9, marks=MPIS[1].marks),  # crew itself killed: mpirun dies with it
])
def test_stopping_crew_leaves_nothing_on_any_node(cluster, job_dir, launcher, sig, code):
    write_script(job_dir, "step.py", SLOW_TO_STOP)
    proc = start_crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=2)), "--launcher",
                      launcher, "--skip_preflight", "step.py", cwd=job_dir)
    for rank in range(4):
        wait_for_file(job_dir / f"started{rank}")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert not left_on_nodes(cluster)
    if sig != signal.SIGKILL:  # every rank had its time to finish
        assert sorted(path.name for path in job_dir.glob("finished*")) == [f"finished{rank}" for rank in range(4)]
    if sig == signal.SIGTERM:  # a preemption notice: crew sent mpirun SIGUSR1, which it passed on to every agent
        assert "SIGTERM received: stopping every rank on every node; ranks whose config has crew's" in err
        assert "preempted: no checkpoint was saved" in err


def test_plan_shows_each_mpirun_command(here):
    (here / "hosts").write_text("node-a:2222 slots=2\nnode-b:2222 slots=1\n")
    commands = {}
    for launcher in mpi.MPI_RUNNERS:
        result = crew("plan", "-H", "hosts", "--launcher", launcher, "--ssh_args", "-F /etc/cluster_ssh",
                      "--launcher_args", "--bind-to none", "--num_nodes", "2", "train.py", cwd=here)
        assert result.code == 0, result.err
        line = next(line for line in result.out.splitlines() if line.startswith("  command (mpirun): "))
        commands[launcher] = shlex.split(line.split(": ", 1)[1])
    ssh = "-o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=5 -o ServerAliveCountMax=6 -F " \
          "/etc/cluster_ssh -p 2222"
    openmpi = commands["openmpi"]
    assert openmpi[1:5] == ["-n", "2", "--host", "node-a,node-b"]
    assert openmpi[openmpi.index("plm_rsh_args") + 1] == ssh
    assert "btl" not in openmpi and "-x" not in openmpi  # no MPI transport options: the agents use no MPI
    assert openmpi.count("--bind-to") == 1  # --launcher_args' own, not crew's "--bind-to none" as well
    # the MPI Operator's kubexec.sh (not ssh) reaches the pods: crew's ssh options would break it
    result = crew("plan", "-H", "hosts", "--launcher", "openmpi", "train.py", cwd=here,
                  env={"OMPI_MCA_plm_rsh_agent": "/etc/mpi/kubexec.sh"})
    assert result.code == 0 and "--mca plm_rsh_args" not in result.out and "--bind-to none" in result.out
    for launcher in ("mpich", "impi", "mvapich"):
        words = commands[launcher]
        assert words[0] == f"{mpi.FLAVOURS[launcher].ssh_env}={ssh}"
        assert words[2:8] == ["-n", "2", "-ppn", "1", "-hosts", "node-a,node-b"]
    assert commands["impi"][8:11] == ["-genv", "I_MPI_PIN", "0"]
    for words in commands.values():  # --launcher_args after crew's options, then the node agent
        start = words.index("--bind-to")
        assert words[start:start + 4] == ["--bind-to", "none", "sh", "-c"]
        agent = words[start + 4]
        assert "--node_rank mpi" in agent
        assert "--watch stdout" in agent and "--spec_b64" in agent  # mpirun gives stdin to one process only
        assert "--stdin" not in words  # Open MPI 4.1's --stdin all hangs with a process on mpirun's own node


def test_one_node_here_runs_without_mpirun_as_under_deepspeed(here):
    result = crew("plan", "--launcher", "mpich", "--num_gpus", "2", "--json", cwd=here)
    assert result.code == 0, result.err
    assert json.loads(result.out)["launcher"] == "local"
    assert "--launcher mpich: one node, this machine: its ranks start without mpirun, as under DeepSpeed" in result.err


def test_mpi_errors_before_anything_starts(here, monkeypatch):
    (here / "hosts").write_text("node-a slots=1\n[fe80::1] slots=1\n")
    write_script(here, "train.py", "")
    result = crew("run", "-H", "hosts", "--launcher", "mpich", "train.py", cwd=here)
    assert result.code == 2
    assert "host 'fe80::1': mpirun's host lists take names and IPv4 addresses only" in result.err
    (here / "hosts").write_text("node-a:22 slots=1\nnode-b:2222 slots=1\n")
    result = crew("run", "-H", "hosts", "--launcher", "openmpi", "train.py", cwd=here)
    assert result.code == 2 and "different ssh ports per host" in result.err
    (here / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    result = crew("run", "-H", "hosts", "--launcher", "openmpi", "train.py", cwd=here, env={"PATH": str(here)})
    assert result.code == 2
    assert "--launcher openmpi: no mpirun here (mpirun.openmpi, mpirun, mpiexec, orterun: none on PATH)" in result.err
    assert "apt-get install openmpi-bin" in result.err


@pytest.mark.skipif(not shutil.which("mpirun.openmpi") or not shutil.which("mpirun.mpich"),
                    reason="needs Open MPI and MPICH side by side")
def test_the_wrong_mpi_is_named(here, monkeypatch):
    (here / "bin").mkdir()
    (here / "bin" / "mpirun").symlink_to(shutil.which("mpirun.mpich"))
    (here / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    write_script(here, "train.py", "")
    result = crew("run", "-H", "hosts", "--launcher", "impi", "train.py", cwd=here, env={"PATH": str(here / "bin")})
    assert result.code == 2
    assert "--launcher impi: mpirun --version says 'HYDRA build details:', which is not Intel MPI (it is MPICH: " \
           "--launcher mpich runs it)" in result.err


def job(nodes: int) -> JobSpec:
    return JobSpec("j", tuple(NodeSpec(f"n{i}", (0,), (i,)) for i in range(nodes)), "n0", 1, ("t.py",), "/")


@pytest.mark.parametrize("environ, found", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, 1),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, 0),
    ({"PMIX_RANK": "1"}, 1),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2"}, 1),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "mpirun started 4 process(es) (PMI_SIZE), but the job has 2 node(s)"),
    ({}, "none of OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, MV2_COMM_WORLD_RANK is set"),
])
def test_mpi_node_from_each_mpis_variables(environ, found):
    result = mpi_node(job(2), environ)
    assert result == found if isinstance(found, int) else found in result


def test_mpi_identity_is_the_agents_rank_and_size_only():
    environ = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "PMI_RANK": "1", "PMI_SIZE": "2",
               "MPI_LOCALRANKID": "0", "OMPI_MCA_btl": "tcp", "NCCL_DEBUG": "INFO", "PMIX_RANK": "1"}
    assert sorted(mpi_identity(environ)) == ["MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK",
                                             "PMIX_RANK", "PMI_RANK", "PMI_SIZE"]


@pytest.mark.parametrize("launcher", MPIS)
def test_a_node_mpirun_cannot_reach_is_named_at_once(cluster, job_dir, launcher):
    """Hydra would wait for the missing node forever; crew ends the job on ssh's line, with the fix."""
    (job_dir / "hosts").write_text(f"127.0.0.2:{cluster.port} slots=1\n127.0.0.9:{cluster.port} slots=1\n")
    write_script(job_dir, "step.py", STEPPER)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", "hosts", "--launcher", launcher, "--skip_preflight",
                  "step.py", cwd=job_dir, timeout=60)
    assert result.code == 255, result.err
    assert "mpirun could not log in to 127.0.0.9 over ssh (ssh: connect to host 127.0.0.9 port" in result.err
    assert "Start sshd on 127.0.0.9" in result.err
    assert not left_on_nodes(cluster)


@pytest.mark.parametrize("line, host", [
    ("ssh: connect to host 10.0.0.7 port 22: Connection refused", "10.0.0.7"),
    ("ssh: Could not resolve hostname worker-9: Name or service not known", "worker-9"),
    ("root@worker-2: Permission denied (publickey).", "worker-2"),
    ("Host key verification failed.", ""),
    ("[127.0.0.2:0] ssh: connect to host x port 22: Connection refused", None),  # a rank's line, not mpirun's ssh
])
def test_ssh_failure_lines(line, host):
    assert mpi.ssh_failure(line) == host
