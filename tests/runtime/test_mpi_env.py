"""A rank that mpirun started finds its world from MPI's variables (crew/runtime/mpi_env.py), as DeepSpeed's
init_distributed(auto_mpi_discovery=True) does: each MPI's names as that MPI sets them (checked with `mpirun
... env` for Open MPI 4.1 and MPICH 4.0), AzureML's and SageMaker's, and the errors, from environ dicts."""

from __future__ import annotations

import socket
import threading

import pytest

from crew.errors import CrewError
from crew.runtime.mpi_env import find_mpi_world, needs_discovery, no_master_message, settle
from crew.runtime.pmi import PmiError, share_from_rank0

# What `mpirun.openmpi -n 2 env` gives rank 1 (of the variables crew reads), ranks on one machine
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "1"}
# `mpirun.mpich -n 2 env`: Hydra's PMI-1 names
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "8"}
MVAPICH = {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "4"}
CRAY_PALS = {"PALS_RANKID": "6", "PMI_RANK": "6", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "2", "PALS_LOCAL_SIZE": "4"}


def test_a_launcher_that_set_all_five_variables_means_no_discovery():
    launched = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "0"}
    assert not needs_discovery({**launched, **OPEN_MPI})
    assert needs_discovery({**OPEN_MPI, "MASTER_ADDR": "h", "MASTER_PORT": "1"})  # as DeepSpeed: LOCAL_RANK too


def test_no_mpi_variables_is_no_mpi_world():
    assert find_mpi_world({"PATH": "/usr/bin", "SLURM_PROCID": "0"}) is None


def test_open_mpi_on_one_machine_needs_no_exchange():
    world = find_mpi_world(OPEN_MPI)
    assert world.flavour == "Open MPI"
    assert world.torchrun_env() == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, rank, world_size, local_rank, local_size", [
    (MPICH, 1, 2, 1, 2),
    (MVAPICH, 5, 8, 1, 4),
    (CRAY_PALS, 6, 8, 2, 4),
    ({"PMIX_RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2"}, 3, 4, 1, 2),  # PMIx: the rest by -x
    ({"PMI_RANK": "3", "PMIX_RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, 3, 4, 3, None),  # DeepSpeed mpich
])
def test_each_mpis_names_give_rank_size_and_local_rank(env, rank, world_size, local_rank, local_size):
    world = find_mpi_world({**env, "MASTER_ADDR": "node-0"})
    assert (world.rank, world.world_size, world.local_rank, world.local_size) == (rank, world_size, local_rank,
                                                                                  local_size)
    assert world.master_addr == "node-0"


def test_master_addr_and_port_from_the_environment_win_and_the_port_defaults_to_distributed_port():
    spread = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    given = find_mpi_world({**spread, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "31000"}, distributed_port=29600)
    assert (given.master_addr, given.master_port, given.master_from) == ("10.0.0.7", 31000, "MASTER_ADDR")
    assert find_mpi_world({**OPEN_MPI, "MASTER_ADDR": "10.0.0.7"}, distributed_port=29600).master_port == 29600
    assert find_mpi_world(spread).master_addr is None  # two machines: to be agreed, or an error


def test_the_first_mpi_found_wins_over_another_mpis_leftovers():
    world = find_mpi_world({**OPEN_MPI, "PMI_RANK": "9", "PMI_SIZE": "10"})
    assert (world.flavour, world.rank) == ("Open MPI", 1)


def test_azureml_master_as_deepspeed_patches_it():
    aml = {**OPEN_MPI, "AZUREML_EXPERIMENT_ID": "x", "AZ_BATCHAI_MPI_MASTER_NODE": "10.0.0.4"}
    single = find_mpi_world(aml).torchrun_env()
    assert (single["MASTER_ADDR"], single["MASTER_PORT"], single["NCCL_SOCKET_IFNAME"]) == ("10.0.0.4", "54965",
                                                                                           "^docker0,lo")
    multi = {**aml, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
             "AZ_BATCH_MASTER_NODE": "10.0.0.5:6000"}
    assert (find_mpi_world(multi).master_addr, find_mpi_world(multi).master_port) == ("10.0.0.5", 6105)
    assert find_mpi_world({**multi, "MASTER_PORT": "7000"}).master_port == 7000
    assert find_mpi_world({**aml, "DLTS_JOB_ID": "1"}).master_addr == "127.0.0.1"  # DLTS: not AzureML's patch


