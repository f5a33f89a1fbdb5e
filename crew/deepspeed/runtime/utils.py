"""`deepspeed.runtime.utils`: see_memory_usage, set_random_seed and move_to_device, as in DeepSpeed 0.19.8."""

from __future__ import annotations

import gc
import random

import numpy
import torch

from crew.deepspeed.accelerator import get_accelerator
from crew.runtime import comm

__all__ = ["move_to_device", "see_memory_usage", "set_random_seed"]

_GIB = 2**30


def see_memory_usage(message: str, force: bool = False) -> None:
    """With force, rank 0 prints `message` and the accelerator's memory figures (GiB), then resets
    the peak; without it, nothing (DeepSpeed's default)."""
    if not force or comm.get_rank() != 0:
        return
    gc.collect()
    accelerator = get_accelerator()
    allocated = accelerator.memory_allocated() / _GIB
    peak = accelerator.max_memory_allocated() / _GIB
    print(message)
    print(f"MA {allocated:.2f} GB         Max_MA {peak:.2f} GB ")
    accelerator.reset_peak_memory_stats()


def set_random_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (torch's seeds the accelerator's too)."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def move_to_device(item, device, criterion_func=None):
    """`item` (a tensor, or lists, tuples and dicts of them, rebuilt as plain ones) on `device`. A tensor
    criterion_func accepts moves in place (its storage changes, so other references see the move); every
    other tensor is returned as a copy on `device`, as in DeepSpeed."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(value, device, criterion_func) for value in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(value, device, criterion_func) for value in item)
    if isinstance(item, dict):
        return {key: move_to_device(value, device, criterion_func) for key, value in item.items()}
    return item.to(device)
