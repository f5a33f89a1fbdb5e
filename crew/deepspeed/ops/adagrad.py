"""`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad` with DeepSpeed 0.19.8's signature, on torch.optim.Adagrad.

DeepSpeed's kernel is torch's Adagrad with no lr decay and a zero initial accumulator: L2 weight decay
added to the gradient, sum += grad², param -= lr * grad / (sqrt(sum) + eps). A param group handed over
from torch's Adagrad (Accelerate does, when a config offloads the optimizer) keeps its lr, eps and
weight_decay, but not its lr_decay or initial_accumulator_value, which DeepSpeed's kernel does not have.
amsgrad is accepted and has no effect, as in DeepSpeed. Unlike DeepSpeed's, it also steps parameters
that are not on the CPU.
"""

from __future__ import annotations

import torch

from crew.deepspeed.ops._common import warn_low_precision_states

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(list(model_params), lr=lr, lr_decay=0, weight_decay=weight_decay,
                         initial_accumulator_value=0, eps=eps)
        if fp32_optimizer_states:
            warn_low_precision_states("DeepSpeedCPUAdagrad", self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        param_group["lr_decay"] = 0
        param_group["initial_accumulator_value"] = 0
        super().add_param_group(param_group)
