"""crew.runtime.optim against DeepSpeed 0.19.1's optimizer mapping and LR schedules.

Hard-coded sequences (`DS_*`) were produced by running deepspeed/runtime/lr_schedules.py from the
deepspeed==0.19.1 sdist on torch.optim.AdamW(lr=0.1), reading param_groups[0]["lr"] (and "betas") right
after construction and after each step(); a few entries are also checked by hand in comments. The
`ref_*` functions re-state DeepSpeed's formulas independently for wider parameter sweeps.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from crew.errors import ConfigError
from crew.runtime.optim.lion import DeepSpeedCPULion, FusedLion
from crew.runtime.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_optimizer,
    build_scheduler,
)


def make_optimizer(lrs=(0.1,), cls=torch.optim.AdamW, **kwargs):
    groups = [{"params": [torch.nn.Parameter(torch.ones(3))], "lr": lr} for lr in lrs]
    return cls(groups, lr=lrs[0], **kwargs)


def lr_trace(scheduler, steps, group=0):
    """lr right after construction, then after each of `steps` step() calls."""
    out = [scheduler.optimizer.param_groups[group]["lr"]]
    for _ in range(steps):
        scheduler.step()
        out.append(scheduler.optimizer.param_groups[group]["lr"])
    return out


def close(actual, expected):
    assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15)


# ------------------------------------------------------------- independent re-statements of the formulas


def ref_warmup_gamma(it, n, kind):
    n = max(2, n)
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


def ref_warmup_lr(it, lo, hi, n, kind):
    if it < 0:
        return lo
    return lo + (hi - lo) * (ref_warmup_gamma(it, n, kind) if it < max(2, n) else 1.0)


def ref_warmup_decay_lr(it, lo, hi, n, total, kind):
    n2 = max(2, n)
    if it < 0:
        return lo
    if it < n2:
        return lo + (hi - lo) * ref_warmup_gamma(it, n, kind)
    return lo + (hi - lo) * max(0.0, (total - it) / max(1, total - n2))


def ref_cosine_lr(it, base, total, n, min_ratio, cos_min, kind):
    n2 = max(2, n)
    if it < 0:
        return 0.0
    if it < n2:
        return base * (min_ratio + (1 - min_ratio) * ref_warmup_gamma(it, n, kind))
    progress = min(1.0, (it - n2 + 1) / max(1, total - n2))  # crew holds the floor after total_num_steps
    return base * (cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def ref_one_cycle(it, lo, hi, first, second):
    """(lr, beta1) with momentum 0.8..0.9 and no post-cycle decay; the cycle starts at it = -1."""
    pos = (it + 1) % (first + second)
    scale = pos / first if pos <= first else (first + second - pos) / second
    if it >= first + second:
        scale = 0.0
    return lo + (hi - lo) * scale, 0.9 - 0.1 * scale


# ------------------------------------------------------------------------------------------- WarmupLR

# warmup 0 -> 0.01 over 4 steps, log: it=1 is ln2/ln4 = 0.5 -> 0.005, it=2 ln3/ln4 -> 0.00792..., it>=3 -> max
DS_WARMUP_LOG = [0.0, 0.0, 0.005, 0.007924812503605782, 0.01, 0.01, 0.01]
# warmup 0.001 -> 0.01 over 4 steps, linear: it=3 is 0.001 + 0.009 * 3/4 = 0.00775, it=4 reaches max
DS_WARMUP_LINEAR = [0.001, 0.001, 0.0032500000000000003, 0.0055000000000000005, 0.007750000000000001,
                    0.010000000000000002, 0.010000000000000002]  # fmt: skip


def test_warmup_lr_log_matches_deepspeed():
    s = WarmupLR(make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="log")
    assert lr_trace(s, 6) == DS_WARMUP_LOG


def test_warmup_lr_linear_matches_deepspeed():
    s = WarmupLR(make_optimizer(), warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear")
    assert lr_trace(s, 6) == DS_WARMUP_LINEAR


def test_warmup_lr_log_rounds_like_deepspeed():
    # DeepSpeed computes (1 / ln n) * ln(it + 1), not ln(it + 1) / ln n: the last warmup step is 1 - 1e-16.
    s = WarmupLR(make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    assert lr_trace(s, 11)[1:] == [0.0, 0.30102999566398114, 0.4771212547196624, 0.6020599913279623,
                                   0.6989700043360186, 0.7781512503836435, 0.8450980400142567, 0.9030899869919433,
                                   0.9542425094393248, 0.9999999999999999, 1.0]  # fmt: skip


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 10])
def test_warmup_lr_against_formula(kind, n):
    s = build_scheduler("WarmupLR", {"warmup_min_lr": 0.002, "warmup_max_lr": 0.03, "warmup_num_steps": n,
                                     "warmup_type": kind}, make_optimizer())  # fmt: skip
    trace = lr_trace(s, 15)
    close(trace, [ref_warmup_lr(it, 0.002, 0.03, n, kind) for it in range(-1, 15)])
    assert trace[-1] == pytest.approx(0.03)


def test_warmup_lr_defaults():
    # DeepSpeed: min 0.0, max = the optimizer's lr, 1000 steps, log. it=1: 0.1 * ln2 / ln1000.
    s = build_scheduler("WarmupLR", {}, make_optimizer(lrs=(0.1,)))
    assert (s.warmup_num_steps, s.warmup_type, s.min_lrs, s.max_lrs) == (1000, "log", [0.0], [0.1])
    assert lr_trace(s, 2) == [0.0, 0.0, 0.010034333188799373]


def test_warmup_lr_max_defaults_to_each_groups_lr():
    # Departure from 0.19.1 (which gave every group group 0's lr), as DeepSpeed PR #8171.
    s = WarmupLR(make_optimizer(lrs=(0.1, 0.2)), warmup_num_steps=2)
    assert s.max_lrs == [0.1, 0.2]
    s.step(5)
    assert [g["lr"] for g in s.optimizer.param_groups] == [0.1, 0.2]


def test_warmup_lr_per_group_lists():
    s = WarmupLR(make_optimizer(lrs=(0.1, 0.2)), warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.3],
                 warmup_num_steps=4, warmup_type="linear")  # fmt: skip
    s.step(2)
    close([g["lr"] for g in s.optimizer.param_groups], [0.05, 0.01 + 0.29 * 0.5])
    assert s.get_last_lr() == [g["lr"] for g in s.optimizer.param_groups]


# -------------------------------------------------------------------------------------- WarmupDecayLR

# warmup 4 linear to 0.01, total 10: decays 0.01 * (10 - it) / 6 from it=4, reaches 0 at it=10, stays 0
DS_DECAY_LINEAR = [0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.008333333333333333, 0.006666666666666666, 0.005,
                   0.003333333333333333, 0.0016666666666666666, 0.0, 0.0, 0.0]  # fmt: skip
# warmup 4 log from 0.001 to 0.011, total 10: back to warmup_min_lr 0.001 at it=10 and after
DS_DECAY_LOG = [0.001, 0.001, 0.005999999999999999, 0.00892481250360578, 0.011, 0.011, 0.009333333333333332,
                0.007666666666666665, 0.005999999999999999, 0.004333333333333333, 0.002666666666666666, 0.001,
                0.001, 0.001]  # fmt: skip


def test_warmup_decay_linear_matches_deepspeed():
    s = WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_max_lr=0.01, warmup_num_steps=4,
                      warmup_type="linear")  # fmt: skip
    assert lr_trace(s, 13) == DS_DECAY_LINEAR


def test_warmup_decay_log_matches_deepspeed():
    params = {"total_num_steps": 10, "warmup_min_lr": 0.001, "warmup_max_lr": 0.011, "warmup_num_steps": 4}
    assert lr_trace(build_scheduler("WarmupDecayLR", params, make_optimizer()), 13) == DS_DECAY_LOG


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("n", "total"), [(5, 20), (1, 6), (8, 8), (10, 4)])
def test_warmup_decay_against_formula(kind, n, total):
    s = WarmupDecayLR(make_optimizer(), total_num_steps=total, warmup_min_lr=0.001, warmup_max_lr=0.05,
                      warmup_num_steps=n, warmup_type=kind)  # fmt: skip
    close(lr_trace(s, 30), [ref_warmup_decay_lr(it, 0.001, 0.05, n, total, kind) for it in range(-1, 30)])


def test_warmup_decay_max_default_is_0_001_not_optimizer_lr():
    s = build_scheduler("WarmupDecayLR", {"total_num_steps": 10}, make_optimizer(lrs=(0.1,)))
    assert s.max_lrs == [0.001]
    assert lr_trace(s, 3) == [0.0, 0.0, 0.00010034333188799373, 0.0001590404182398875]


# ------------------------------------------------------------------------------------- WarmupCosineLR

# base lr 0.1, warmup 4 log from ratio 0.1, cos_min_ratio 0.01, total 10. Construction: 0.0 (not 0.01).
# it=4: 0.01 + 0.99 * (1 + cos(pi/6)) / 2 = 0.93368... -> 0.0933...; it=9 (p = 1) -> 0.01 * 0.1.
DS_COSINE_LOG = [0.0, 0.010000000000000002, 0.05500000000000001, 0.08132331253245204, 0.1, 0.09336825748732973,
                 0.07525, 0.0505, 0.025750000000000012, 0.007631742512670284, 0.001]  # fmt: skip
DS_COSINE_LINEAR = [0.0, 0.010000000000000002, 0.0325, 0.05500000000000001, 0.07750000000000001,
                    0.09336825748732973, 0.07525, 0.0505, 0.025750000000000012, 0.007631742512670284,
                    0.001]  # fmt: skip


@pytest.mark.parametrize(("kind", "expected"), [("log", DS_COSINE_LOG), ("linear", DS_COSINE_LINEAR)])
def test_warmup_cosine_matches_deepspeed_then_holds_floor(kind, expected):
    params = {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4, "cos_min_ratio": 0.01,
              "warmup_type": kind}  # fmt: skip
    trace = lr_trace(build_scheduler("WarmupCosineLR", params, make_optimizer()), 30)
    assert trace[:11] == expected
    # DeepSpeed 0.19.1 climbs back to 0.0076, 0.0258, ... 0.1 here; crew holds the floor (later upstream fix).
    assert trace[11:] == [0.001] * 20


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("n", "total"), [(3, 12), (1, 5), (6, 6), (9, 4)])
def test_warmup_cosine_against_formula(kind, n, total):
    s = WarmupCosineLR(make_optimizer(lrs=(0.3, 0.03)), total_num_steps=total, warmup_min_ratio=0.05,
                       warmup_num_steps=n, cos_min_ratio=0.02, warmup_type=kind)  # fmt: skip
    for group, base in enumerate((0.3, 0.03)):
        s2 = copy.deepcopy(s)
        close(lr_trace(s2, 25, group), [ref_cosine_lr(it, base, total, n, 0.05, 0.02, kind) for it in range(-1, 25)])


def test_warmup_cosine_defaults():
    s = build_scheduler("WarmupCosineLR", {"total_num_steps": 3000}, make_optimizer(lrs=(0.1,)))
    assert (s.warmup_min_ratio, s.warmup_num_steps, s.cos_min_ratio, s.warmup_type) == (0.0, 1000, 0.0001, "log")
    assert lr_trace(s, 2) == [0.0, 0.0, 0.010034333188799373]
    s.step(2999)
    close(s.get_last_lr(), [0.1 * 0.0001])


# --------------------------------------------------------------------------------------------- OneCycle

# min 0.01 max 0.1, up 3 down 2, then decay every 2 steps: lr 0.01 / (1 + 0.5 * k/2), beta1 0.9 * (1 + 0.1 * k/2).
# Construction: lr 0.01 and betas (0.8, 0.99); beta2 is DeepSpeed's hard-coded 0.99.
DS_ONE_CYCLE = [(0.039999999999999994, 0.8666666666666667), (0.06999999999999999, 0.8333333333333334),
                (0.09999999999999999, 0.8), (0.055, 0.8500000000000001), (0.01, 0.9), (0.008, 0.9450000000000001),
                (0.006666666666666667, 0.9900000000000001), (0.005714285714285714, 1.035), (0.005, 1.08)]  # fmt: skip


def test_one_cycle_lr_and_momentum_match_deepspeed():
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3, "cycle_second_step_size": 2,
              "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}  # fmt: skip
    opt = make_optimizer()
    s = build_scheduler("OneCycle", params, opt)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]) == (0.01, (0.8, 0.99))
    seen = []
    for _ in DS_ONE_CYCLE:
        s.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]))
        assert opt.param_groups[0]["betas"][1] == 0.99
    assert seen == DS_ONE_CYCLE


@pytest.mark.parametrize(("first", "second"), [(4, None), (5, 2), (1, 3)])
def test_one_cycle_against_formula(first, second):
    s = OneCycle(make_optimizer(), 0.01, 0.1, cycle_first_step_size=first, cycle_second_step_size=second)
    total = first + (second or first)
    for it in range(total + 5):
        s.step()
        lr, beta1 = ref_one_cycle(it, 0.01, 0.1, first, second or first)
        close([s.optimizer.param_groups[0]["lr"], s.optimizer.param_groups[0]["betas"][0]], [lr, beta1])


def test_one_cycle_defaults():
    s = OneCycle(make_optimizer(), cycle_min_lr=0.01, cycle_max_lr=0.1)
    assert (s.first_step_size, s.second_step_size, s.decay_step_size, s.cycle_momentum) == (2000, 2000, 0, True)
    assert lr_trace(s, 3) == [0.01, 0.010045000000000016, 0.01008999999999999, 0.010135000000000005]
    assert s.optimizer.param_groups[0]["betas"] == (0.89985, 0.99)


def test_one_cycle_stair_counts_hold_steps():
    # Departure from 0.19.1 (stair counts ignored), as DeepSpeed PR #8179: 2 stairs per half of 4 steps.
    s = OneCycle(make_optimizer(), 0.01, 0.1, cycle_first_step_size=4, cycle_first_stair_count=2, cycle_momentum=False)
    close(lr_trace(s, 9), [0.01, 0.01, 0.055, 0.055, 0.1, 0.055, 0.055, 0.01, 0.01, 0.01])


def test_one_cycle_without_betas_leaves_sgd_momentum(caplog):
    opt = make_optimizer(cls=torch.optim.SGD, momentum=0.5)
    with caplog.at_level(logging.WARNING, logger="crew.runtime.optim"):
        s = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
    assert "cycle_momentum is off because SGD has no 'betas'" in caplog.text
    close(lr_trace(s, 4), [0.01, 0.055, 0.1, 0.055, 0.01])
    assert opt.param_groups[0]["momentum"] == 0.5 and "betas" not in opt.param_groups[0]


# ------------------------------------------------------------------------------------------ LRRangeTest


def test_lr_range_test_matches_deepspeed():
    params = {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 0.5}
    # continuous: it=0 -> 0.01 * (1 + 0.5 * 1/2) = 0.0125
    assert lr_trace(build_scheduler("LRRangeTest", params, make_optimizer()), 4) == [0.01, 0.0125, 0.015, 0.0175, 0.02]
    stairs = build_scheduler("LRRangeTest", {**params, "lr_range_test_staircase": True}, make_optimizer())
    assert lr_trace(stairs, 6) == [0.01, 0.01, 0.015, 0.015, 0.02, 0.02, 0.025]


def test_lr_range_test_defaults():
    s = LRRangeTest(make_optimizer())
    assert (s.min_lr, s.step_size, s.step_rate, s.staircase) == ([1e-3], 2000, 1.0, False)
    assert lr_trace(s, 2) == [0.001, 0.0010004999999999999, 0.001001]


# ------------------------------------------------------------------------------------ shared behaviour

ALL_SCHEDULES = [
    ("WarmupLR", {"warmup_max_lr": 0.05, "warmup_num_steps": 15, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_max_lr": 0.05, "warmup_num_steps": 4}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3, "decay_step_size": 2,
                  "decay_lr_rate": 0.3, "decay_mom_rate": 0.01}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "params"), ALL_SCHEDULES)
def test_state_dict_round_trip_resumes_the_sequence(name, params):
    straight = build_scheduler(name, params, make_optimizer())
    expected = lr_trace(straight, 20)[8:]  # after steps 8..20, i.e. iterations 7..19
    first = build_scheduler(name, params, make_optimizer())
    lr_trace(first, 7)
    state = first.state_dict()
    assert state == {"last_batch_iteration": 6}
    resumed_opt = make_optimizer()
    resumed = build_scheduler(name, params, resumed_opt)
    resumed.load_state_dict(copy.deepcopy(state))
    assert lr_trace(resumed, 13)[1:] == expected
    if name == "OneCycle":
        assert resumed_opt.param_groups[0]["betas"] == straight.optimizer.param_groups[0]["betas"]


@pytest.mark.parametrize(("name", "params"), ALL_SCHEDULES)
def test_get_last_lr_and_get_lr_follow_the_optimizer(name, params):
    s = build_scheduler(name, params, make_optimizer())
    assert s.get_last_lr() == [s.optimizer.param_groups[0]["lr"]]
    for _ in range(6):
        s.step()
        assert s.get_last_lr() == s.get_lr() == [s.optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize(("name", "params"), ALL_SCHEDULES)
def test_resume_argument_leaves_optimizer_until_step(name, params):
    reference = build_scheduler(name, params, make_optimizer())
    reference.step(6)
    opt = make_optimizer(lrs=(0.123,))
    s = build_scheduler(name, {**params, "last_batch_iteration": 5}, opt)
    assert opt.param_groups[0]["lr"] == 0.123
    with pytest.raises(RuntimeError, match="call step"):
        s.get_last_lr()
    s.step()
    expected = reference.optimizer.param_groups[0]["lr"]
    if name == "WarmupCosineLR":  # its base lr is the optimizer's lr: 0.123 here, 0.1 in the reference
        expected = expected / 0.1 * 0.123
    assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    assert s.last_batch_iteration == 6


def test_tensor_lr_is_updated_in_place():
    opt = make_optimizer(lrs=(torch.tensor(0.1),))
    tensor = opt.param_groups[0]["lr"]
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4)
    s.step(2)
    assert opt.param_groups[0]["lr"] is tensor
    assert tensor.item() == pytest.approx(DS_WARMUP_LOG[3])


def test_scheduler_accepts_wrapped_optimizer_and_keeps_params():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = make_optimizer()
    params = {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_max_lr": 0.01, "warmup_type": "linear"}
    frozen = copy.deepcopy(params)
    s = build_scheduler("WarmupDecayLR", params, Wrapper(opt))
    assert s.optimizer is opt and params == frozen
    assert lr_trace(s, 13) == DS_DECAY_LINEAR


def test_torch_scheduler_fallback():
    opt = make_optimizer()
    s = build_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(s, torch.optim.lr_scheduler.StepLR)
    for _ in range(4):
        opt.step()
        s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


# -------------------------------------------------------------------------------------- scheduler errors


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("WarmupCosine", {}, r"scheduler.type 'WarmupCosine' .* Did you mean 'WarmupCosineLR'\?"),
        ("warmuplr", {}, r"case-sensitive.* Did you mean 'WarmupLR'\?"),
        ("Bogus", {}, r"scheduler.type 'Bogus' .*Supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"),
        (None, {}, r"scheduler.type: expected a name"),
        ("WarmupLR", {"warmup_steps": 10},
         (r"scheduler.params.warmup_steps: WarmupLR has no parameter 'warmup_steps'. Did you mean "
          r"'warmup_num_steps'\? Accepted: warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, "
          r"last_batch_iteration.")),
        ("WarmupDecayLR", {"warmup_num_steps": 10}, r"scheduler.params.total_num_steps: WarmupDecayLR requires it"),
        ("WarmupCosineLR", {}, r"scheduler.params.total_num_steps: WarmupCosineLR requires it"),
        ("OneCycle", {"cycle_max_lr": 0.1}, r"scheduler.params.cycle_min_lr: OneCycle requires it"),
        ("WarmupLR", {"warmup_max_lr": "auto"}, r"scheduler.params.warmup_max_lr: expected a number, got 'auto'"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, r"scheduler.params.warmup_min_lr: expected a number >= 0.0, got -0.1"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, r"scheduler.params.warmup_max_lr: got 2 values for 1 optimizer"),
        ("WarmupLR", {"warmup_num_steps": 10.5}, r"params.warmup_num_steps: expected a whole number, got 10.5"),
        ("WarmupLR", {"warmup_num_steps": -3}, r"scheduler.params.warmup_num_steps: expected a whole number >= 0"),
        ("WarmupLR", {"warmup_num_steps": True}, r"params.warmup_num_steps: expected a whole number, got True"),
        ("WarmupDecayLR", {"total_num_steps": "100"}, r"scheduler.params.total_num_steps: expected a whole number"),
        ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": None}, r"scheduler.params.cos_min_ratio: expected"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0},
         r"scheduler.params.cycle_first_step_size: expected a number > 0, got 0"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": "yes"},
         r"scheduler.params.cycle_momentum: expected true or false, got 'yes'"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, r"params.lr_range_test_step_size: expected a number > 0"),
        ("LRRangeTest", {"last_batch_iteration": -2}, r"params.last_batch_iteration: expected a whole number >= -1"),
        ("StepLR", {"gamma": 0.5}, r"scheduler.params.step_size: StepLR requires it"),
        ("StepLR", {"step_size": 2, "gama": 0.5},
         r"scheduler.params.gama: torch's StepLR has no parameter 'gama'. Did you mean 'gamma'\?"),
    ],
)  # fmt: skip
def test_scheduler_errors(name, params, message):
    frozen = copy.deepcopy(params)
    with pytest.raises(ConfigError, match=message):
        build_scheduler(name, params, make_optimizer())
    assert params == frozen


@pytest.mark.parametrize(("kind", "hint"), [("cosine", ""), ("Linear", " Did you mean 'linear'?")])
def test_an_unknown_warmup_type_warms_up_by_log_with_a_warning_as_deepspeed(kind, hint, caplog):
    made = [build_scheduler("WarmupLR", {"warmup_type": kind, "warmup_num_steps": 4}, make_optimizer()),
            build_scheduler("WarmupCosineLR", {"warmup_type": kind, "total_num_steps": 2000}, make_optimizer())]
    assert [s.warmup_type for s in made] == ["log", "log"]
    assert caplog.messages == [f"scheduler.params.warmup_type: expected 'log' or 'linear', got {kind!r}: warming "
                               f"up by 'log', as DeepSpeed does.{hint}"] * 2


# ----------------------------------------------------------------------------------------- optimizers


def one_step(opt, param, grad):
    param.grad = grad.clone()
    opt.step()
    return param.detach().clone()


def step_with(type_name, params, torch_cls, torch_kwargs):
    """One step of crew's optimizer and of the torch reference from the same start and gradient."""
    start, grad = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.1, -0.3])
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = build_optimizer(type_name, params, [a])
    return one_step(ours, a, grad), one_step(torch_cls([b], **torch_kwargs), b, grad), ours


