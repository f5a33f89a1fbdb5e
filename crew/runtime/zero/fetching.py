"""DeepSpeed's stage-3 fetch controls on FSDP2's units: which units stay whole between their forward and their
backward, and how far ahead a unit's all-gather is started.

DeepSpeed 0.19.8 (partitioned_param_coordinator.py) records the order modules run in during the first step. From
then on, after a module's forward or backward it frees the module's parameters unless they are used again within
`stage3_max_reuse_distance` elements of parameters run in between (__params_to_release), and it fetches ahead up
to `stage3_prefetch_bucket_size` elements, as long as no more than `stage3_max_live_parameters` are whole at once.
With the defaults (1e9, 1e9, 5e7) a model under 5e8 parameters is gathered once per micro step, in its forward,
and stays whole until its backward; in a 7B model only the last blocks do.

Here the same from FSDP2's own controls. Consecutive units up to the prefetch bucket are sharded as one FSDP2 unit
(a group: one all-gather and one reduce-scatter for all, as DeepSpeed's fetch with its prefetch is one all-gather).
The first forward records the order of the groups (and of the root's own modules, which run between them); then
each group whose backward comes within the reuse distance (2 x the elements run after it: forward, then backward in
reverse) is not resharded after forward (`set_reshard_after_forward`), the root neither (its parameters are the
first the backward needs), and each group prefetches the next groups up to the bucket size
(`set_modules_to_forward_prefetch`, `set_modules_to_backward_prefetch`). Until then (the first step) every unit is
resharded after its forward, as DeepSpeed frees everything while its trace is incomplete.

A forward under torch.no_grad (evaluation, generation) has no backward to reshard in: its units are resharded
when it ends, so no whole unit outlives it (nor an optimizer step, which would leave the whole copy stale).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from crew.errors import ConfigError
from crew.log import log_rank0

# zero_optimization key -> DeepSpeed 0.19.8's default (deepspeed/runtime/zero/config.py)
DEFAULTS = {"stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9,
            "stage3_prefetch_bucket_size": 5 * 10**7, "stage3_param_persistence_threshold": 10**5,
            "stage3_model_persistence_threshold": sys.maxsize}


@dataclass(frozen=True)
class FetchPolicy:
    max_live: int = DEFAULTS["stage3_max_live_parameters"]
    max_reuse: int = DEFAULTS["stage3_max_reuse_distance"]
    prefetch_bucket: int = DEFAULTS["stage3_prefetch_bucket_size"]
    persist_param: int = DEFAULTS["stage3_param_persistence_threshold"]  # persistence.py
    persist_model: int = DEFAULTS["stage3_model_persistence_threshold"]


def policy(extra: dict[str, Any]) -> FetchPolicy:
    """The section's stage-3 controls, checked as DeepSpeed's config checks them (whole numbers >= 0)."""
    values = [_elements(key, extra.get(key, default)) for key, default in DEFAULTS.items()]
    return FetchPolicy(*values)


def _elements(key: str, value: Any) -> int:
    if value == "auto":  # left unfilled (Accelerate and transformers fill it from the model's hidden size)
        return DEFAULTS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or value != int(value):
        raise ConfigError(f"zero_optimization.{key} is {value!r}: give a number of parameter elements >= 0 "
                          f"(DeepSpeed's default is {DEFAULTS[key]:.0e}), or leave it out.")
    return int(value)


@dataclass
class _State:
    """A model's fetch state: the units kept whole from forward to backward, and whether every unit is held
    whole for now (TRL's generation: parameter_offload.py), which no forward may undo."""
    kept: set[int] = field(default_factory=set)
    held: bool = False


def state(model: torch.nn.Module) -> _State:
    found = model.__dict__.get("_crew_fetch")
    if found is None:
        found = model.__dict__["_crew_fetch"] = _State()
    return found


def reshards_after_forward(model: torch.nn.Module, unit: torch.nn.Module) -> bool:
    """The rules' choice for `unit` (the root: never; before the first forward: every other unit)."""
    return unit is not model and id(unit) not in state(model).kept


def grouped(units: list[torch.nn.Module], bucket: int) -> list[list[torch.nn.Module]]:
    """Consecutive units gathered together, up to `bucket` elements a group (one unit alone when it is larger):
    DeepSpeed fetches a module's parameters and prefetches the next ones in one all-gather up to
    stage3_prefetch_bucket_size; one FSDP2 unit of several modules does the same in one call, and reduce-scatters
    their gradients in one call too."""
    groups: list[list[torch.nn.Module]] = []
    size = 0
    for unit in units:
        numel = _numel(unit)
        if groups and size + numel <= bucket:
            groups[-1].append(unit)
            size += numel
        else:
            groups.append([unit])
            size = numel
    return groups


def install(model: torch.nn.Module, groups: list[list[torch.nn.Module]], rules: FetchPolicy) -> None:
    """Record the first forward's order of the unit `groups` and the root's own modules, then apply `rules`."""
    members = [unit for group in groups for unit in group]
    leaves = [m for m in _root_modules(model, members) if _numel(m, recurse=False)]
    order: list[list[torch.nn.Module]] = []  # a group, or [leaf]

    def recorder(entry):
        def record(module, args):
            if not any(entry is seen for seen in order):
                order.append(entry)
        return record

    handles = [unit.register_forward_pre_hook(recorder(group)) for group in groups for unit in group]
    handles += [leaf.register_forward_pre_hook(recorder([leaf])) for leaf in leaves]

    def first_forward_done(module, args, output):
        if not order:  # the forward did not run through the units (a part of the model called alone)
            return
        for handle in handles:
            handle.remove()
        done.remove()
        apply(model, order, [id(group) for group in groups], rules)

    done = model.register_forward_hook(first_forward_done)
    model.register_forward_hook(_reshard_without_backward)


def apply(model: torch.nn.Module, order: list[list[torch.nn.Module]], group_ids: list[int],
          rules: FetchPolicy) -> None:
    """`order`: the unit groups and the root's own modules ([leaf]) as the first forward ran them."""
    is_group = [id(entry) in group_ids for entry in order]
    sizes = [sum(_numel(m, recurse=group) for m in entry) for entry, group in zip(order, is_group)]
    groups = [(position, entry) for position, (entry, group) in enumerate(zip(order, is_group)) if group]
    kept = [entry for position, entry in groups
            if 2 * sum(sizes[position + 1:]) < rules.max_reuse]  # run after it in the forward, again in the backward
    state(model).kept = {id(unit) for group in kept for unit in group}
    if not state(model).held:
        for unit in [model, *(group[0] for group in kept)]:  # a group's modules share one FSDP2 state
            unit.set_reshard_after_forward(False, recurse=False)
    whole = sum(size for size, group in zip(sizes, is_group) if not group) + sum(_size(g) for g in kept)
    forward = [entry for _, entry in groups]
    for index, group in enumerate(forward):
        budget = min(rules.prefetch_bucket, rules.max_live - whole - _size(group))
        group[0].set_modules_to_forward_prefetch([g[0] for g in _ahead(forward[index + 1:], budget)])
        backward_ahead = [g for g in reversed(forward[:index]) if not any(g is k for k in kept)]
        if backward_ahead:  # an empty list would leave FSDP2's default (the next unit)
            ahead = _ahead(backward_ahead, budget) or backward_ahead[:1]
            group[0].set_modules_to_backward_prefetch([g[0] for g in ahead])
    log_rank0("ZeRO stage 3: %d of %d unit groups stay whole from forward to backward (stage3_max_reuse_distance "
              "%.0e); groups and prefetch up to %.0e elements (stage3_prefetch_bucket_size)", len(kept),
              len(forward), rules.max_reuse, rules.prefetch_bucket)


def _size(group: list[torch.nn.Module]) -> int:
    return sum(_numel(unit) for unit in group)


def _ahead(candidates: list[list[torch.nn.Module]], budget: int) -> list[list[torch.nn.Module]]:
    """DeepSpeed's prefetch loop: take the next groups while fewer than `budget` elements are taken."""
    taken, elements = [], 0
    for group in candidates:
        if elements >= budget:
            break
        taken.append(group)
        elements += _size(group)
    return taken


def _reshard_without_backward(model: torch.nn.Module, args, output) -> None:
    if not torch.is_grad_enabled():
        reshard_all(model)


def reshard_all(model: torch.nn.Module) -> None:
    """Every unit back to its shards (a no-op for those already sharded), unless they are held whole."""
    if state(model).held:
        return
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _root_modules(model: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules whose parameters the root unit holds: those not inside a unit."""
    inside = {id(sub) for unit in units for sub in unit.modules()}
    return [module for module in model.modules() if id(module) not in inside]


def _numel(module: torch.nn.Module, recurse: bool = True) -> int:
    """Its parameters' elements, whole (zero.Init's placeholders and FSDP2's shards know their whole size)."""
    return sum(getattr(param, "ds_numel", None) or param.numel() for param in module.parameters(recurse=recurse))
