"""Per-rank memory for model states at ZeRO stages 0-3, with and without CPU offload.

`crew estimate` prints this before a launch, so that a user facing OOM sees which stage would fit.

The memory model (Adam, as in the ZeRO paper, Rajbhandari et al. 2020, section 3.1), per parameter:

- fp32 training:          4 (params) + 4 (grads) + 8 (Adam exp_avg, exp_avg_sq)           = 16 bytes
- fp16/bf16 mixed:        2 (params) + 2 (grads) + 4 (fp32 master) + 8 (Adam)             = 16 bytes
  The fp32 master weights and Adam's two moments are counted together as "optimizer state" (12 bytes).

Stage 0 keeps a full copy of everything on each rank. Stage 1 shards the optimizer state over the
world size, stage 2 also the gradients, stage 3 also the parameters. A shard rounds up, as ZeRO pads
its partitions to a multiple of the world size. crew's stages follow this: at stage 2 every rank keeps
every parameter whole and only its own parameters' gradients, fp32 masters and Adam state, as in
DeepSpeed (its gradient buckets are transient and not counted, see below); at stage 1 each rank keeps
only its own parameters' fp32 masters too.

Offload is DeepSpeed's `offload_optimizer: {device: cpu}` for stages 1-3: the optimizer state (and
the fp32 master weights with it) lives in CPU memory; at stage 3 `offload_param` moves the parameter
shards there too. Offloaded parts count in `cpu_bytes` (per rank: a node needs that times its ranks)
instead of `device_bytes`. Gradients stay counted on the device. DeepSpeed has no offload without
ZeRO, so stage 0 has no offload row; crew itself offloads at stage 3 only (FSDP2's CPUOffloadPolicy).

Not included: activations, buffers (e.g. batch-norm statistics), temporary all-gather and bucket
buffers, the CUDA context and allocator fragmentation. Leave headroom for those (`crew estimate
--device_memory` keeps 20%).

Only `count_parameters` imports torch, and only when called.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass

from crew.errors import CrewError
from crew.units import GIB

HEADROOM = 0.2  # share of device memory kept free for activations and temporary buffers
STAGES = (0, 1, 2, 3)
# bytes per parameter: (params, grads, optimizer state)
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "fp16": (2, 2, 12), "bf16": (2, 2, 12)}
PRECISIONS = tuple(BYTES_PER_PARAM)

@dataclass(frozen=True)
class Row:
    """Model-state bytes held by one rank at one ZeRO stage; params/grads/optimizer wherever they live."""

    stage: int
    offload: bool
    params: int
    grads: int
    optimizer: int
    device_bytes: int
    cpu_bytes: int


def model_states_per_rank(num_params: int, world_size: int, precision: str = "bf16") -> list[Row]:
    """Rows for stages 0-3, each without offload and (stages 1-3) with it; see the module docstring."""
    if num_params < 1:
        raise CrewError(f"parameter count {num_params}: must be at least 1.")
    if world_size < 1:
        raise CrewError(f"world size {world_size}: must be at least 1.")
    if precision not in BYTES_PER_PARAM:
        raise CrewError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}.")
    param_bytes, grad_bytes, optimizer_bytes = BYTES_PER_PARAM[precision]
    shard = -(-num_params // world_size)
    rows = []
    for stage in STAGES:
        params = (shard if stage >= 3 else num_params) * param_bytes
        grads = (shard if stage >= 2 else num_params) * grad_bytes
        optimizer = (shard if stage >= 1 else num_params) * optimizer_bytes
        for offload in (False, True) if stage else (False,):
            on_cpu = optimizer + (params if stage == 3 else 0) if offload else 0
            rows.append(Row(stage, offload, params, grads, optimizer,
                            device_bytes=params + grads + optimizer - on_cpu, cpu_bytes=on_cpu))
    return rows


def world_size_from(world_size: int | None, num_gpus: int | None, num_nodes: int | None,
                    local_gpus: int) -> int:
    """--world_size W, or --num_gpus G x --num_nodes N; G defaults to this machine's GPUs (or 1)."""
    if world_size is not None and (num_gpus is not None or num_nodes is not None):
        raise CrewError("give --world_size, or --num_gpus and --num_nodes, not both.")
    if world_size is None:
        world_size = (num_gpus if num_gpus is not None else max(local_gpus, 1)) * (num_nodes or 1)
        flags = f"--num_gpus {num_gpus} --num_nodes {num_nodes}"
    else:
        flags = f"--world_size {world_size}"
    if world_size < 1 or (num_nodes is not None and num_nodes < 1):
        raise CrewError(f"{flags}: the world needs at least 1 rank.")
    return world_size