def test_adam_is_decoupled_weight_decay():
    ours, adamw, opt = step_with("Adam", {"lr": 0.1, "weight_decay": 0.5}, torch.optim.AdamW,
                                 {"lr": 0.1, "weight_decay": 0.5})  # fmt: skip
    assert type(opt) is torch.optim.AdamW
    assert torch.equal(ours, adamw)
    _, l2, _ = step_with("Adam", {"lr": 0.1, "weight_decay": 0.5}, torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.5})
    assert not torch.allclose(ours, l2, atol=1e-3)  # decoupled: 1 - 0.1*(1 + 0.5*1) vs L2 folded into the moments


def test_adam_w_mode_false_is_l2():
    ours, l2, opt = step_with("Adam", {"lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False}, torch.optim.Adam,
                              {"lr": 0.1, "weight_decay": 0.5})  # fmt: skip
    assert type(opt) is torch.optim.Adam and torch.equal(ours, l2)


def test_adamw_name_forces_decoupled_even_with_adam_w_mode_false():
    ours, adamw, opt = step_with("AdamW", {"lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False}, torch.optim.AdamW,
                                 {"lr": 0.1, "weight_decay": 0.5})  # fmt: skip
    assert type(opt) is torch.optim.AdamW and torch.equal(ours, adamw)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "adam", "ADAMW"])
