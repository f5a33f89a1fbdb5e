"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedule names and classes (crew/runtime/optim.py).

Reachable as an attribute right after `import deepspeed`, as in DeepSpeed: Accelerate tells a
DeepSpeed scheduler by `type(scheduler).__name__ in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`.
The classes take DeepSpeed's constructor arguments and defaults and set the same lr at every step;
their docstrings name where crew departs from DeepSpeed. `get_torch_optimizer` is DeepSpeed's helper.
"""

from __future__ import annotations

from crew.deepspeed.errors import UnsupportedAttribute, unsupported
from crew.runtime.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, _torch_optimizer

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
TOTAL_NUM_STEPS = "total_num_steps"


def get_torch_optimizer(optimizer):
    """DeepSpeed's helper: the torch optimizer itself, or the one a wrapper holds in `.optimizer`."""
    return _torch_optimizer(optimizer)


__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "get_torch_optimizer"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(f"runtime.lr_schedules.{name}"), name=name, obj=None)