def fit(row: Row, device_memory: int) -> str:
    """'yes' within the headroom, 'tight' if it fits only without it, else 'no'."""
    if row.device_bytes <= (1 - HEADROOM) * device_memory:
        return "yes"
    return "tight" if row.device_bytes <= device_memory else "no"


def format_count(num_params: int) -> str:
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if num_params >= scale:
            return f"{num_params / scale:.2f}{suffix}"
    return str(num_params)


def format_table(rows: list[Row], num_params: int, world_size: int, precision: str,
                 device_memory: int | None = None) -> str:
    lines = [f"model states per rank: {format_count(num_params)} parameters ({num_params:,}), "
             f"world size {world_size}, {precision} + Adam (GiB)"]
    head = ["stage", "offload", "params", "grads", "optimizer", "per device", "per rank CPU"]
    if device_memory:
        head.append(f"fits {device_memory / GIB:.0f} GiB")
    table = [head]
    for row in rows:
        cells = [str(row.stage), "cpu" if row.offload else "no"]
        cells += [f"{n / GIB:.2f}" for n in (row.params, row.grads, row.optimizer, row.device_bytes,
                                             row.cpu_bytes)]
        table.append(cells + ([fit(row, device_memory)] if device_memory else []))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for cells in table:
        lines.append("  ".join(c.ljust(w) if i in (1, 7) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))).rstrip())
    lines.append("offload cpu = offload_optimizer device cpu (stage 3: also offload_param); CPU memory "
                 "is per rank, so a node needs it times its ranks.")
    lines.append("Not included: activations, buffers, temporary all-gather/bucket buffers, CUDA context.")
    if device_memory:
        lines.append(f"fits: yes = at most {1 - HEADROOM:.0%} of device memory ({HEADROOM:.0%} left for "
                     "activations and buffers); tight = fits only without that headroom; no = too big.")
    return "\n".join(lines)


def count_parameters(spec: str) -> int:
    """Parameters of the model built by 'package.module:factory' (called with no arguments).

    The model is built on the meta device, so that a 70B model needs no memory; if the factory
    fails there (e.g. it reads tensor values), it is built again on the CPU, with a warning.
    Shared (tied) parameters count once, as `Module.parameters()` yields each tensor once.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute or ":" in attribute:
        raise CrewError(f"--model {spec!r}: expected 'package.module:factory', e.g. 'mymodels:build_gpt'.")
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise CrewError(f"--model {spec}: cannot import {module_name!r} ({exc}). Run from the folder "
                        "that holds it, or add it to PYTHONPATH.") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise CrewError(f"--model {spec}: {target.__name__!r} has no attribute {part!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise CrewError(f"--model {spec}: {attribute} is a {type(target).__name__}, not a callable "
                        "that returns the model.")
    import torch

    try:
        with torch.device("meta"):
            model = target()
    except Exception as exc:  # user code: any failure on meta gets one retry on the CPU
        warnings.warn(f"--model {spec}: building on the meta device failed ({type(exc).__name__}: "
                      f"{exc}); building it on the CPU instead.", stacklevel=2)
        try:
            model = target()
        except Exception as exc2:
            raise CrewError(f"--model {spec}: {attribute}() failed: {type(exc2).__name__}: {exc2}") from exc2
    if not isinstance(model, torch.nn.Module):
        raise CrewError(f"--model {spec}: {attribute}() returned a {type(model).__name__}, expected a "
                        "torch.nn.Module.")
    return sum(p.numel() for p in model.parameters())