def test_adam_defaults_are_fused_adams(name):
    opt = build_optimizer(name, None, [torch.nn.Parameter(torch.zeros(2))])
    group = opt.param_groups[0]
    assert type(opt) is torch.optim.AdamW
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert group["amsgrad"] is False


def test_torch_adam_uses_torch_defaults_and_keys():
    # DeepSpeed passes params straight to torch here, so AdamW's own weight_decay default (0.01) applies.
    params = {"torch_adam": True, "amsgrad": True, "foreach": False}
    opt = build_optimizer("AdamW", params, [torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is torch.optim.AdamW
    assert (opt.param_groups[0]["weight_decay"], opt.param_groups[0]["amsgrad"]) == (0.01, True)
    opt = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": False}, [torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["weight_decay"] == 0


def test_params_are_not_mutated_and_betas_become_a_tuple():
    params = {"lr": 0.01, "betas": [0.8, 0.95], "torch_adam": False, "adam_w_mode": True, "bias_correction": True}
    frozen = copy.deepcopy(params)
    opt = build_optimizer("Adam", params, [torch.nn.Parameter(torch.zeros(2))])
    assert params == frozen
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]) == (0.01, (0.8, 0.95))


def test_torch_optim_names_pass_through():
    sgd = build_optimizer("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, [torch.nn.Parameter(torch.zeros(2))])
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["nesterov"] is True
    ada = build_optimizer("Adagrad", {}, [torch.nn.Parameter(torch.zeros(2))])
    assert type(ada) is torch.optim.Adagrad and ada.param_groups[0]["lr"] == 0.01  # torch's default, as DeepSpeed
    assert type(build_optimizer("rmsprop", {}, [torch.nn.Parameter(torch.zeros(2))])) is torch.optim.RMSprop


def test_set_grad_none_false_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="crew.runtime.optim"):
        build_optimizer("Adam", {"set_grad_none": False}, [torch.nn.Parameter(torch.zeros(2))])
    assert "set_grad_none=False is ignored" in caplog.text


