"""Ranks started by plain mpirun, without crew's launcher: an unchanged DeepSpeed script (crew's `deepspeed` shim
first on PYTHONPATH) and crew's own engine find their world from MPI's variables and train as one
data-parallel world of 2, under Debian's Open MPI (mpirun.openmpi) and MPICH (mpirun.mpich, Hydra).

Ranks on two machines are faked on this one by overriding the MPI's local size for each rank (`env
OMPI_COMM_WORLD_LOCAL_SIZE=1 python ...`): a world that cannot use 127.0.0.1 as its master."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import write_script

from crew.launcher.node.agent import DEEPSPEED_SHIM
from crew.launcher.plan.ports import free_port
from crew.runtime.mpi_env import host_address

OPEN_MPI = shutil.which("mpirun.openmpi")
MPICH = shutil.which("mpirun.mpich")
STEPS = 3

# The model, data and steps of both scripts: each rank its own 4 samples, so only a world of 2 that averages
# gradients gives REFERENCE's losses.
TRAINING = """
    rank = int(os.environ["RANK"])
    inputs = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + rank))
    targets = inputs.sum(dim=1, keepdim=True)
    losses = []
    for _ in range({steps}):
        loss = (engine(inputs) - targets).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with open(f"result{{rank}}.json", "w") as out:
        json.dump({{"world": engine.world_size, "local_rank": int(os.environ["LOCAL_RANK"]),
                   "master": os.environ["MASTER_ADDR"], "losses": losses}}, out)
"""
CONFIG = """{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
             "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"""
DEEPSPEED_SCRIPT = """
    import json, os
    import torch
    import deepspeed

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
""".replace("CONFIG", CONFIG) + TRAINING.format(steps=STEPS)
CREW_SCRIPT = """
    import json, os
    import torch
    import crew

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine, _, _, _ = crew.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
""".replace("CONFIG", CONFIG) + TRAINING.format(steps=STEPS)


def reference_losses() -> list[float]:
    """Rank 0's losses of the same two ranks in one process: SGD on the mean of both ranks' gradients, clipped
    to norm 1 (DeepSpeed's default gradient_clipping, and crew's)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = []
    for rank in (0, 1):
        inputs = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + rank))
        data.append((inputs, inputs.sum(dim=1, keepdim=True)))
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        per_rank = [(model(inputs) - targets).pow(2).mean() for inputs, targets in data]
        (sum(per_rank) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(per_rank[0].item())
    return losses


def open_mpi(*args: str) -> list[str]:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [OPEN_MPI, *root, "--oversubscribe", "-n", "2", *args]


def run(command: list[str], cwd) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def results(folder) -> list[dict]:
    return [json.loads((folder / f"result{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.skipif(not OPEN_MPI, reason="no mpirun.openmpi (Debian's openmpi-bin; tools/system-deps.sh)")
def test_a_deepspeed_script_under_open_mpi_with_the_master_given_by_x(job_dir):
    write_script(job_dir, "train.py", DEEPSPEED_SCRIPT)
    done = run(open_mpi("-x", f"PYTHONPATH={DEEPSPEED_SHIM}", "-x", "MASTER_ADDR=127.0.0.1",
                        "-x", f"MASTER_PORT={free_port()}", sys.executable, "train.py"), job_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "discovered Open MPI: rank 0 of 2, local rank 0, master 127.0.0.1" in done.stdout
    ranks = results(job_dir)
    assert [(rank["world"], rank["local_rank"]) for rank in ranks] == [(2, 0), (2, 1)]
    assert ranks[0]["losses"] == pytest.approx(reference_losses(), rel=1e-5)


@pytest.mark.skipif(not MPICH, reason="no mpirun.mpich (Debian's mpich; tools/system-deps.sh)")
def test_a_deepspeed_script_under_mpich_on_two_machines_gets_rank_0s_address_over_pmi(job_dir):
    write_script(job_dir, "train.py", DEEPSPEED_SCRIPT)
    done = run([MPICH, "-n", "2", "-genv", "PYTHONPATH", DEEPSPEED_SHIM, "-genv", "MASTER_PORT", str(free_port()),
                "env", "MPI_LOCALNRANKS=1", sys.executable, "train.py"], job_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(rank 0's host, shared over PMI)" in done.stdout
    ranks = results(job_dir)
    assert [(rank["world"], rank["master"]) for rank in ranks] == [(2, host_address())] * 2
    assert ranks[0]["losses"] == pytest.approx(reference_losses(), rel=1e-5)


@pytest.mark.skipif(not OPEN_MPI, reason="no mpirun.openmpi (Debian's openmpi-bin; tools/system-deps.sh)")
def test_crews_engine_under_open_mpi_on_one_machine_needs_no_master_address(job_dir):
    write_script(job_dir, "train.py", CREW_SCRIPT)
    done = run(open_mpi("-x", f"MASTER_PORT={free_port()}", sys.executable, "train.py"), job_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = results(job_dir)
    assert [(rank["world"], rank["local_rank"], rank["master"]) for rank in ranks] == [(2, 0, "127.0.0.1"),
                                                                                      (2, 1, "127.0.0.1")]
    assert ranks[0]["losses"] == pytest.approx(reference_losses(), rel=1e-5)


@pytest.mark.skipif(not OPEN_MPI, reason="no mpirun.openmpi (Debian's openmpi-bin; tools/system-deps.sh)")
def test_open_mpi_ranks_on_two_machines_without_a_master_say_so_on_every_rank_before_any_wait(job_dir):
    if importlib.util.find_spec("mpi4py"):
        pytest.skip("mpi4py is installed: the ranks agree on rank 0's address with it")
    write_script(job_dir, "train.py", DEEPSPEED_SCRIPT)
    done = run(open_mpi("-x", f"PYTHONPATH={DEEPSPEED_SHIM}", "env", "OMPI_COMM_WORLD_LOCAL_SIZE=1",
                        sys.executable, "train.py"), job_dir)
    assert done.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank} was started by Open MPI (OMPI_COMM_WORLD_RANK={rank}" in done.stderr
    assert done.stderr.count("no master address is known") == 2
    assert "mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_mpi_world_of_one_stays_in_memory_and_auto_mpi_discovery_false_reads_no_mpi(monkeypatch):
    import torch.distributed as dist

    from crew.runtime import comm

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    comm.init_distributed(dist_backend="gloo")  # `mpirun -n 1`: no store, no port
    assert dist.get_world_size() == 1 and "MASTER_PORT" not in os.environ
    comm.destroy_process_group()

    # A rank of two on two machines, told not to look: no MPI is read (looking would raise the no-master error at
    # once), so a world of one, as without any launcher.
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    assert dist.get_world_size() == 1 and "RANK" not in os.environ
