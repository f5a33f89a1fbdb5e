"""`deepspeed.utils.module_utils`: reach or replace a submodule by its dotted name, as DeepSpeed 0.19.8
(DeepSpeed-Chat swaps nn.Linear layers for its LoRA layers with these, through deepspeed.compression.helper)."""

from __future__ import annotations

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model, module_name: str):
    """`model.a.b.c` for "a.b.c": getattr one name at a time, so an nn.Sequential's "0" works and a missing
    name raises AttributeError naming it."""
    found = model
    for name in module_name.split("."):
        found = getattr(found, name)
    return found


def recursive_setattr(model, module_name: str, module) -> None:
    """`model.a.b.c = module` for "a.b.c": the last name is set on its parent with `__setattr__`, so an
    nn.Module parent registers a module (or parameter) the way an assignment would."""
    *path, last = module_name.split(".")
    parent = recursive_getattr(model, ".".join(path)) if path else model
    parent.__setattr__(last, module)
