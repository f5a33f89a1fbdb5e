"""`deepspeed.moe.utils`: importable (cifar10_deepspeed.py imports it even without --moe); calling a
function refuses, naming mixture of experts, which crew does not provide."""

from __future__ import annotations

from crew.deepspeed.errors import UnsupportedAttribute, unsupported

__all__ = ["split_params_into_different_moe_groups_for_optimizer"]


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    raise UnsupportedAttribute(unsupported("moe.utils.split_params_into_different_moe_groups_for_optimizer"),
                               name="split_params_into_different_moe_groups_for_optimizer", obj=None)
