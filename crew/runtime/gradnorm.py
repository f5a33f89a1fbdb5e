"""The global gradient norm and clipping, computed as DeepSpeed 0.19.8's ZeRO optimizers compute them.

DeepSpeed takes each gradient's L2 norm in float64 and sums the squares in float64 (stage_1_and_2.py
`get_grad_norm_direct`, stage3.py `get_grad_norm_direct`). A float32 norm of one large tensor is off by
up to ~1e-4 relative on the CPU (the 1.35M-element tied embedding of UER-py: 1.6833813 instead of
1.6837267), and with `gradient_clipping` every clipped step then differs. So crew sums in float64 at
every stage and precision; the clip coefficient is DeepSpeed's `max_norm / (norm + 1e-6)`, at most 1.

Gradients may be whole (stages 0-1), owned by one rank each (stage 2: `across_ranks`), or FSDP2
DTensors (stage 3: each rank squares its shard; the sums are reduced over the mesh's sharded dims).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def global_norm(grads: Iterable[torch.Tensor], device: torch.device, across_ranks: bool = False) -> torch.Tensor:
    """The float64 L2 norm of every gradient, the same on every rank. `across_ranks`: each rank holds a
    disjoint part of the gradients (stage 2), so the sum of squares is all-reduced over the world."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    sharded: dict[tuple, list] = {}  # (mesh, its sharded dims) -> [mesh, dims, this rank's sum of squares]
    for grad in grads:
        mesh = getattr(grad, "device_mesh", None)
        if mesh is None:
            local += _square_sum(grad).to(device)
            continue
        dims = tuple(i for i, placement in enumerate(grad.placements) if placement.is_shard())
        entry = sharded.setdefault((id(mesh), dims), [mesh, dims, torch.zeros_like(local)])
        entry[2] += _square_sum(grad.to_local()).to(device)
    for mesh, dims, square in sharded.values():
        for dim in dims:
            dist.all_reduce(square, group=mesh.get_group(dim))
        local += square
    if across_ranks:
        dist.all_reduce(local)
    return local.sqrt()


def clip_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by max_norm / (norm + 1e-6) where that is below 1 (DeepSpeed's coefficient);
    stays on the device (no sync on the step)."""
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.mul_(coefficient.to(local.device, local.dtype))


def _square_sum(tensor: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(tensor, dtype=torch.float64).square()

