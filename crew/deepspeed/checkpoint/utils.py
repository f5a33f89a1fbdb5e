"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`, as in DeepSpeed 0.19.8.

The file-name helpers of DeepSpeed's module (get_model_ckpt_name_for_rank, ...) name DeepSpeed's
checkpoint files, which crew's checkpoints do not have: refused by name.
"""

from __future__ import annotations

import torch

from crew.deepspeed.errors import UnsupportedAttribute, unsupported

__all__ = ["clone_tensors_for_torch_save"]

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item, device=_CPU):
    """A copy of `item` whose tensors (nested in lists, tuples and dicts too) are detached copies on
    `device`: torch.save then writes each tensor's own bytes, not the whole storage it is a view of.
    Anything else is returned as is; a dict keeps its type (an OrderedDict stays one)."""
    if torch.is_tensor(item):
        if type(device) is str:
            device = torch.device(device)
        if device == item.device:
            return item.detach().clone()
        return item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple([clone_tensors_for_torch_save(v, device) for v in item])
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(f"checkpoint.utils.{name}"), name=name, obj=None)
