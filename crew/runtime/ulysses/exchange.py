"""The collectives Ulysses attention runs inside the model's forward, with their backward.

`swap_first_dim(x, group)`: x is [sp, ...]; slot i goes to SP rank i, and slot i of the result came from SP rank i.
Its backward is the same exchange, of the gradients. (An autograd Function over dist.all_to_all_single:
torch.distributed.nn.functional's, which does the same, is deprecated from torch 2.13.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SwapFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SwapFirstDim.apply(grad, ctx.group), None


def swap_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all over dim 0 of `x` ([sp, ...]) within the SP group."""
    return _SwapFirstDim.apply(x, group)


def gather_along_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """The SP ranks' `x` ([batch, local seq, ...]) joined on dim 1 in SP rank order; no gradient (position ids)."""
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)
