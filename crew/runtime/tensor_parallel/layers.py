"""AutoTP's parallel linear layers (DeepSpeed 0.19.8's module_inject/layers.py), as plain local shards.

    LinearLayer       column parallel: weight [out / tp, in]; input replicated, output split on its last dim
                      (gather_output=True: the output all-gathered whole, as DeepSpeed's training lm_head)
    LinearAllreduce   row parallel: weight [out, in / tp]; input split on its last dim, the partial outputs
                      all-reduced over the TP group, then the (replicated) bias added

Each rank's weight is an ordinary nn.Parameter holding its slice (no DTensor), so DDP, ZeRO 1-2 and any
torch optimizer see plain tensors. The TP collectives are autograd Functions (Megatron's f/g operators).

For checkpoints: a sharded parameter carries `crew_tp_dim`, the dimension of the whole weight it is split
along (0: column, 1: row); replicated parameters have no such attribute. `gather_full(param)` rebuilds the
whole weight (a collective over the TP group), `local_slice(whole, param)` cuts this rank's slice from a whole
tensor. Module attribute names stay `weight` / `bias`, so state_dict() keys are the model's own. A fused weight
split as sub-parameters (a layer spec's `shape`, subparams.py) also carries `crew_tp_layout`, its Layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from crew.runtime import parallel
from crew.runtime.tensor_parallel.subparams import Layout

TP_DIM = "crew_tp_dim"
TP_LAYOUT = "crew_tp_layout"


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: sum the input gradient over the TP group (each rank saw all of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum the partial outputs over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def _shard(tensor: torch.Tensor, dim: int, group, layout: Layout | None = None) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if layout is not None:
        return layout.cut(tensor, size, rank)
    return tensor.detach().chunk(size, dim=dim)[rank].clone()


def _split(source: torch.nn.Parameter, dim: int, group, layout: Layout | None = None) -> torch.nn.Parameter:
    """This rank's slice of `source` as a new parameter, marked with the dim (and layout) it was cut along."""
    param = torch.nn.Parameter(_shard(source, dim, group, layout), requires_grad=source.requires_grad)
    setattr(param, TP_DIM, dim)
    if layout is not None:
        setattr(param, TP_LAYOUT, layout)
    return param


class LinearLayer(torch.nn.Module):
    """Column-parallel nn.Linear: this rank's rows of the weight (and bias)."""

    def __init__(self, linear: torch.nn.Linear, group, gather_output: bool = False, name: str | None = None,
                 layout: Layout | None = None, bias_layout: Layout | None = None):
        super().__init__()
        self.mp_group, self.name, self.gather_output = group, name, gather_output
        self.tp_world_size = dist.get_world_size(group)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _split(linear.weight, 0, group, layout)
        if linear.bias is None or (layout is not None and bias_layout is None):  # whole: cut on the input dim
            self.bias = linear.bias
        else:
            self.bias = _split(linear.bias, 0, group, bias_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(_CopyToTP.apply(x, self.mp_group), self.weight, self.bias)
        return _GatherFromTP.apply(out, self.mp_group) if self.gather_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.weight.shape[0]}), bias={self.bias is not None}, gather_output={self.gather_output}")


class LinearAllreduce(torch.nn.Module):
    """Row-parallel nn.Linear: this rank's columns of the weight; the bias stays whole (added once, after
    the all-reduce)."""

    def __init__(self, linear: torch.nn.Linear, group, name: str | None = None, layout: Layout | None = None):
        super().__init__()
        self.mp_group, self.name = group, name
        self.tp_world_size = dist.get_world_size(group)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _split(linear.weight, 1, group, layout)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                        requires_grad=linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTP.apply(torch.nn.functional.linear(x, self.weight), self.mp_group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}")


def is_sharded(param: torch.Tensor) -> bool:
    return getattr(param, TP_DIM, None) is not None


def gather_full(param: torch.Tensor, group=None) -> torch.Tensor:
    """The whole tensor of a TP-sharded parameter (all-gathered over the TP group, every rank must call it);
    a replicated one as it is (detached). At ZeRO 3 (an FSDP2 DTensor) made whole over its data-parallel
    mesh first."""
    dim = getattr(param, TP_DIM, None)
    mine = _whole_over_dp(param) if hasattr(param, "full_tensor") else param.detach()
    if dim is None:
        return mine
    group = group if group is not None else parallel.tensor_parallel_group()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine.contiguous(), group=group)
    layout = getattr(param, TP_LAYOUT, None)
    return layout.join(parts) if layout is not None else torch.cat(parts, dim=dim)


def _whole_over_dp(value) -> torch.Tensor:
    """An FSDP2 shard made whole (a collective); an offloaded one (in host memory on a device mesh) is moved to
    the mesh's device first, as NCCL needs."""
    from torch.distributed.tensor import DTensor
    local = value.to_local()
    if local.device.type != value.device_mesh.device_type:
        value = DTensor.from_local(local.to(value.device_mesh.device_type), value.device_mesh, value.placements,
                                   shape=value.shape, stride=value.stride())
    return value.full_tensor().detach()


def local_slice(whole: torch.Tensor, param: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of `whole` (a tensor the shape of the whole weight) for the parameter `param`; `whole`
    itself for a replicated parameter (a copy). No communication."""
    dim = getattr(param, TP_DIM, None)
    if dim is None:
        return whole
    group = group if group is not None else parallel.tensor_parallel_group()
    size = dist.get_world_size(group)
    layout = getattr(param, TP_LAYOUT, None)
    if layout is not None:
        return _shard(whole, dim, group, layout)
    if whole.shape[dim] % size:
        raise ValueError(f"a whole tensor of shape {tuple(whole.shape)} does not split in {size} equal parts "
                         f"along dim {dim} (the tensor-parallel size)")
    return _shard(whole, dim, group)
