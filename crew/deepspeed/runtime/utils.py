"""`deepspeed.runtime.utils`: see_memory_usage and set_random_seed, as in DeepSpeed 0.19.8."""

from __future__ import annotations

import gc
import random

import numpy
import torch

from crew.deepspeed.accelerator import get_accelerator
from crew.runtime import comm

__all__ = ["see_memory_usage", "set_random_seed"]

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
