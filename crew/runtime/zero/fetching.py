"""DeepSpeed's stage-3 fetch controls on FSDP2's units: which units stay whole between their forward and their
backward, and how far ahead a unit's all-gather is started.

DeepSpeed 0.19.8 (partitioned_param_coordinator.py) records the order modules run in during the first step. From
then on, after a module's forward or backward it frees the module's parameters unless they are used again within
`stage3_max_reuse_distance` elements of parameters run in between (__params_to_release), and it fetches ahead up
to `stage3_prefetch_bucket_size` elements, as long as no more than `stage3_max_live_parameters` are whole at once.
With the defaults (1e9, 1e9, 5e7) a model under 5e8 parameters is gathered once per micro step, in its forward,
and stays whole until its backward; in a 7B model only the last blocks do.

Here the same from FSDP2's own controls: the first forward records the order of the units (and of the root's own
modules, which run between them); then each unit whose backward comes within the reuse distance (2 x the elements
run after it: forward, then backward in reverse) is not resharded after forward (`set_reshard_after_forward`), the
root neither (its parameters are the first the backward needs), and each unit prefetches the next units up to the
bucket size (`set_modules_to_forward_prefetch`, `set_modules_to_backward_prefetch`). Until then (the first step)
every unit is resharded after its forward, as DeepSpeed frees everything while its trace is incomplete.

A forward under torch.no_grad (evaluation, generation) has no backward to reshard in: its units are resharded
when it ends, so no whole unit outlives it (nor an optimizer step, which would leave the whole copy stale).
"""

from __future__ import annotations

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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
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


def install(model: torch.nn.Module, units: list[torch.nn.Module], rules: FetchPolicy) -> None:
    """Record the first forward's order of `units` and the root's own modules, then apply `rules` to them."""
    leaves = [m for m in _root_modules(model, units) if _numel(m, recurse=False)]
    order: list[torch.nn.Module] = []
    seen: set[int] = set()

    def record(module, args):
        if id(module) not in seen:
            seen.add(id(module))
            order.append(module)

    handles = [module.register_forward_pre_hook(record) for module in [*units, *leaves]]

    def first_forward_done(module, args, output):
        if not order:  # the forward did not run through the units (a part of the model called alone)
            return
        for handle in handles:
            handle.remove()
        done.remove()
        apply(model, order, {id(u) for u in units}, rules)

    done = model.register_forward_hook(first_forward_done)
    model.register_forward_hook(_reshard_without_backward)


def apply(model: torch.nn.Module, order: list[torch.nn.Module], unit_ids: set[int], rules: FetchPolicy) -> None:
    sizes = [_numel(module, recurse=id(module) in unit_ids) for module in order]
    units = [(position, module) for position, module in enumerate(order) if id(module) in unit_ids]
    kept = []
    for position, unit in units:
        between = 2 * sum(sizes[position + 1:])  # run after it in the forward, and again in the backward
        if between < rules.max_reuse:
            kept.append(unit)
    state(model).kept = {id(unit) for unit in kept}
    if not state(model).held:
        for unit in [model, *kept]:
            unit.set_reshard_after_forward(False, recurse=False)
    root = sum(_numel(module, recurse=False) for module in _root_modules(model, [u for _, u in units]))
    whole = root + sum(_numel(unit) for unit in kept)
    forward = [unit for _, unit in units]
    for index, unit in enumerate(forward):
        budget = min(rules.prefetch_bucket, rules.max_live - whole - _numel(unit))
        unit.set_modules_to_forward_prefetch(_ahead(forward[index + 1:], budget))
        backward_ahead = [u for u in reversed(forward[:index]) if u not in kept]
        if backward_ahead:  # an empty list would leave FSDP2's default (the next unit)
            unit.set_modules_to_backward_prefetch(_ahead(backward_ahead, budget) or backward_ahead[:1])
    log_rank0("ZeRO stage 3: %d of %d units stay whole from forward to backward (stage3_max_reuse_distance %.0e); "
              "prefetch up to %.0e elements (stage3_prefetch_bucket_size)", len(kept), len(forward),
              rules.max_reuse, rules.prefetch_bucket)


def _ahead(candidates: list[torch.nn.Module], budget: int) -> list[torch.nn.Module]:
    """DeepSpeed's prefetch loop: take the next ones while fewer than `budget` elements are taken."""
    taken, elements = [], 0
    for unit in candidates:
        if elements >= budget:
            break
        taken.append(unit)
        elements += _numel(unit)
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
    return sum(param.numel() for param in module.parameters(recurse=recurse))
