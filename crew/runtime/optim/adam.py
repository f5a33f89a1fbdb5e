"""torch's Adam and AdamW with DeepSpeed FusedAdam's `bias_correction`, per param group.

torch always divides the moments by their bias corrections; DeepSpeed's FusedAdam (and DeepSpeedCPUAdam) take
`bias_correction=False` (BERT-style training, UER-py's `correct_bias=False`) and then step by
lr * m / (sqrt(v) + eps). Groups that correct bias go to torch's own step (its kernels and state layout); the
others take the same update without the corrections, keeping the same state keys, so checkpoints load either
way.
"""

from __future__ import annotations

import torch


class _BiasCorrection:
    """Mixin before torch.optim.Adam/AdamW: the `bias_correction` argument and group key."""

    def __init__(self, params, *args, bias_correction: bool = True, **kwargs) -> None:
        self._bias_correction = bias_correction
        super().__init__(params, *args, **kwargs)
        self.defaults["bias_correction"] = bias_correction

    def add_param_group(self, param_group: dict) -> None:
        param_group.setdefault("bias_correction", getattr(self, "_bias_correction", True))
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        """load_state_dict of a state without the key (torch's Adam, a checkpoint from before it): corrected."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        corrected = [group for group in self.param_groups if group["bias_correction"]]
        for group in self.param_groups:
            if not group["bias_correction"]:
                _uncorrected_step(self.state, group)
        if corrected:
            every, self.param_groups = self.param_groups, corrected
            try:
                super().step()
            finally:
                self.param_groups = every
        return loss


class Adam(_BiasCorrection, torch.optim.Adam):
    """torch.optim.Adam(..., bias_correction=True)."""


class AdamW(_BiasCorrection, torch.optim.AdamW):
    """torch.optim.AdamW(..., bias_correction=True)."""


def _uncorrected_step(state: dict, group: dict) -> None:
    """FusedAdam's update with bias_correction=False: L2 decay into the gradient, or AdamW's decoupled decay."""
    beta1, beta2 = group["betas"]
    lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", False)
    for param in group["params"]:
        if param.grad is None:
            continue
        grad = param.grad
        moments = state[param]
        if not moments:
            moments["step"] = torch.tensor(0.0)
            moments["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            moments["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        moments["step"] += 1
        if decay and decoupled:
            param.mul_(1 - lr * decay)
        elif decay:
            grad = grad.add(param, alpha=decay)
        moments["exp_avg"].lerp_(grad, 1 - beta1)
        moments["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        param.addcdiv_(moments["exp_avg"], moments["exp_avg_sq"].sqrt().add_(eps), value=-lr)
