"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam with DeepSpeed's signatures, on torch.optim.Adam.

adam_w_mode (adamw_mode) True is AdamW's decoupled weight decay (the same steps as torch.optim.AdamW),
False is Adam with L2 weight decay added to the gradient, as in DeepSpeed; as there, the mode holds for
every param group, while lr, betas, eps and weight_decay are each group's own (Accelerate hands
DeepSpeedCPUAdam another optimizer's param_groups). torch's fused kernel runs on CUDA (as the config's
"Adam" does, crew/runtime/optim/__init__.py). bias_correction=False (per group, as DeepSpeed reads it) steps
without the moments' bias corrections, as FusedAdam does (crew/runtime/optim/adam.py). Unlike DeepSpeed's,
DeepSpeedCPUAdam also steps parameters that are not on the CPU.
"""

from __future__ import annotations

import inspect

import torch

from crew.deepspeed.ops._common import check_group, warn_low_precision_states
from crew.runtime.optim.adam import Adam as _BiasCorrectingAdam
from crew.runtime.optim import adam_kernel

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


class _Adam(_BiasCorrectingAdam):
    """torch's Adam, with AdamW's decoupled weight decay in every group when `decoupled` (done by hand on a
    torch too old for Adam(decoupled_weight_decay=True): param *= 1 - lr * weight_decay, as AdamW does)."""

    def __init__(self, name: str, params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                 decoupled: bool) -> None:
        self._name, self._decoupled = name, decoupled
        check_group(name, {"amsgrad": amsgrad}, {})
        params = list(params)
        self._manual_decay = decoupled and not _HAS_DECOUPLED
        extra = {"decoupled_weight_decay": decoupled} if _HAS_DECOUPLED else {}
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **adam_kernel(params),
                         bias_correction=bias_correction, **extra)

    def add_param_group(self, param_group: dict) -> None:
        check_group(self._name, param_group, self.defaults)
        if _HAS_DECOUPLED:
            param_group["decoupled_weight_decay"] = self._decoupled  # a group from torch's AdamW says True
        super().add_param_group(param_group)
        if self._manual_decay:
            group = self.param_groups[-1]
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
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        super().__init__("FusedAdam", params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         decoupled=adam_w_mode)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(_Adam):
    """DeepSpeed's DeepSpeedCPUAdam (note adamw_mode, not adam_w_mode)."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        self.adam_w_mode = adamw_mode  # DeepSpeed's attribute name
        self.fp32_optimizer_states = fp32_optimizer_states
        model_params = list(model_params)
        super().__init__("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         decoupled=adamw_mode)
        if fp32_optimizer_states:
            warn_low_precision_states("DeepSpeedCPUAdam", self.param_groups)
