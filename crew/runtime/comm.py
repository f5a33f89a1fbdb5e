"""The process group: join it from the launcher's environment, and DeepSpeed's `deepspeed.comm` calls.

Works under `crew run`, torchrun, DeepSpeed's launcher (all set RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK), under plain mpirun (the world from MPI's variables: crew/runtime/mpi_env.py), and
as a single process with no launcher at all (a world of one).
The collectives also work before/without a process group, as the identity on a world of one.
"""

from __future__ import annotations

import datetime
import os
import re
import sys

import torch
import torch.distributed as dist

from crew.errors import CrewError
from crew.log import log_rank0
from crew.runtime import mpi_env

# The oldest torch crew runs on (pyproject.toml says the same; docs/versions.md): FSDP2's set_reshard_after_forward
# is 2.8's, and 2.8's gloo reduce-scatter sums where FSDP2 asks for the average (stage 3 on CPUs). Checked here,
# the one crew.runtime module every engine, ZeRO and checkpoint path imports, for a torch pip did not choose
# (PYTHONPATH on a machine with its own).
TORCH_FLOOR = (2, 9)


def require_torch_floor(version: str = torch.__version__) -> None:
    """A CrewError naming the installed torch, the floor and the fix when `version` is older than the floor.
    Only major.minor count: a build such as 2.9.0a0+gitabc (NVIDIA's containers) is a 2.9."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise CrewError(f"crew needs torch >= {floor}; this Python ({sys.executable}) has torch {version} "
                        f"({os.path.dirname(torch.__file__)}). Install a newer one (pip install 'torch>={floor}') "
                        f"or run crew with a Python that has one.")


require_torch_floor()

ReduceOp = dist.ReduceOp
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _default_timeout() -> datetime.timedelta:
    """DeepSpeed's default_pg_timeout: DEEPSPEED_TIMEOUT minutes; unset, torch's 30 (DeepSpeed's is 10)."""
    value = os.environ.get("DEEPSPEED_TIMEOUT", "30")
    try:
        return datetime.timedelta(minutes=int(value))
    except ValueError:
        raise CrewError(f"DEEPSPEED_TIMEOUT={value!r}: expected whole minutes, e.g. DEEPSPEED_TIMEOUT=30.") from None


DEFAULT_TIMEOUT = _default_timeout()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the default process group (DeepSpeed's signature); a no-op when already joined.

    The group comes from the launcher's environment, or from init_method (with rank and world_size, as
    torch takes them); with neither, a world of one. dist_backend None: NCCL on a GPU, else gloo.
    auto_mpi_discovery: where a launcher's variables are missing and MPI's are set (plain mpirun), the
    world comes from those, the master port being MASTER_PORT or distributed_port, as DeepSpeed's.
    config (comms logging) is not used.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise CrewError("init_distributed(dist_init_required=False) found no process group. Create it first "
                        "(torch.distributed.init_process_group), or leave dist_init_required out and crew "
                        "creates it.")
    if not isinstance(timeout, datetime.timedelta):
        raise CrewError(f"init_distributed(timeout={timeout!r}): expected a datetime.timedelta, e.g. "
                        "timedelta(minutes=30).")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _check_backend(backend)
    if auto_mpi_discovery and init_method in (None, "env://"):
        _discover_mpi_world(distributed_port, timeout, verbose)
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank())
    if init_method is None and world_size in (-1, 1) and not _launched():
        # Plain `python train.py`: a world of one, in memory; no port, no environment changes.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    if verbose:
        log_rank0("initializing %s process group: rank %s of %s, %s", backend,
                  rank if rank >= 0 else os.environ.get("RANK"),
                  world_size if world_size > 0 else os.environ.get("WORLD_SIZE"),
                  init_method or f"master {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank,
                            world_size=world_size)


