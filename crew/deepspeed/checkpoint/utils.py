"""`deepspeed.checkpoint.utils` as in DeepSpeed 0.19.8: clone_tensors_for_torch_save, and the names of a tag
folder's files (crew writes DeepSpeed's layout: crew/runtime/checkpoint/deepspeed_writing.py)."""

from __future__ import annotations

import os

import torch

from crew.deepspeed.errors import UnsupportedAttribute, unsupported

__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]

_CPU = torch.device("cpu")


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str):
    """base_folder/mp_rank_<mp_rank_str>_model_states.pt (mp_rank_str: "00")."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder, dp_rank, mp_rank):
    """base_folder/zero_pp_rank_<dp_rank>_mp_rank_<mp_rank, 2 digits>_optim_states.pt."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def get_layer_ckpt_name_for_rank(base_folder, layer_id, tp_rank):
    """A pipeline layer's file: base_folder/<layer_id>-model_<tp_rank, 2 digits>_model_states.pt."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}_model_states.pt")


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