def test_sagemaker_is_open_mpi_with_its_master_from_the_environment():
    world = find_mpi_world({**OPEN_MPI, "SM_TRAINING_ENV": "{}", "MASTER_ADDR": "algo-1", "MASTER_PORT": "7777"})
    assert (world.flavour, world.master_addr, world.master_port) == ("Open MPI (SageMaker)", "algo-1", 7777)


@pytest.mark.parametrize("env, message", [
    ({"PMIX_RANK": "0"}, r"PMIx \(PMIX_RANK=0\) but nothing says how many ranks.*-x WORLD_SIZE=<ranks>"),
    ({"PMI_RANK": "1", "PMIX_RANK": "2", "PMI_SIZE": "4"}, r"rank variables disagree \(PMIX_RANK=2, PMI_RANK=1\)"),
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, r"OMPI_COMM_WORLD_RANK='x' is not a whole number"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, r"rank 2 is outside a world of 2 ranks"),
    ({**OPEN_MPI, "MASTER_PORT": "http"}, r"MASTER_PORT='http': expected a port number"),
])
def test_contradictory_or_incomplete_variables_are_said_plainly(env, message):
    with pytest.raises(CrewError, match=message):
        find_mpi_world(env)


def test_ranks_on_several_machines_without_a_master_address_get_the_fixes_at_once(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # no mpi4py, whatever is installed
    spread = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    with pytest.raises(CrewError) as raised:
        settle(find_mpi_world(spread), spread, timeout_s=1)
    message = str(raised.value)
    for part in ("rank 1 was started by Open MPI (OMPI_COMM_WORLD_RANK=1", "no master address is known",
                 "1 of its 2 ranks on this machine", "no PMI socket", "mpi4py is not installed",
                 "mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500", "-genv MASTER_ADDR <host>",
                 "pip install mpi4py"):
        assert part in message


def test_an_unknown_local_rank_says_so():
    world = find_mpi_world({"PMIX_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h"})
    assert world.local_rank is None
    assert "nothing says its local rank" in no_master_message(world)
    assert "export LOCAL_RANK" in no_master_message(world)


def _pmi_server(sock: socket.socket, answers: list[str]) -> threading.Thread:
    """A PMI server that answers each command with the next of `answers`, then reads one more and hangs up."""
    def serve():
        with sock, sock.makefile("rw") as stream:
            for answer in answers:
                if not stream.readline():
                    return
                stream.write(answer + "\n")
                stream.flush()
            stream.readline()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("answers, message", [
    (["cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0", "cmd=my_kvsname kvsname=kvs_1",
      "cmd=put_result rc=-1 msg=duplicate", "cmd=finalize_ack"],
     r"PMI: cmd=put answered 'cmd=put_result rc=-1 msg=duplicate', expected cmd=put_result rc=0"),
    (["cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"],
     r"PMI: cmd=get_my_kvsname failed: the PMI server closed the connection"),
])
def test_a_pmi_server_that_refuses_or_goes_away_is_said_plainly(answers, message):
    ours, theirs = socket.socketpair()
    server = _pmi_server(theirs, answers)
    with ours, pytest.raises(PmiError, match=message):
        share_from_rank0(ours.fileno(), 0, "10.0.0.1", timeout_s=5)
    server.join(5)


def test_a_failed_pmi_exchange_says_which_rank_and_the_fix(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # no mpi4py, whatever is installed
    ours, theirs = socket.socketpair()
    server = _pmi_server(theirs, ["cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=-1"])
    spread = {**MPICH, "MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0", "PMI_FD": str(ours.fileno())}
    expected = r"rank 1 \(MPICH.*over PMI: PMI: cmd=init answered .*rc=-1.*-genv MASTER_ADDR"
    with ours, pytest.raises(CrewError, match=expected):
        settle(find_mpi_world(spread), spread, timeout_s=5)
    server.join(5)


def test_the_mpis_own_values_win_over_a_stray_world_size_or_local_rank():
    world = find_mpi_world({**OPEN_MPI, "WORLD_SIZE": "8", "LOCAL_RANK": "0"})  # `-x LOCAL_RANK=0`: same on every rank
    assert (world.world_size, world.local_rank) == (2, 1)
