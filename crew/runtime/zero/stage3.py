"""Stage 3: FSDP2's fully_shard over the model's units, one unit group at a time.

A unit's parameters are made whole just before it is sharded (gathered from the ranks' pieces when the model
was built under zero.Init), and the whole copies are freed right after: no rank ever holds more than one unit
group whole (consecutive units up to stage3_prefetch_bucket_size, sharded as one FSDP2 unit: fetching.py). The
small parameters stay whole on every rank (persistence.py). The sharded parameters carry DeepSpeed's attributes
(`ds_id`, `ds_shape`, `ds_numel`, `ds_status`), so scripts that look for them (DeepSpeed-Chat, PEFT) see a ZeRO-3
model.

A module called outside its unit's forward (HF `generate` helpers, `get_input_embeddings()(ids)`) would meet
DTensor shards; a hook lets it see its parameters whole for that call, as DeepSpeed's hooks do. Such a call
computes no gradients for those parameters: with gradients enabled it is an error that says so.

`model.state_dict()` gives DeepSpeed's empty placeholders for the sharded parameters, as DeepSpeed's stage 3
does: code written for it (`save_pretrained` on every rank, with the whole weights passed on rank 0 only)
must not meet DTensors, whose operations can be collectives that only some ranks call. crew's own checkpoint
code (`shards_visible()`) and torch.distributed.checkpoint's state-dict functions see the shards.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from crew.errors import ConfigError, CrewError
from crew.log import log_rank0
from crew.runtime.tensor_parallel.layers import TP_DIM, TP_LAYOUT
from crew.runtime.tensor_parallel.spec_split import SUMMED
from crew.runtime.zero import external, fetching, gather, persistence
from crew.runtime.zero import partition_parameters as pp


def shard(model: torch.nn.Module, mesh, device: torch.device, wrap_rule, compute_dtype: torch.dtype | None,
          reduce_dtype: torch.dtype, offload: dict | None, stage: int,
          fetch: fetching.FetchPolicy) -> tuple[dict[int, torch.nn.Parameter], list[torch.nn.Parameter]]:
    """fully_shard the units and the root over `mesh` (1-D, or 2-D for HSDP), in place, gathering in
    `compute_dtype` and reducing gradients in `reduce_dtype`; the small parameters stay whole (persistence.py).
    Returns {id(old param): new}, so that parameter lists taken before sharding can be pointed at the sharded
    parameters, and the parameters kept whole."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    before = list(model.named_parameters(remove_duplicate=False))
    ds_ids = {name: p.ds_id for name, p in before if pp.is_zero_param(p)}
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
    if compute_dtype is not None or reduce_dtype != torch.float32:
        # inputs are not cast, as at stages 0-1 and in DeepSpeed: the same script runs at any stage
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                                    cast_forward_inputs=False)
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=offload["pin_memory"])
    persistent = persistence.choose(model, fetch.persist_param, fetch.persist_model)
    persistent += _hooked(model, persistent)
    kept_whole = {id(p) for p in persistent}
    options["ignored_params"] = set(persistent)
    units = [unit for unit in wrap_units(model, wrap_rule, keep_in_root=pp.external_parameters(model))
             if any(id(p) not in kept_whole for p in unit.parameters())]
    groups = fetching.grouped(units, fetch.prefetch_bucket)
    made_whole: set[int] = set()
    source = mesh.get_group() if mesh.ndim == 1 else None  # AutoTP: the data-parallel group of this TP slice
    for group in [*groups, [model]]:
        old = [param for module in group for param in _made_whole(module, device, made_whole, source)]
        fully_shard(group if len(group) > 1 else group[0], **options)
        for param in old:
            if id(param) not in kept_whole:
                pp.forget(param)  # FSDP2 copied its shard: free the whole tensor, even if the caller holds it
    tp_marks = {name: {a: getattr(p, a) for a in (TP_DIM, TP_LAYOUT) if hasattr(p, a)} for name, p in before
                if hasattr(p, TP_DIM)}
    current = dict(model.named_parameters(remove_duplicate=False))
    for name, param in current.items():
        if id(param) in kept_whole:
            ds_id = ds_ids.get(name)
            persistence.mark(param, ds_id if ds_id is not None else next(pp._next_id))
        else:
            _mark_partitioned(param, ds_ids.get(name), compute_dtype)
        for attribute, value in tp_marks.get(name, {}).items():  # an AutoTP slice (and a fused one's Layout),
            setattr(param, attribute, value)  # sharded here as any parameter: it stays one (gradient norm, saves)
    if compute_dtype is not None:
        persistence.cast_in_forward(model, persistent, compute_dtype)
    _see_whole_outside_forward(model)
    _tag_whole_in_forward(model)
    external.fetch_on_access(model, units)
    fetching.install(model, groups, fetch)
    for module in model.modules():
        module.ds_external_parameters = types.MethodType(_external_items, module)
    model.register_state_dict_post_hook(_placeholders)
    where = (f"{mesh.size()} ranks" if mesh.ndim == 1 else
             f"groups of {mesh.size(1)} ranks, replicated {mesh.size(0)} times (HSDP)")
    log_rank0("ZeRO stage %d: fully_shard within %s, %d wrapped units in %d groups (+ root)%s, gradients reduced "
              "in %s; %d parameters of at most %d elements (%d in all) whole on every rank "
              "(stage3_param_persistence_threshold)", stage, where, len(units), len(groups),
              ", CPU offload" if offload else "", str(reduce_dtype).split(".")[-1], len(persistent),
              fetch.persist_param, sum(p.numel() for p in persistent))
    return {id(p): current[name] for name, p in before if name in current}, persistent


