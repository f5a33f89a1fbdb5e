"""What DeepSpeed's optimizers in deepspeed.ops share under crew: per-group checks and the states' dtype."""

from __future__ import annotations

import torch

from crew.log import warn_once

_FULL = (torch.float32, torch.float64)


def check_group(name: str, group: dict, defaults: dict) -> None:
    """DeepSpeed reads amsgrad per param group (a group handed over from another optimizer carries its own)
    and refuses it; torch's Adam would follow it. bias_correction is per group too (crew/runtime/optim/adam.py)."""
    if group.get("amsgrad", defaults.get("amsgrad", False)):
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")


def warn_low_precision_states(name: str, params: list) -> None:
    """torch's optimizers keep their states in the parameter's dtype; DeepSpeed's CPU optimizers keep
    fp32 states (fp32_optimizer_states=True) also for fp16/bf16 parameters. Under crew's engine the
    optimizer steps fp32 master weights, so this only shows with low-precision parameters used directly."""
    dtypes = {p.dtype for group in params for p in (group["params"] if isinstance(group, dict) else [group])}
    low = sorted(str(dtype).removeprefix("torch.") for dtype in dtypes if dtype not in _FULL)
    if low:
        warn_once(f"{name}: the optimizer states of {', '.join(low)} parameters are kept in that dtype (torch's "
                  "optimizers), not in fp32 as fp32_optimizer_states=True asks. Give the optimizer fp32 "
                  "parameters (crew's engine does: fp32 master weights) for fp32 states.")