@pytest.mark.parametrize("name", ["Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD",
                                  "Muon", "LBFGS", "SparseAdam"])  # fmt: skip
def test_unsupported_optimizer_names(name):
    with pytest.raises(ConfigError, match=rf"optimizer.type '{name}' \(.*\) is not available in crew. Use one of: "
                                          r"Adam, AdamW, Adagrad, SGD.*crew.initialize\(optimizer=...\)"):  # fmt: skip
        build_optimizer(name, {}, [torch.nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize(("name", "cpu_optimizer", "cls"), [
    ("Lion", False, FusedLion), ("lion", True, DeepSpeedCPULion), ("LION", False, FusedLion)])
def test_lion_is_deepspeeds_class_with_its_defaults(name, cpu_optimizer, cls):
    """engine.py _configure_basic_optimizer: DeepSpeedCPULion with offload_optimizer, else FusedLion; the params
    go to the class as they are, so its defaults (deepspeed/ops/lion/*.py) apply."""
    opt = build_optimizer(name, None, [torch.nn.Parameter(torch.zeros(2))], cpu_optimizer=cpu_optimizer)
    group = opt.param_groups[0]
    assert type(opt) is cls
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 0)
    assert opt.fp32_optimizer_states is True if cpu_optimizer else opt.set_grad_none is True


@pytest.mark.parametrize("cpu_optimizer", [False, True])
def test_lion_steps_by_lions_formula(cpu_optimizer):
    """Two steps by hand: c = b1 m + (1 - b1) g, p = p (1 - lr wd) - lr sign(c), m = b2 m + (1 - b2) g. The second
    step's c has the momentum's sign where the gradient's is the other (first entry) and the gradient's where it
    outweighs the momentum (third)."""
    lr, b1, b2, wd = 0.1, 0.8, 0.95, 0.5
    params = {"lr": lr, "betas": [b1, b2], "weight_decay": wd}
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = build_optimizer("Lion", params, [param], cpu_optimizer=cpu_optimizer)
    p, m = [1.0, -2.0, 3.0], [0.0, 0.0, 0.0]
    for grad in ([0.5, 0.1, -0.3], [-0.05, 0.4, 0.2]):
        c = [b1 * mi + (1 - b1) * g for mi, g in zip(m, grad)]
        p = [pi * (1 - lr * wd) - lr * math.copysign(1.0, ci) for pi, ci in zip(p, c)]
        before, m = m, [b2 * mi + (1 - b2) * g for mi, g in zip(m, grad)]
        one_step(opt, param, torch.tensor(grad))
        torch.testing.assert_close(param.detach(), torch.tensor(p))
        torch.testing.assert_close(opt.state[param]["exp_avg"], torch.tensor(m))
    assert c[0] > 0 > grad[0] and c[2] > 0 > before[2]  # the momentum won, then the gradient
    assert p == pytest.approx([0.7075, -2.0, 2.7025])  # 1 -> 0.95 - 0.1 -> 0.85 * 0.95 - 0.1; 3 -> 2.95 -> ...


@pytest.mark.parametrize(("cpu_optimizer", "params", "message"), [
    (False, {"eps": 1e-8}, r"optimizer.params.eps: Lion \(FusedLion\) has no parameter 'eps'. Accepted: lr, betas, "
                           r"weight_decay, set_grad_none."),
    (True, {"set_grad_none": True}, r"optimizer.params.set_grad_none: Lion \(DeepSpeedCPULion\) has no parameter "
                                    r"'set_grad_none'. Accepted: lr, betas, weight_decay, fp32_optimizer_states."),
    (False, {"weight_decy": 0.1}, r"optimizer.params.weight_decy: .* Did you mean 'weight_decay'\?"),
    (True, {"betas": [0.9, 1.0]}, r"optimizer.params.betas: expected a number >= 0.0 and < 1.0, got 1.0"),
    (False, {"lr": "auto"}, r"optimizer.params.lr: expected a number, got 'auto'"),
])  # fmt: skip
def test_lion_errors(cpu_optimizer, params, message):
    """The keys DeepSpeed's class takes (its TypeError otherwise), as crew's usual config error."""
    with pytest.raises(ConfigError, match=message):
        build_optimizer("Lion", params, [torch.nn.Parameter(torch.zeros(2))], cpu_optimizer=cpu_optimizer)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("AdamWW", {}, (r"optimizer.type 'AdamWW' is not a DeepSpeed or torch.optim optimizer. Did you mean "
                        r"'AdamW'\? Supported: Adam, AdamW, Adagrad, SGD")),
        ("Adamm", {}, r"Did you mean 'Adam'\?"),
        ("SDG", {}, r"Did you mean 'SGD'\?"),
        ("FusedAdam", {}, r"optimizer.type 'FusedAdam' is a DeepSpeed class, not a config name. Use \"Adam\""),
        (7, {}, r"optimizer.type: expected a name such as 'AdamW', got 7"),
        ("Adam", {"weight_decy": 0.1},
         (r"optimizer.params.weight_decy: Adam \(FusedAdam\) has no parameter 'weight_decy'. Did you mean "
          r"'weight_decay'\? Accepted: lr, bias_correction, betas, eps, weight_decay, amsgrad, set_grad_none, "
          r"torch_adam, adam_w_mode.")),
        ("AdamW", {"adamw_mode": True}, r"optimizer.params.adamw_mode: .* Did you mean 'adam_w_mode'\?"),
        ("Adam", {"foreach": True}, r"optimizer.params.foreach: Adam \(FusedAdam\) has no parameter 'foreach'"),
        ("AdamW", {"torch_adam": True, "bias_correction": True},
         r"optimizer.params.bias_correction: AdamW with torch_adam has no parameter"),
        ("SGD", {"lr": 0.1, "momentun": 0.9},
         r"optimizer.params.momentun: torch.optim.SGD has no parameter 'momentun'. Did you mean 'momentum'\?"),
        ("Adam", {"max_grad_norm": 1.0}, r"optimizer.params.max_grad_norm: .*\"gradient_clipping\": 1.0"),
        ("Adam", {"bias_correction": "no"}, r"optimizer.params.bias_correction: expected true or false, got 'no'"),
        ("Adam", {"amsgrad": True}, r"params.amsgrad: DeepSpeed's FusedAdam rejects AMSGrad.*\"torch_adam\": true"),
        ("Adam", {"torch_adam": "yes"}, r"optimizer.params.torch_adam: expected true or false, got 'yes'"),
        ("Adam", {"adam_w_mode": 0}, r"optimizer.params.adam_w_mode: expected true or false, got 0"),
        ("Adam", {"betas": [0.9]}, r"optimizer.params.betas: expected two numbers like \[0.9, 0.999\], got \[0.9\]"),
        ("Adam", {"betas": [0.9, 1.0]}, r"optimizer.params.betas: expected a number >= 0.0 and < 1.0, got 1.0"),
        ("Adam", {"lr": -1}, r"optimizer.params.lr: expected a number >= 0.0, got -1"),
        ("SGD", {"lr": "auto"}, r"optimizer.params.lr: expected a number, got 'auto'"),
    ],
)  # fmt: skip
def test_optimizer_errors(name, params, message):
    frozen = copy.deepcopy(params)
    with pytest.raises(ConfigError, match=message):
        build_optimizer(name, params, [torch.nn.Parameter(torch.zeros(2))])
    assert params == frozen


@pytest.mark.cuda  # the CPU half runs everywhere
def test_adam_uses_torchs_fused_kernel_on_cuda_only():
    from crew.runtime.optim import adam_kernel

    params = list(torch.nn.Linear(2, 2).parameters())
    assert adam_kernel(params) == {} and adam_kernel([{"params": params}]) == {}  # CPU: torch's own choice
    built = build_optimizer("Adam", {}, params)
    assert built.defaults["fused"] is None
    if torch.cuda.is_available():
        cuda = list(torch.nn.Linear(2, 2).cuda().parameters())
        assert build_optimizer("Adam", {}, cuda).defaults["fused"] is True
        assert build_optimizer("AdamW", {"torch_adam": True}, cuda).defaults["fused"] is None  # torch_adam: as given
