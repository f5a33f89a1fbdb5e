"""`deepspeed.utils.set_z3_leaf_modules` and its siblings, as in DeepSpeed 0.19.8: they flag modules
(`module._z3_leaf`) whose children ZeRO-3 should fetch in one go (mixture-of-experts layers; Accelerate
flags the classes named in ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES). At stages 0-2 DeepSpeed does not
read the flag, and neither does crew at any stage: its ZeRO-3 (FSDP2) gathers a whole wrapped block."""

from __future__ import annotations

import torch

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module", "z3_leaf_parameter"]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return hasattr(model, "_z3_leaf") and model._z3_leaf


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def _class_name(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _flag_modules(model: torch.nn.Module, classes: list, flag: bool, raise_if_not_found: bool) -> list:
    """Flag every module that is an instance of one of `classes` (types, or class names, short or
    fully qualified); ValueError when none is, unless told not to raise."""
    if not all(isinstance(cls, (type, str)) for cls in classes):
        raise AssertionError(f"leaf_module_classes must be a list of types or names, got {classes}")
    flagged = []
    for module in model.modules():
        if any(isinstance(module, cls) if isinstance(cls, type) else cls in (type(module).__name__,
                                                                             _class_name(module))
               for cls in classes):
            module._z3_leaf = flag
            flagged.append(module)
    if not flagged and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {model}")
    return flagged


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list,
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _flag_modules(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list,
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _flag_modules(model, leaf_module_classes, False, raise_if_not_found)