def _hooked(model: torch.nn.Module, chosen: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters with gradient hooks of their own (AutoTP's Qwen3 q_norm / k_norm sum theirs over the TP
    group; a user's or PEFT's), not chosen already: FSDP2 would replace them and drop the hooks, where DeepSpeed's
    stage 3 runs them on the whole gradient, so they too stay whole. Said once when the hooks are not crew's."""
    taken = {id(p) for p in chosen}
    hooked = [p for p in dict.fromkeys(model.parameters()) if getattr(p, "_backward_hooks", None)
              and id(p) not in taken]
    foreign = {id(p) for p in hooked if not getattr(p, SUMMED, False)}
    names = [name for name, p in model.named_parameters() if id(p) in foreign]
    if names:
        log_rank0("ZeRO 3: %d parameter(s) with gradient hooks of their own (%s) stay whole on every rank, as the "
                  "small ones do: sharded, their hooks would not run. Each costs its whole size and optimizer state "
                  "on every rank.", len(names), ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    return hooked


def _made_whole(module: torch.nn.Module, device: torch.device, done: set[int],
                source_group=None) -> list[torch.nn.Parameter]:
    """The module's parameters not sharded yet, whole and on `device` (gathered if zero.Init split them), but
    those in `done` (made whole already, as part of a unit); `done` takes the others. Those built whole take
    the values of `source_group`'s first rank (None: the world's)."""
    params = [p for p in dict.fromkeys(module.parameters()) if not gather.is_shard(p) and id(p) not in done]
    done.update(id(p) for p in params)
    split = [p for p in params if pp.is_partitioned(p)]
    built_whole = [p for p in params if not pp.is_partitioned(p)]
    pp.gather(split)
    for param in params:
        param.data = param.data.to(device)
    _rank0s_values(built_whole, source_group)
    for buffer_owner in module.modules():
        for name, buffer in buffer_owner._buffers.items():
            if buffer is not None and buffer.device != device:
                buffer_owner._buffers[name] = buffer.to(device)
    return params


def _rank0s_values(params: list[torch.nn.Parameter], group=None) -> None:
    """A model built outside zero.Init may differ between ranks (unseeded init): every rank takes rank 0's
    values, as DeepSpeed's stage 3 does when it partitions such a model (Init(module=...) broadcasts). Under
    AutoTP `group` is the data-parallel group: its first rank holds the same TP slice, rank 0 another."""
    if torch.distributed.get_world_size(group) == 1:
        return
    source = torch.distributed.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for param in params:
            torch.distributed.broadcast(param.data, source, group=group)


def _mark_partitioned(param: torch.nn.Parameter, ds_id: int | None, compute_dtype: torch.dtype | None) -> None:
    param.ds_id = ds_id if ds_id is not None else next(pp._next_id)
    if compute_dtype is not None and param.is_floating_point():
        param.ds_compute_dtype = compute_dtype  # seen whole in it, as DeepSpeed's 16-bit parameters are
    param.ds_shape, param.ds_numel = param.shape, param.numel()
    param.partition_numel = _partition_numel(param.numel(), param.device_mesh.size(param.device_mesh.ndim - 1))
    param.ds_status = pp.ZeroParamStatus.NOT_AVAILABLE
    param.ds_persist = False
    param.ds_active_sub_modules = set()


def _partition_numel(numel: int, ranks: int):
    """DeepSpeed's `param.partition_numel()`: the size of one rank's (padded) partition (Lightning's model
    summary at stage 3 prints it)."""
    return lambda: -(-numel // ranks)


def _external_items(module: torch.nn.Module):
    """DeepSpeed's `module.ds_external_parameters()`: (key, parameter) pairs registered as external."""
    return getattr(module, "_external_params", {}).items()


# -- FSDP2's whole parameters, inside a unit's forward --------------------------------------------

def _tag_whole_in_forward(model: torch.nn.Module) -> None:
    """Inside a unit's forward its module attributes are FSDP2's whole parameters (plain Parameters): they
    carry the shard's DeepSpeed attributes with `ds_status` AVAILABLE, as DeepSpeed's fetched parameters do
    (TRL reads `lm_head.weight.ds_status` in the forward to decide whether to gather it)."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.register_forward_pre_hook(_tag_unsharded)  # after FSDP2's own, which unshards


def fsdp_params(unit: torch.nn.Module) -> list:
    """FSDP2's records of a unit's parameters (each: the shard `sharded_param`, the whole `_unsharded_param`)."""
    state = unit._get_fsdp_state()
    # torch 2.11 keeps a list of groups; 2.8-2.10 one group or None (docs/versions.md)
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    return [fsdp_param for group in groups if group is not None for fsdp_param in group.fsdp_params]


def _tag_unsharded(module: torch.nn.Module, args) -> None:
    for fsdp_param in fsdp_params(module):
        whole = getattr(fsdp_param, "_unsharded_param", None)
        if whole is None or "ds_status" in whole.__dict__:
            continue
        shard_param = fsdp_param.sharded_param
        for name in ("ds_id", "ds_shape", "ds_numel", "ds_persist", "ds_compute_dtype"):
            if hasattr(shard_param, name):
                setattr(whole, name, getattr(shard_param, name))
        whole.ds_active_sub_modules = set()
        whole.ds_status = pp.ZeroParamStatus.AVAILABLE


# -- state_dict() ------------------------------------------------------------------------------

_SHARDS_VISIBLE = 0


@contextlib.contextmanager
def shards_visible() -> Iterator[None]:
    """Inside: `model.state_dict()` holds the FSDP2 shards (DTensors), for torch.distributed.checkpoint."""
    global _SHARDS_VISIBLE
    _SHARDS_VISIBLE += 1
    try:
        yield
    finally:
        _SHARDS_VISIBLE -= 1


def _placeholders(module: torch.nn.Module, state: dict, prefix: str, local_metadata) -> None:
    if _SHARDS_VISIBLE or _called_from_torch_checkpoint():
        return
    for key, value in state.items():  # keep_vars=True: the parameter objects themselves, as DeepSpeed's
        if hasattr(value, "device_mesh") and not isinstance(value, torch.nn.Parameter):
            state[key] = torch.empty(0, dtype=value.dtype, device=value.device)


def _called_from_torch_checkpoint() -> bool:
    """torch.distributed.checkpoint's get_(model_)state_dict reads the shards through state_dict()."""
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            return True
        frame = frame.f_back
    return False


# -- calls outside a unit's forward ---------------------------------------------------------------

def _see_whole_outside_forward(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if not isinstance(module, FSDPModule) and module._parameters:
            module.register_forward_pre_hook(_view_shards)
            module.register_forward_hook(_end_views, always_call=True)


_VIEWING: dict[int, list[list[torch.nn.Parameter]]] = {}


def _view_shards(module: torch.nn.Module, args) -> None:
    shards = [p for p in module._parameters.values() if p is not None and gather.is_shard(p)]
    if shards and torch.is_grad_enabled() and any(p.requires_grad for p in shards):
        raise CrewError(
            f"{type(module).__name__} was called outside the forward of the model the engine wraps, with "
            "gradients enabled. At ZeRO stage 3 its parameters are sharded there, and gradients through such a "
            "call would not reach them: call it inside the model's forward, or under torch.no_grad().")
    for param in shards:
        gather.view_whole(param)
    _VIEWING.setdefault(id(module), []).append(shards)


def _end_views(module: torch.nn.Module, args, output) -> None:
    stack = _VIEWING.get(id(module))
    if not stack:
        return
    for param in stack.pop():
        gather.end_whole_view(param, None)
    if not stack:
        del _VIEWING[id(module)]


# -- the units ---------------------------------------------------------------------------------

def wrap_units(model: torch.nn.Module, rule: str | tuple[str, ...],
               keep_in_root: set[int] = frozenset()) -> list[torch.nn.Module]:
    """The submodules that become FSDP2 units under `rule`, parents never inside children. A module that
    holds a parameter another module's forward uses (register_external_parameter) stays in the root."""
    if isinstance(rule, tuple):
        units = [m for m in model.modules() if m is not model and type(m).__name__ in rule]
        if not units:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"zero_optimization.wrap names {list(rule)}, but the model has none "
                              f"of those classes; its module classes are {present}.")
    elif rule == "blocks":
        units = [child for stack in model.modules() if isinstance(stack, (torch.nn.ModuleList,
                 torch.nn.Sequential)) for child in _repeated(stack)]
        units = units or _children_with_params(model)
    else:
        units = _children_with_params(model)
    units = [u for u in _outermost(units) if not any(id(p) in keep_in_root for p in u.parameters())]
    return [u for u in units if not _tied_outside(u, model)]


def _tied_outside(unit: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether a parameter of `unit` is also another module's (a tied embedding and output layer): FSDP2
    refuses a parameter in two units, so such a module stays in the root's unit."""
    everywhere = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    inside = collections.Counter(id(p) for _, p in unit.named_parameters(remove_duplicate=False))
    return any(everywhere[key] > count for key, count in inside.items())


def _children_with_params(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [child for child in model.children() if _has_params(child)]


def _repeated(stack: torch.nn.Module) -> list[torch.nn.Module]:
    children = [c for c in stack.children() if _has_params(c)]
    kinds = [type(c) for c in children]
    return [c for c in children if kinds.count(type(c)) >= 2]


def _outermost(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    inner = {id(sub) for module in modules for sub in module.modules() if sub is not module}
    seen: set[int] = set()
    result = []
    for module in modules:
        if id(module) not in inner and id(module) not in seen:
            seen.add(id(module))
            result.append(module)
    return result


def _has_params(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None
