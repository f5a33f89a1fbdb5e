"""`deepspeed.moe.utils`: importable (cifar10_deepspeed.py imports it even without --moe); param groups
without expert parameters pass through as in DeepSpeed, expert ones are refused (crew has no MoE)."""

from __future__ import annotations

from crew.deepspeed.errors import UnsupportedAttribute, unsupported

__all__ = ["split_params_into_different_moe_groups_for_optimizer"]


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """DeepSpeed's MoE docs build every model's param groups through this. Without expert parameters (crew
    has no MoE layers) DeepSpeed returns the groups as a list, unchanged: so does crew. An expert parameter
    (DeepSpeed marks one `allreduce=False`) is refused, naming mixture of experts."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    if any(getattr(param, "allreduce", True) is False for group in param_groups for param in group["params"]):
        raise UnsupportedAttribute(unsupported("moe.utils.split_params_into_different_moe_groups_for_optimizer"),
                                   name="split_params_into_different_moe_groups_for_optimizer", obj=None)
    return param_groups
