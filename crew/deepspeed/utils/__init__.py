"""`deepspeed.utils`: the logger (crew's, a logging.Logger: transformers sets its level), log_dist and the
`logging` module they come from (DeepSpeed's deepspeed/utils/logging.py; Lightning sets its logger's level),
RepeatingLoader, the full fp32 value of a parameter or its gradient at any ZeRO stage
(`safe_get_full_fp32_param`, `safe_get_full_grad`), the ZeRO-3 leaf-module flags (z3_leaf_module.py) and
`recursive_getattr`/`recursive_setattr` (module_utils.py)."""

from __future__ import annotations

import torch

from crew.deepspeed.utils import logging
from crew.deepspeed.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string
from crew.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr
from crew.deepspeed.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                                                 unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from crew.runtime import registry
from crew.runtime.data import RepeatingLoader

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "log_dist", "log_dist_once", "logger", "logging",
           "recursive_getattr", "recursive_setattr", "safe_get_full_fp32_param", "safe_get_full_grad",
           "set_log_level_from_string", "set_z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module", "z3_leaf_parameter"]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "full_tensor")


def _full(tensor: torch.Tensor, of: torch.Tensor | None = None) -> torch.Tensor:
    """Whole, fp32, detached; a sharded (stages 2-3) tensor is gathered: a collective. A new tensor for a stage-3
    parameter `of` kept whole (ds_persist), as DeepSpeed's stage 3 gives its whole parameters' values."""
    if _is_dtensor(tensor):
        return tensor.full_tensor().detach().float()
    whole = tensor.detach().float()
    return whole.clone() if getattr(of, "ds_persist", False) else whole


def _engine_of(param: torch.Tensor):
    """The live engine training `param`: the one holding an fp32 master for it, else its module's."""
    engines = registry.live_engines()
    with_master = (e for e in engines if e.precision.master_of(param) is not param)
    owning = (e for e in engines if any(p is param for p in e.module.parameters()))
    found = next(with_master, None)
    return found if found is not None else next(owning, None)


def _from_owner(engine):
    """Stage 2's collective that fetches an owned master or gradient from its owner rank; else None."""
    return getattr(engine.optimizer, "from_owner", None) if engine is not None else None


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The whole fp32 value of `param` at any stage: the fp32 master copy when crew keeps one (fp16,
    bf16), else the param; from its owner rank at stage 2, gathered from the shards at stage 3 (all ranks
    call)."""
    engine = _engine_of(param)
    fetch = _from_owner(engine)
    if fetch is not None:
        master = fetch(param)
        return master if master is not None else param.detach().float()
    return _full(engine.precision.master_of(param) if engine is not None else param, of=param)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 gradient of `param` between backward and step (averaged over ranks on the
    boundary micro step, unscaled under fp16); None when it has none. At stages 2-3 a collective."""
    engine = _engine_of(param)
    fetch = _from_owner(engine)
    if fetch is not None:  # stage 2: the owner's reduced gradient, in the model's dtype, loss scale included
        grad = fetch(param, grad=True)
        scale = engine.precision.loss_scale
        return None if grad is None else grad / scale if scale not in (None, 1.0) else grad
    master = engine.precision.master_of(param) if engine is not None else param
    grad = master.grad if master is not param and master.grad is not None else param.grad
    if grad is None:
        return None
    full = _full(grad, of=param)
    scale = engine.precision.loss_scale if engine is not None and grad is param.grad else 1.0
    return full / scale if scale not in (None, 1.0) else full
