"""The world of a rank that mpirun started: rank, world size, local rank and master from MPI's variables.

DeepSpeed's init_distributed(auto_mpi_discovery=True) does this when RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT or LOCAL_RANK is missing (deepspeed/comm/comm.py: mpi_discovery, the AzureML and SageMaker
patches; deepspeed/launcher/launcher_helper.py for MPICH's names). find_mpi_world is the pure half: an
environ mapping in, the torchrun variables out, or what is still unknown. Standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import socket
import subprocess
from collections.abc import Mapping

from crew.errors import CrewError

# DeepSpeed's required_env: discovery runs unless every one is set (crew run, torchrun, DeepSpeed's launchers).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
LOOPBACK = "127.0.0.1"
# deepspeed/comm/constants.py and patch_aml_env_for_torch_nccl_backend
AML_SINGLE_NODE_PORT = 54965
AML_MULTI_NODE_PORT = 6105
AML_NCCL_SOCKET_IFNAME = "^docker0,lo"


@dataclasses.dataclass(frozen=True)
class Flavour:
    """One MPI's names, each quantity's candidates; those present must agree (as DeepSpeed's
    launcher_helper.env_mapping). Where an MPI sets none, the torchrun names stand in (a user's `-x
    WORLD_SIZE=...`; DeepSpeed's MPICH runner passes WORLD_SIZE and LOCAL_SIZE so)."""
    name: str
    rank: tuple[str, ...]
    size: tuple[str, ...]
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]
    marks: tuple[str, ...] = ()  # the names that say this MPI started the process; the rank names when empty

    def started(self, environ: Mapping[str, str]) -> bool:
        return any(name in environ for name in self.marks or self.rank)


FLAVOURS = (
    Flavour("Open MPI", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",),
            ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    Flavour("MVAPICH", ("MV2_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_SIZE",),
            ("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    # MPICH's and Intel MPI's Hydra; Cray's PALS (with Cray PMI) sets PALS_* and PMI_*
    Flavour("MPICH/Intel MPI/Cray (PMI)", ("PMIX_RANK", "PMI_RANK", "PALS_RANKID"), ("PMI_SIZE", "PALS_SIZE"),
            ("PALS_LOCAL_RANKID", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
            ("PALS_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"), marks=("PMI_RANK", "PALS_RANKID")),
    Flavour("PMIx", ("PMIX_RANK",), (), (), ()),  # e.g. prterun, srun --mpi=pmix: the size from -x WORLD_SIZE
)


@dataclasses.dataclass(frozen=True)
class MpiWorld:
    """What the variables say. master_addr None: to be agreed between the ranks (mpi4py, PMI) or an error;
    local_rank None: only mpi4py can tell (by host names, as DeepSpeed)."""
    flavour: str
    found: dict[str, str]  # the MPI variables read, for messages
    rank: int
    world_size: int
    local_rank: int | None
    local_size: int | None
    master_addr: str | None
    master_port: int
    master_from: str  # where master_addr came from, for the log line
    extra: dict[str, str] = dataclasses.field(default_factory=dict)  # AzureML's NCCL_SOCKET_IFNAME

    @property
    def one_machine(self) -> bool:
        return self.local_size == self.world_size

    def torchrun_env(self) -> dict[str, str]:
        if self.master_addr is None or self.local_rank is None:
            raise ValueError("torchrun_env() before the master address and local rank are known")
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port), **self.extra}
        if self.local_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_size)  # as torchrun and crew run
        return env

    def describe(self) -> str:
        return f"{self.flavour} ({', '.join(f'{k}={v}' for k, v in self.found.items())})"


def needs_discovery(environ: Mapping[str, str]) -> bool:
    """DeepSpeed's condition: one of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK is missing."""
    return not all(name in environ for name in TORCHRUN_VARS)


def find_mpi_world(environ: Mapping[str, str], distributed_port: int = 29500) -> MpiWorld | None:
    """The world MPI's variables describe; None when no MPI started this process. A CrewError when they are
    contradictory or incomplete. The master address is settled here when no exchange is needed: MASTER_ADDR
    set, AzureML's, or every rank on this machine (127.0.0.1)."""
    flavour = _flavour(environ)
    if flavour is None:
        return None
    found: dict[str, str] = {}
    rank = _read(environ, flavour.rank, "rank", found, flavour)
    size = _read(environ, flavour.size, "world size", found, flavour, ("WORLD_SIZE",))
    local_rank = _read(environ, flavour.local_rank, "local rank", found, flavour, ("LOCAL_RANK",))
    local_size = _read(environ, flavour.local_size, "local size", found, flavour, ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"))
    if size is None:
        raise CrewError(f"this process was started by {flavour.name} ({_listing(found)}) but nothing says how many "
                        f"ranks there are ({', '.join(flavour.size) or 'no size variable'}, WORLD_SIZE are unset). "
                        "Pass it to every rank: mpirun -x WORLD_SIZE=<ranks> ... (MPICH: -genv WORLD_SIZE <ranks>).")
    if not 0 <= rank < size:
        raise CrewError(f"{flavour.name}: rank {rank} is outside a world of {size} ranks ({_listing(found)}).")
    if local_rank is None and (size == 1 or local_size == 1):
        local_rank = 0
    if local_rank is None and local_size == size:
        local_rank = rank
    if local_size is None and size == 1:
        local_size = 1
    name = flavour.name
    if "SM_TRAINING_ENV" in environ and flavour.name == "Open MPI":
        name = "Open MPI (SageMaker)"
    world = MpiWorld(name, found, rank, size, local_rank, local_size, None,
                     _port(environ, distributed_port), "")
    if _in_aml(environ) and flavour.name == "Open MPI":
        world = _aml_master(world, environ)
        if world.master_addr:
            return world
    if environ.get("MASTER_ADDR"):
        return dataclasses.replace(world, master_addr=environ["MASTER_ADDR"], master_from="MASTER_ADDR")
    if world.one_machine:
        return dataclasses.replace(world, master_addr=LOOPBACK, master_from="every rank on this machine")
    return world


def _flavour(environ: Mapping[str, str]) -> Flavour | None:
    return next((flavour for flavour in FLAVOURS if flavour.started(environ)), None)


def _read(environ: Mapping[str, str], names: tuple[str, ...], what: str, found: dict[str, str],
          flavour: Flavour, fallback: tuple[str, ...] = ()) -> int | None:
    """The one value the MPI's `names` agree on (those set); where none is set, the first `fallback` set (a
    user's -x WORLD_SIZE=..., never checked against the MPI's: as DeepSpeed, the MPI's win); else None."""
    present = {name: environ[name] for name in names if name in environ}
    if not present:
        present = {name: environ[name] for name in fallback if name in environ}
        present = dict(list(present.items())[:1])
    values = set()
    for name, text in present.items():
        try:
            values.add(int(text))
        except ValueError:
            raise CrewError(f"{flavour.name}: {name}={text!r} is not a whole number (the {what}).") from None
    if len(values) > 1:
        raise CrewError(f"{flavour.name}: the {what} variables disagree ({_listing(present)}): unset the stray "
                        "ones, or start the script with one launcher.")
    found.update(present)
    return values.pop() if values else None


def _port(environ: Mapping[str, str], default: int) -> int:
    text = environ.get("MASTER_PORT") or str(default)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise CrewError(f"MASTER_PORT={text!r}: expected a port number 1-65535, e.g. -x MASTER_PORT=29500.")
    return int(text)


def _in_aml(environ: Mapping[str, str]) -> bool:
    # DeepSpeed's in_aml() and not in_dlts()
    return "AZUREML_EXPERIMENT_ID" in environ and "DLTS_JOB_ID" not in environ


def _aml_master(world: MpiWorld, environ: Mapping[str, str]) -> MpiWorld:
    """As DeepSpeed's patch_aml_env_for_torch_nccl_backend: on one node AZ_BATCHAI_MPI_MASTER_NODE and port
    54965; on several, AZ_BATCH_MASTER_NODE's host and MASTER_PORT or 6105; NCCL off docker0 and lo."""
    extra = {"NCCL_SOCKET_IFNAME": AML_NCCL_SOCKET_IFNAME}
    if world.one_machine and environ.get("AZ_BATCHAI_MPI_MASTER_NODE"):
        return dataclasses.replace(world, flavour="Open MPI (AzureML)",
                                   master_addr=environ["AZ_BATCHAI_MPI_MASTER_NODE"], master_port=AML_SINGLE_NODE_PORT,
                                   master_from="AZ_BATCHAI_MPI_MASTER_NODE", extra=extra)
    if not world.one_machine and environ.get("AZ_BATCH_MASTER_NODE"):
        port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else AML_MULTI_NODE_PORT
        return dataclasses.replace(world, flavour="Open MPI (AzureML)",
                                   master_addr=environ["AZ_BATCH_MASTER_NODE"].split(":")[0], master_port=port,
                                   master_from="AZ_BATCH_MASTER_NODE", extra=extra)
    return world


def _listing(variables: Mapping[str, str]) -> str:
    return ", ".join(f"{name}={value}" for name, value in variables.items()) or "no values"


def settle(world: MpiWorld, environ: Mapping[str, str], timeout_s: float) -> MpiWorld:
    """The world with its master address and local rank known: agreed with mpi4py when it is installed (as
    DeepSpeed's mpi_discovery), else over Hydra's PMI socket; else a CrewError saying what to pass."""
    if world.master_addr is not None and world.local_rank is not None:
        return world
    pmi_fd = environ.get("PMI_FD", "")
    over_pmi = world.local_rank is not None and pmi_fd.isdigit()
    if importlib.util.find_spec("mpi4py") is not None:
        try:
            return _with_mpi4py(world)
        except ForeignMpi4py:
            if not over_pmi:
                raise
    if over_pmi:  # mpi4py's MPI_Init as a singleton left Hydra's PMI socket alone
        from crew.runtime import pmi

        try:
            address = pmi.share_from_rank0(int(pmi_fd), world.rank, host_address() if world.rank == 0 else None,
                                           timeout_s)
        except pmi.PmiError as error:
            raise CrewError(f"rank {world.rank} ({world.describe()}) could not learn rank 0's address over PMI: "
                            f"{error}. Pass it to every rank instead: -genv MASTER_ADDR <rank 0's host> -genv "
                            "MASTER_PORT 29500 (Open MPI: -x MASTER_ADDR=<host> -x MASTER_PORT=29500).") from None
        return dataclasses.replace(world, master_addr=address, master_from="rank 0's host, shared over PMI")
    raise CrewError(no_master_message(world, pmi_socket=pmi_fd.isdigit()))


def no_master_message(world: MpiWorld, pmi_socket: bool = False) -> str:
    """What a rank says when it cannot learn its master address or local rank: at once, before any wait."""
    spread = (f"{world.local_size} of its {world.world_size} ranks on this machine" if world.local_size is not None
              else f"{world.world_size} ranks, how many on this machine unknown")
    if world.master_addr is None:
        missing = f"no master address is known: MASTER_ADDR is unset, the ranks are not all here ({spread})"
        fixes = ["pass rank 0's host to every rank: mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ... "
                 "(MPICH, Intel MPI: -genv MASTER_ADDR <host> -genv MASTER_PORT 29500)"]
        if not pmi_socket:
            missing += ", this MPI gives the ranks no PMI socket (PMI_FD) to share rank 0's address over"
    else:
        missing = f"nothing says its local rank, its index among the ranks on its machine ({spread})"
        fixes = ["export LOCAL_RANK in each rank (a wrapper script around python)"]
    fixes.append("pip install mpi4py (built against this MPI), and crew agrees on it with mpi4py as DeepSpeed does")
    return (f"rank {world.rank} was started by {world.describe()} without crew run's RANK/LOCAL_RANK/MASTER_ADDR, "
            f"and {missing}, and mpi4py is not installed. Fix: {'; or '.join(fixes)}.")


def host_address() -> str:
    """This host's address as DeepSpeed's mpi_discovery takes rank 0's: `hostname -I`'s first, else the
    host name's."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else socket.gethostbyname(socket.gethostname())


class ForeignMpi4py(CrewError):
    """mpi4py is built against another MPI than the mpirun that started the job (it sees a world of one)."""


def _with_mpi4py(world: MpiWorld) -> MpiWorld:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (world.rank, world.world_size):
        raise ForeignMpi4py(f"mpi4py sees rank {comm.Get_rank()} of {comm.Get_size()} where {world.describe()} says "
                        f"rank {world.rank} of {world.world_size}: this mpi4py was built against another MPI "
                        "than the mpirun that started the job. Reinstall it for this one (MPICC=<its mpicc> "
                        "pip install --no-binary mpi4py mpi4py), or pass MASTER_ADDR and MASTER_PORT to every rank "
                             "(Open MPI: -x MASTER_ADDR=<rank 0's host>; MPICH, Intel MPI: -genv MASTER_ADDR <host>).")
    address = world.master_addr or comm.bcast(host_address() if world.rank == 0 else None, root=0)
    local_rank = world.local_rank
    if local_rank is None:  # as DeepSpeed: the ranks before this one on a host of the same name
        names = comm.allgather(MPI.Get_processor_name())
        local_rank = names[:world.rank].count(names[world.rank])
    how = world.master_from if world.master_addr else "rank 0's host, shared with mpi4py"
    return dataclasses.replace(world, master_addr=address, local_rank=local_rank, master_from=how)
