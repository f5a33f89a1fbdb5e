"""DeepSpeed's persistent parameters at stage 3: the small ones are never partitioned.

DeepSpeed 0.19.8 (parameter_offload.py mark_persistent_parameters) marks every parameter of at most
`stage3_param_persistence_threshold` elements (default 1e5: biases, norms) `ds_persist`, up to
`stage3_model_persistence_threshold` elements in all: each rank keeps it whole, so no forward or backward
gathers it. Here FSDP2 leaves those parameters alone (fully_shard's `ignored_params`) and every rank holds
each one whole, with rank 0's values:

- under fp16/bf16 the whole parameter is the fp32 master, as the shards are; through the model's forward it is
  seen in the compute dtype (a differentiable cast: its gradient comes back in fp32);
- its gradient is averaged over all ranks (under AutoTP: the data-parallel group) once per optimizer step, at the
  accumulation boundary, in one flat all-reduce in the communication dtype (DeepSpeed reduce-scatters it on every
  micro step with the others);
- every rank then steps the same values with the same gradient, so the copies stay equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from crew.runtime.zero import partition_parameters as pp


def choose(model: torch.nn.Module, param_threshold: int, model_threshold: int) -> list[torch.nn.Parameter]:
    """DeepSpeed's choice, in named_parameters order: each of at most `param_threshold` elements while the
    running total stays within `model_threshold`."""
    chosen, total = [], 0
    for _, param in model.named_parameters():
        numel = param.ds_numel if pp.is_partitioned(param) else param.numel()
        if numel + total > model_threshold:
            continue
        if numel <= param_threshold:
            chosen.append(param)
            total += numel
    return chosen


def mark(param: torch.nn.Parameter, ds_id: int) -> None:
    """DeepSpeed's attributes of a persistent parameter: whole and available, always."""
    param.__dict__.pop("ds_tensor", None)  # zero.Init's piece: the whole tensor is kept instead
    param.ds_id = ds_id
    param.ds_shape, param.ds_numel = param.shape, param.numel()
    param.ds_status = pp.ZeroParamStatus.AVAILABLE
    param.ds_persist = True
    param.ds_active_sub_modules = set()
    world = dist.get_world_size()
    param.partition_numel = lambda: -(-param.ds_numel // world)


# -- the forward, in the compute dtype --------------------------------------------------------------

def cast_in_forward(model: torch.nn.Module, params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
    """Through the model's forward every persistent floating-point parameter is seen in `dtype`, wherever it
    is read from (a head that reads the embedding's weight too); a module called outside it (a generation
    helper) sees its own so."""
    ids = {id(p) for p in params if p.is_floating_point()}
    places = [(module, name) for module in model.modules()
              for name, p in module._parameters.items() if p is not None and id(p) in ids]
    model.register_forward_pre_hook(_Cast(places, dtype))
    model.register_forward_hook(_uncast, always_call=True)
    for module in {id(m): m for m, _ in places if m is not model}.values():
        module.register_forward_pre_hook(_Cast([(module, name) for m, name in places if m is module], dtype))
        module.register_forward_hook(_uncast, always_call=True)


class _Cast:
    def __init__(self, places: list[tuple[torch.nn.Module, str]], dtype: torch.dtype) -> None:
        self.places, self.dtype = places, dtype

    def __call__(self, owner: torch.nn.Module, args) -> None:
        saved, casts = [], {}
        for module, name in self.places:
            param = module._parameters[name]
            if not isinstance(param, torch.nn.Parameter):
                continue  # cast already, by the model's forward around this call
            if id(param) not in casts:
                casts[id(param)] = param.to(self.dtype)  # differentiable: the gradient comes back in fp32
            module._parameters[name] = casts[id(param)]
            saved.append((module, name, param))
        owner.__dict__.setdefault("_crew_uncast", []).append(saved)


def _uncast(owner: torch.nn.Module, args, output) -> None:
    stack = owner.__dict__.get("_crew_uncast")
    if stack:
        for module, name, param in stack.pop():
            module._parameters[name] = param


# -- the gradients ------------------------------------------------------------------------------------

class PersistentGrads:
    """The persistent parameters' gradients, averaged over the ranks at the accumulation boundary."""

    def __init__(self, params: list[torch.nn.Parameter], reduce_dtype: torch.dtype, group=None) -> None:
        self.params = [p for p in params if p.is_floating_point()]
        self.reduce_dtype = reduce_dtype
        self.group = group  # AutoTP: the data-parallel group (a TP slice's copies); None: the world

    @contextlib.contextmanager
    def reducing(self, boundary: bool) -> Iterator[None]:
        yield
        trainable = [p for p in self.params if p.requires_grad]  # now: PEFT and TRL freeze and unfreeze
        if boundary and trainable and dist.get_world_size(self.group) > 1:
            self.reduce(trainable)

    @torch.no_grad()
    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        """One all-reduce for all of them: the gradients (zeros where a rank has none) and a count of the ranks
        that had each; a gradient no rank had stays None."""
        present = [p.grad is not None for p in params]
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        flat = torch.cat([*grads, torch.tensor(present, dtype=grads[0].dtype, device=grads[0].device)])
        flat = flat.to(self.reduce_dtype)
        counts_start = flat.numel() - len(params)
        flat[:counts_start].div_(dist.get_world_size(self.group))  # first, as DDP does: an fp16 sum stays in range
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for param, had, count in zip(params, present, flat[counts_start:].tolist()):
            piece = flat[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
            if count == 0:
                continue
            if had:
                param.grad.copy_(piece)
            else:
                param.grad = piece.to(param.dtype).clone()
