"""The state dicts a checkpoint holds: the module's fp32 state, the optimizer's parameter names, the
replicated state split into byte-balanced parts and merged back, optimizer state by parameter name."""

from __future__ import annotations

import torch


def split_state(state: dict, parts: int) -> list[dict]:
    """Spread the module's tensors and the optimizer's per-parameter states over `parts` dicts,
    balanced by bytes; part 0 also holds everything else. The same on every rank (replicated state,
    deterministic order), so each rank can write its own part."""
    items = [("module", k, v) for k, v in state["module"].items()]
    items += [("optimizer_state", k, v) for k, v in state["optimizer"]["state"].items()]
    shards = [{"module": {}, "optimizer_state": {}} for _ in range(parts)]
    loads = [0] * parts
    for kind, key, value in sorted(items, key=lambda item: -_nbytes(item[2])):
        lightest = loads.index(min(loads))
        shards[lightest][kind][key] = value
        loads[lightest] += _nbytes(value)
    rest = {k: v for k, v in state.items() if k != "module"}
    rest["optimizer"] = {k: v for k, v in state["optimizer"].items() if k != "state"}
    shards[0].update(rest, module_keys=list(state["module"]))
    return shards


def merge_state(shards: list[dict]) -> dict:
    state = {k: v for k, v in shards[0].items() if k not in ("module", "optimizer_state", "module_keys")}
    module = {k: v for shard in shards for k, v in shard["module"].items()}
    state["module"] = {key: module[key] for key in shards[0]["module_keys"]}
    optimizer_state = {k: v for shard in shards for k, v in shard["optimizer_state"].items()}
    state["optimizer"] = {**state["optimizer"], "state": dict(sorted(optimizer_state.items()))}
    return state


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def optimizer_param_names(engine) -> list[str] | None:
    """The module's name for each tensor the optimizer steps (its fp32 master under fp16/bf16 at
    stages 0-2, or at stage 2 the stand-in of a master another rank keeps), in param_groups order;
    None when one of them is not a module parameter, or there is no optimizer."""
    if engine.optimizer is None:
        return None
    names = {id(engine.precision.master_of(param)): name
             for name, param in engine.module.named_parameters()}
    by_param = {id(param): name for name, param in engine.module.named_parameters()}
    for stand_in, param in getattr(engine.optimizer, "stand_ins", {}).items():
        names[stand_in] = by_param.get(id(param))
    found = [names.get(id(param)) for group in engine.optimizer.param_groups for param in group["params"]]
    return None if None in found else found


def groups_by_name(engine) -> list[dict] | None:
    """The optimizer's param groups with parameter names in place of tensors (None: see
    optimizer_param_names)."""
    names = optimizer_param_names(engine)
    if names is None:
        return None
    position = iter(names)
    return [{**{k: v for k, v in group.items() if k != "params"},
             "params": [next(position) for _ in group["params"]]}
            for group in engine.optimizer.param_groups]


def gathered_masters(engine, keep: bool = True) -> dict[str, torch.Tensor]:
    """ZeRO stage 2 under fp16/bf16: every fp32 master, from the rank that keeps it, by parameter
    name (a collective; {} elsewhere, and on the ranks that do not `keep` them)."""
    gather = getattr(engine.optimizer, "gather_masters", None)
    if gather is None:
        return {}
    whole = gather(keep)
    return {name: whole[id(param)] for name, param in engine.module.named_parameters() if id(param) in whole}


def fp32_module_state(engine, masters: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter as its fp32 master value (at ZeRO stage 2 pass
    `masters` from gathered_masters: this rank keeps only its own)."""
    masters = {**{name: engine.precision.master_of(param) for name, param in engine.module.named_parameters()},
               **(masters or {})}
    state = engine.module.state_dict()
    return {name: (masters[name] if name in masters else value).detach().to(
        torch.float32 if value.is_floating_point() else value.dtype).cpu()
        for name, value in state.items()}


def merge_by_name(first: dict, second: dict) -> dict:
    """Two {name: {key: value}} dicts (optimizer state by parameter name) as one."""
    return {name: {**first.get(name, {}), **second.get(name, {})}
            for name in list(first) + [name for name in second if name not in first]}
