"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedule names and classes (crew/runtime/optim/__init__.py).

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
# the schedules' parameter names, as DeepSpeed spells them for "scheduler.params"
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"


def get_torch_optimizer(optimizer):
    """DeepSpeed's helper: the torch optimizer itself, or the one a wrapper holds in `.optimizer`."""
    return _torch_optimizer(optimizer)


__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "get_torch_optimizer"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(f"runtime.lr_schedules.{name}"), name=name, obj=None)
