"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam with DeepSpeed's signatures, on torch.optim.Adam.

adam_w_mode (adamw_mode) True is AdamW's decoupled weight decay (the same steps as torch.optim.AdamW),
False is Adam with L2 weight decay added to the gradient, as in DeepSpeed. torch's fused kernel runs
on CUDA (as the config's "Adam" does, crew/runtime/optim.py). torch always corrects the moments' bias:
bias_correction=False is refused.
"""

from __future__ import annotations

import inspect

import torch

from crew.errors import CrewError
from crew.runtime.optim import adam_kernel

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")
    if not bias_correction:
        raise CrewError(f"{name}(bias_correction=False) is not supported by crew: torch's Adam always "
                        "corrects the moments' bias. Drop bias_correction=False.")


class _Adam(torch.optim.Adam):
    """torch's Adam, with AdamW's decoupled weight decay when `decoupled` (done by hand on a torch
    too old for Adam(decoupled_weight_decay=True): param *= 1 - lr * weight_decay, as AdamW does)."""

    def __init__(self, params, lr, betas, eps, weight_decay, decoupled: bool) -> None:
        params = list(params)
        self._manual_decay = decoupled and not _HAS_DECOUPLED
        extra = {"decoupled_weight_decay": decoupled} if _HAS_DECOUPLED else {}
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **adam_kernel(params),
                         **extra)
        if self._manual_decay:
            for group in self.param_groups:
                group["decoupled_decay"], group["weight_decay"] = group["weight_decay"], 0.0

    @torch.no_grad()
    def step(self, closure=None):
        if self._manual_decay:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None and group["decoupled_decay"]:
                        param.mul_(1 - group["lr"] * group["decoupled_decay"])
        return super().step(closure)


class FusedAdam(_Adam):
    """DeepSpeed's FusedAdam: AdamW, or Adam with L2 weight decay when adam_w_mode=False."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0., amsgrad=False, set_grad_none=True):
        _check("FusedAdam", bias_correction, amsgrad)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        super().__init__(params, lr, betas, eps, weight_decay, decoupled=adam_w_mode)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(_Adam):
    """DeepSpeed's DeepSpeedCPUAdam (note adamw_mode, not adam_w_mode); the states are fp32 always."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        _check("DeepSpeedCPUAdam", bias_correction, amsgrad)
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, lr, betas, eps, weight_decay, decoupled=adamw_mode)
