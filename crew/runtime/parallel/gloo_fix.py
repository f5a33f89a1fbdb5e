"""A torch bug that stops Hugging Face's sequence-parallel loss on CPU ranks, fixed while crew runs subgroups.

transformers' `deepspeed_sp_compute_loss` (and Accelerate's ALST example) averages the SP ranks' losses with
`torch.distributed.nn.functional.all_gather`, whose backward runs `_AlltoAll`. On gloo `_AlltoAll.forward`
scatters from `i`, a rank of the group, where `dist.scatter` wants a global rank: in any group that does not
start at rank 0 (SP 2 on 4 ranks: {2, 3}) the backward fails, "ValueError: Global rank 0 is not part of group"
(torch 2.9-2.13). NCCL takes another branch. The replacement is the same exchange from the global rank.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed.nn.functional as dist_functional


def _all_to_all_forward(ctx, group, out_tensor_list, *tensors):
    ctx.group = group
    size = dist.get_world_size(group=group)
    ctx.input_tensor_size_list = [tensors[i].size() for i in range(size)]
    tensors = tuple(t.contiguous() for t in tensors)
    if dist.get_backend(group=group) != dist.Backend.GLOO:
        dist.all_to_all(out_tensor_list, list(tensors), group=group)
        return tuple(out_tensor_list)
    mine = dist.get_rank(group=group)
    for i in range(size):
        dist.scatter(out_tensor_list[i], list(tensors) if i == mine else None,
                     src=dist.get_global_rank(group, i), group=group)
    return tuple(out_tensor_list)


def install() -> None:
    """From now on this process's differentiable collectives work in subgroups on gloo (idempotent)."""
    all_to_all = getattr(dist_functional, "_AlltoAll", None)
    if all_to_all is not None:
        all_to_all.forward = staticmethod(_all_to_all_forward)
