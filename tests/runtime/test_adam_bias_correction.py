"""DeepSpeed's FusedAdam/DeepSpeedCPUAdam take bias_correction=False (the config's "Adam"/"AdamW" too); crew
used to refuse it. Each path now steps by DeepSpeed's update, lr * m / (sqrt(v) + eps) with no corrections
(written out below from deepspeed/ops/csrc/adam/multi_tensor_adam.cu's formula), also per param group and
through ZeRO's rebuild of the optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

import crew
from crew.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from crew.runtime.optim import build_optimizer

LR, DECAY, BETAS, EPS = 0.1, 0.1, (0.9, 0.999), 1e-8


def gradients() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(6, generator=generator) for _ in range(3)]


def start() -> torch.Tensor:
    return torch.linspace(-1, 1, 6)


def deepspeed_uncorrected(decoupled: bool) -> torch.Tensor:
    param, m, v = start(), torch.zeros(6), torch.zeros(6)
    for grad in gradients():
        if decoupled:
            param = param * (1 - LR * DECAY)
        else:
            grad = grad + DECAY * param
        m, v = BETAS[0] * m + (1 - BETAS[0]) * grad, BETAS[1] * v + (1 - BETAS[1]) * grad * grad
        param = param - LR * m / (v.sqrt() + EPS)
    return param


def stepped(make) -> torch.Tensor:
    param = torch.nn.Parameter(start())
    optimizer = make([param])
    for grad in gradients():
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


@pytest.mark.parametrize("decoupled", [True, False])
def test_every_way_to_ask_for_it_steps_as_deepspeed(decoupled):
    expected = deepspeed_uncorrected(decoupled)
    params = {"lr": LR, "weight_decay": DECAY, "bias_correction": False, "adam_w_mode": decoupled}
    ways = {
        "config Adam": lambda p: build_optimizer("Adam", dict(params), p),
        "FusedAdam": lambda p: FusedAdam(p, lr=LR, weight_decay=DECAY, bias_correction=False, adam_w_mode=decoupled),
        "DeepSpeedCPUAdam group": lambda p: DeepSpeedCPUAdam([{"params": p, "bias_correction": False}], lr=LR,
                                                             weight_decay=DECAY, adamw_mode=decoupled),
    }
    for name, make in ways.items():
        torch.testing.assert_close(stepped(make), expected, rtol=1e-6, atol=1e-7, msg=name)
    corrected = stepped(lambda p: FusedAdam(p, lr=LR, weight_decay=DECAY, adam_w_mode=decoupled))
    assert not torch.allclose(corrected, expected, atol=1e-3)  # bias correction does change these steps


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_rebuilds_it_with_bias_correction_off(stage):
    model = torch.nn.Linear(6, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(start())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY, "bias_correction": False}}}
    engine, _, _, _ = crew.initialize(model=model, config=config)
    for grad in gradients():  # d(w . g)/dw = g
        engine.backward(engine.module.weight.view(-1) @ grad)
        engine.step()
    torch.testing.assert_close(engine.module.weight.detach().view(-1), deepspeed_uncorrected(True), rtol=1e-6,
                               atol=1e-7)
    engine.destroy()


def test_a_state_saved_without_the_key_loads_and_steps_with_bias_correction():
    """A torch Adam's state, or one saved before crew read bias_correction: its groups lack the key."""
    param = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    saved.step()
    reference = torch.optim.AdamW([torch.nn.Parameter(param.detach().clone())], lr=0.1)
    reference.load_state_dict(copy.deepcopy(saved.state_dict()))  # each its own moments, as from a file
    loaded = FusedAdam([param], lr=0.1)
    loaded.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert loaded.param_groups[0]["bias_correction"] is True
    for optimizer in (loaded, reference):
        optimizer.param_groups[0]["params"][0].grad = torch.full((3,), 0.5)
        optimizer.step()
    torch.testing.assert_close(param, reference.param_groups[0]["params"][0], rtol=0, atol=0)