def _discover_mpi_world(distributed_port: int, timeout: datetime.timedelta, verbose: bool) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from MPI's variables into os.environ, as
    DeepSpeed's discovery sets them, where a launcher did not. An MPI world of one with none of them set
    stays the in-memory world of one (no port)."""
    if not mpi_env.needs_discovery(os.environ):
        return
    world = mpi_env.find_mpi_world(os.environ, distributed_port)
    alone = world is not None and world.world_size == 1 and not any(name in os.environ for name in _LAUNCHER_VARS)
    if world is not None and not alone:
        _adopt(world, timeout, verbose)


def mpi_discovery(distributed_port: int = 29500, verbose: bool = True) -> None:
    """DeepSpeed's name: the world from MPI's variables into RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT (init_distributed does this itself where a launcher set none)."""
    world = mpi_env.find_mpi_world(os.environ, distributed_port)
    if world is None:
        raise CrewError("mpi_discovery(): no MPI variables here (OMPI_COMM_WORLD_RANK, PMI_RANK, MV2_COMM_WORLD_RANK, "
                        "PMIX_RANK): start the script with mpirun, or with crew run, which sets RANK and the rest.")
    _adopt(world, DEFAULT_TIMEOUT, verbose)


def _adopt(world: mpi_env.MpiWorld, timeout: datetime.timedelta, verbose: bool) -> None:
    world = mpi_env.settle(world, os.environ, timeout.total_seconds())
    os.environ.update(world.torchrun_env())
    if verbose:
        log_rank0("discovered %s: rank %s of %s, local rank %s, master %s:%s (%s)", world.flavour, world.rank,
                  world.world_size, world.local_rank, world.master_addr, world.master_port, world.master_from)


def _check_backend(backend: str) -> None:
    """A backend this machine cannot run: say so here, not deep inside torch (a CPU-only torch given
    'nccl' fails in torch.cuda.set_device with "module 'torch._C' has no attribute '_cuda_setDevice'")."""
    fix = ("Pass dist_backend='gloo' (e.g. --backend gloo), or leave it out: crew picks nccl on a GPU "
           "and gloo otherwise.")
    if backend.lower() == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        why = "this torch has no CUDA" if not torch.backends.cuda.is_built() else "no CUDA GPU is visible"
        raise CrewError(f"init_distributed(dist_backend={backend!r}): NCCL needs a CUDA GPU and {why}. {fix}")
    available = getattr(dist, "is_backend_available", None)
    if available is not None and ":" not in backend and not available(backend.lower()):
        raise CrewError(f"init_distributed(dist_backend={backend!r}): this torch has no {backend!r} backend. {fix}")


def _launched() -> bool:
    """Whether a launcher (crew, torchrun, DeepSpeed's) set the rendezvous variables."""
    present = [name for name in _LAUNCHER_VARS if name in os.environ]
    if present and len(present) < len(_LAUNCHER_VARS):
        missing = [name for name in _LAUNCHER_VARS if name not in os.environ]
        raise CrewError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: start the "
            "script with `crew run` (or torchrun), or unset them to run as a single process.")
    return bool(present)


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size(group=None) -> int:
    if dist.is_initialized():
        return dist.get_world_size(group)
    return int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if dist.is_initialized():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None):
    """DeepSpeed's all-reduce for its inference kernels (a shared-memory path on its CPU backend): in place
    and synchronous, as there."""
    return all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if dist.is_initialized():
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    if dist.is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    if dist.is_initialized():
        # torch 2.13 renamed it (the old name warns); same arguments
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, tensor, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    if dist.is_initialized():
        return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False):
    if dist.is_initialized():
        return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)
    output.copy_(tensor.reshape(output.shape))
    return None


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group=None,
               async_op: bool = False):
    if dist.is_initialized():
        return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    output_tensor_list[0].copy_(input_tensor_list[0])
    return None


def all_gather_object(object_list: list, obj, group=None):
    if dist.is_initialized():
        return dist.all_gather_object(object_list, obj, group=group)
    object_list[0] = obj
    return None


def broadcast_object_list(object_list: list, src: int, group=None, device=None):
    if dist.is_initialized():
        return dist.broadcast_object_list(object_list, src=src, group=group, device=device)
    return None


def new_group(ranks):
    """A process group of `ranks`; every rank of the world must call it, with the same ranks."""
    return dist.new_group(list(ranks))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The world rank of `group`'s rank `group_rank`."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    """The world ranks of `group`, in group rank order."""
    if group is None or not dist.is_initialized():
        return list(range(get_world_size()))
    return dist.get_process_group_ranks(group)


def get_world_group():
    return dist.group.WORLD


def destroy_process_group(group=None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)
