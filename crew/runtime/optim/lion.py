"""Lion with DeepSpeed 0.19.8's two optimizers, on torch: DeepSpeedCPULion and FusedLion (their signatures and
updates). crew's config type "Lion" builds one of them (crew.runtime.optim); `deepspeed.ops.lion` exports them.

Lion (https://arxiv.org/abs/2302.06675): c = beta1 * m + (1 - beta1) * g; param = param * (1 - lr *
weight_decay) - lr * sign(c); m = beta2 * m + (1 - beta2) * g. The two DeepSpeed kernels differ where
c is exactly 0, and so do these: DeepSpeedCPULion takes the sign bit (copysign: +0 lowers the param by
lr), FusedLion takes c > 0 (0 raises it by lr). Both run on any device here (DeepSpeed's on the CPU and
CUDA only). DeepSpeedCPULion keeps fp32 momentum unless fp32_optimizer_states=False; FusedLion keeps it
in the parameter's dtype, as in DeepSpeed.
"""

from __future__ import annotations

import torch

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class _Lion(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, weight_decay) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype

    def _update(self, c: torch.Tensor, lr: float) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_param(param, group)
        return loss

    def _step_param(self, param: torch.Tensor, group: dict) -> None:
        if param.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients.")
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, dtype=self._state_dtype(param))
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        exp_avg = state["exp_avg"]
        grad = param.grad.float()
        value = param.float()  # computed in fp32, stored in the parameter's dtype, as both kernels do
        c = exp_avg.float() * beta1 + grad * (1 - beta1)
        if decay > 0:
            value.mul_(1 - lr * decay)
        param.copy_(value.add_(self._update(c, lr)))
        exp_avg.copy_(exp_avg.float().mul_(beta2).add_(grad, alpha=1 - beta2))


class DeepSpeedCPULion(_Lion):
    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, lr, betas, weight_decay)

    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else param.dtype

    def _update(self, c: torch.Tensor, lr: float) -> torch.Tensor:
        return torch.copysign(torch.full_like(c, lr), c).neg_()


class FusedLion(_Lion):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0., set_grad_none=True):
        self.set_grad_none = set_grad_none
        super().__init__(params, lr, betas, weight_decay)

    def _update(self, c: torch.Tensor, lr: float) -> torch.Tensor:
        return torch.where(c > 0, -lr, lr).to(c.dtype)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)
