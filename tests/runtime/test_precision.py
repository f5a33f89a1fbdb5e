"""crew.runtime.precision: DeepSpeed's dynamic loss scale, fp32 master weights, fp16/bf16 on CPU."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO

from crew.errors import ConfigError, CrewError
from crew.launcher.plan.ports import free_port
from crew.runtime import precision as precision_module
from crew.runtime.precision import DynamicLossScaler, Precision, check_supported, make_precision


def fp16_config(**overrides) -> SimpleNamespace:
    """DeepSpeed's fp16 defaults (deepspeed/runtime/precision_config.py), enabled."""
    values = {"enabled": True, "loss_scale": 0.0, "initial_scale_power": 16,
              "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
              "min_loss_scale": 1}
    return SimpleNamespace(**{**values, **overrides})


OFF = SimpleNamespace(enabled=False)
BF16 = SimpleNamespace(enabled=True)


class AtMinimum(Exception):
    """DeepSpeed raises a bare Exception here: "Current loss scale already at minimum"."""


class ReferenceScaler:
    """DeepSpeed 0.19 DynamicLossScaler.update_scale, restated line by line (logging left out)."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise AtMinimum("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def run_pattern(scaler, pattern: str) -> list[tuple[float, int]]:
    """(scale, hysteresis left) after each step; 'O' is an overflowing step, 'C' a clean one."""
    out = []
    for step in pattern:
        scaler.update_scale(step == "O")
        out.append((scaler.cur_scale, scaler.cur_hysteresis))
    return out


PATTERNS = [
    "OCOOCCCOCO",
    "CCCCCCCCOCCCCCCCCC",
    "OOOCCCCCCCOOCCOCCCCCCCCCCOOOO",
    "COCOCOCOCOCCCCCCCCCCCC",
    "OOCCCCCCCCCCCCCOOOCCCCCCCOCOCO",
]


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_scale_sequence_matches_deepspeed_rules(pattern, window, consecutive, hysteresis):
    args = {"init_scale": 2.0 ** 12, "scale_window": window, "min_scale": 1.0,
            "delayed_shift": hysteresis, "consecutive_hysteresis": consecutive}
    assert run_pattern(DynamicLossScaler(**args), pattern) == run_pattern(ReferenceScaler(**args),
                                                                          pattern)


@pytest.mark.parametrize("hysteresis, consecutive, expected", [
    (2, False, [8, 8, 4, 2, 2, 2, 4, 4, 4, 2]),  # hysteresis refills only when the scale grows
    (2, True, [8, 8, 8, 4, 4, 4, 8, 8, 8, 8]),   # a clean step refills it
    (1, False, [4, 4, 2, 1, 1, 1, 2, 1, 1, 0.5]),
])
def test_scale_sequence_worked_by_hand(hysteresis, consecutive, expected):
    """Anchors the restatement above: init 8, window 2, min 0.5, steps O C O O C C C O C O."""
    scaler = DynamicLossScaler(8, 2, 0.5, hysteresis, consecutive)
    assert [scale for scale, _ in run_pattern(scaler, "OCOOCCCOCO")] == expected


def test_scale_doubles_on_every_window_of_clean_steps():
    scaler = DynamicLossScaler(init_scale=4, scale_window=3, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    scales = [scale for scale, _ in run_pattern(scaler, "C" * 10)]
    # stable interval = iteration - last overflow (-1) - 1 = iteration: grows at 3, 6, 9
    assert scales == [4, 4, 4, 8, 8, 8, 16, 16, 16, 32]


def test_overflow_at_min_scale_is_an_error_and_changes_nothing():
    scaler = DynamicLossScaler(init_scale=4, scale_window=100, min_scale=3, delayed_shift=1,
                               consecutive_hysteresis=False)
    scaler.update_scale(True)
    assert scaler.cur_scale == 3  # max(4 / 2, 3): floored, not 2
    before = scaler.state_dict()
    with pytest.raises(CrewError, match=r"minimum 3 \(fp16.min_loss_scale\)"):
        scaler.update_scale(True)
    assert scaler.state_dict() == before
    reference = ReferenceScaler(4, 100, 3, 1, False)
    reference.update_scale(True)
    with pytest.raises(AtMinimum):
        reference.update_scale(True)


def test_hysteresis_is_spent_before_the_min_scale_error():
    scaler = DynamicLossScaler(init_scale=1, scale_window=100, min_scale=1, delayed_shift=3,
                               consecutive_hysteresis=False)
    assert run_pattern(scaler, "OO") == [(1, 2), (1, 1)]
    with pytest.raises(CrewError):
        scaler.update_scale(True)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batch(dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=generator).to(dtype), torch.randint(0, 3, (8,),
                                                                             generator=generator)


def fp16_setup(**config):
    precision = make_precision(fp16_config(**config), OFF)
    model = tiny_model()
    precision.cast_module(model)
    masters = precision.master_params(list(model.parameters()))
    return precision, model, masters


def backward(precision: Precision, model: torch.nn.Module) -> None:
    x, y = batch(precision.dtype)
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    precision.scale_loss(loss).backward()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradient_skips_step_and_halves_scale(bad, caplog):
    precision, model, masters = fp16_setup(hysteresis=1)
    optimizer = torch.optim.SGD(masters, lr=0.1)
    before_model = [p.detach().clone() for p in model.parameters()]
    before_master = [m.detach().clone() for m in masters]
    backward(precision, model)
    with torch.no_grad():
        model[0].weight.grad[0, 0] *= bad

    with caplog.at_level(logging.INFO, logger="crew.runtime.precision"):
        overflow = precision.unscale_grads()
        if not overflow:
            optimizer.step()
            precision.copy_master_to_model()
        precision.update_scale(overflow)

    assert overflow is True
    assert all(m.grad is None for m in masters)
    assert all(torch.equal(a, b) for a, b in zip(before_master, masters))
    assert all(torch.equal(a, b) for a, b in zip(before_model, model.parameters()))
    assert precision.skipped_steps == 1
    assert precision.loss_scale == 2.0 ** 15
    assert "OVERFLOW! Skipping step. Attempted loss scale: 65536, reducing to 32768" in caplog.text


def test_overflow_inside_hysteresis_logs_and_keeps_scale(caplog):
    precision, model, _ = fp16_setup(hysteresis=2)
    backward(precision, model)
    model[2].bias.grad.fill_(float("inf"))
    with caplog.at_level(logging.INFO, logger="crew.runtime.precision"):
        precision.update_scale(precision.unscale_grads())
    assert precision.loss_scale == 2.0 ** 16 and precision.skipped_steps == 1
    assert "but hysteresis is 2. Reducing hysteresis to 1" in caplog.text


def test_clean_fp16_step_matches_fp32_step():
    precision, model16, masters = fp16_setup()
    # The fp32 reference starts from the fp16-rounded weights, so only the step's arithmetic differs.
    model32 = tiny_model()
    with torch.no_grad():
        for p32, p16 in zip(model32.parameters(), model16.parameters()):
            p32.copy_(p16.float())
    x, y = batch()
    torch.nn.functional.cross_entropy(model32(x), y).backward()
    torch.optim.SGD(model32.parameters(), lr=0.5).step()

    backward(precision, model16)
    assert precision.unscale_grads() is False
    for master, p32 in zip(masters, model32.parameters()):
        torch.testing.assert_close(master.grad, p32.grad, atol=2e-3, rtol=1e-2)
    torch.optim.SGD(masters, lr=0.5).step()
    precision.copy_master_to_model()
    precision.update_scale(False)

    assert precision.skipped_steps == 0
    for p16, master, p32 in zip(model16.parameters(), masters, model32.parameters()):
        assert p16.dtype == torch.float16
        torch.testing.assert_close(master, p32, atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(p16.float(), p32, atol=2e-3, rtol=1e-2)


def test_unscale_divides_by_the_scale_and_leaves_model_grads_alone():
    precision = make_precision(fp16_config(loss_scale=1024.0), OFF)
    param = torch.nn.Parameter(torch.zeros(3))  # a param left in fp32: must not be scaled in place
    (master,) = precision.master_params([param])
    param.grad = torch.tensor([1024.0, 2048.0, -512.0])
    assert precision.unscale_grads() is False
    assert torch.equal(master.grad, torch.tensor([1.0, 2.0, -0.5]))
    assert torch.equal(param.grad, torch.tensor([1024.0, 2048.0, -512.0]))
    precision.zero_model_grads()
    assert param.grad is None and master.grad is None


def test_static_loss_scale_skips_overflow_but_keeps_scale(caplog):
    precision, model, _ = fp16_setup(loss_scale=128.0)
    assert precision.scale_loss(torch.tensor(2.0)).item() == 256.0
    backward(precision, model)
    model[0].bias.grad.fill_(float("nan"))
    with caplog.at_level(logging.INFO, logger="crew.runtime.precision"):
        precision.update_scale(precision.unscale_grads())
    assert precision.loss_scale == 128.0 and precision.skipped_steps == 1
    assert "OVERFLOW! Skipping step. Static loss scale 128" in caplog.text


def test_bf16_master_weights_keep_updates_bf16_would_round_away():
    precision = make_precision(OFF, BF16)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    precision.cast_module(model)
    masters = precision.master_params(list(model.parameters()))
    optimizer = torch.optim.SGD(masters, lr=1e-4)
    pure = torch.nn.Parameter(torch.ones(1, 1, dtype=torch.bfloat16))
    pure_optimizer = torch.optim.SGD([pure], lr=1e-4)
    for _ in range(100):  # each update is 1e-4, under half a bf16 ulp at 1.0 (2**-8)
        model.weight.grad = torch.ones(1, 1, dtype=torch.bfloat16)
        pure.grad = torch.ones(1, 1, dtype=torch.bfloat16)
        assert precision.unscale_grads() is False
        optimizer.step()
        precision.copy_master_to_model()
        precision.zero_model_grads()
        pure_optimizer.step()
    assert pure.item() == 1.0
    assert masters[0].dtype == torch.float32
    assert masters[0].item() == pytest.approx(0.99, abs=1e-5)
    assert model.weight.dtype == torch.bfloat16
    assert model.weight.item() == pytest.approx(0.99, abs=4e-3) and model.weight.item() < 1.0
    assert precision.loss_scale == 1.0


def test_state_dict_round_trip_continues_identically():
    precision, _, masters = fp16_setup(hysteresis=2, loss_scale_window=2, initial_scale_power=8)
    for overflow in [True, False, True, True, False]:
        precision.update_scale(overflow)
    with torch.no_grad():
        masters[0].add_(1e-4)  # a value the fp16 model copy cannot hold
    state = copy.deepcopy(precision.state_dict())

    restored, restored_model, restored_masters = fp16_setup(hysteresis=2, loss_scale_window=2,
                                                            initial_scale_power=8)
    restored.load_state_dict(state)
    assert restored.state_dict()["loss_scaler"] == precision.state_dict()["loss_scaler"]
    assert restored.skipped_steps == precision.skipped_steps == 3
    assert restored.loss_scale == precision.loss_scale == 64
    assert all(torch.equal(a, b) for a, b in zip(masters, restored_masters))
    assert torch.equal(restored_model[0].weight, masters[0].detach().half())
    tail = "CCOCCCOOCCCCC"
    assert run_pattern(restored.scaler, tail) == run_pattern(precision.scaler, tail)


def test_load_state_dict_rejects_another_model():
    precision, _, _ = fp16_setup()
    other = make_precision(fp16_config(), OFF)
    other.master_params([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])
    with pytest.raises(CrewError, match="1 fp32 master params, this model has 4"):
        precision.load_state_dict(other.state_dict())


def test_both_enabled_is_a_config_error():
    with pytest.raises(ConfigError, match=r"fp16\.enabled and bf16\.enabled") as caught:
        make_precision(fp16_config(), BF16)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("key, value", [("hysteresis", 0), ("loss_scale_window", 0),
                                        ("loss_scale", -1.0), ("min_loss_scale", 0),
                                        ("initial_scale_power", 1.5)])
def test_bad_fp16_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"fp16.{key}"):
        make_precision(fp16_config(**{key: value}), OFF)


def test_fp32_touches_nothing():
    precision = make_precision(OFF, OFF)
    model = tiny_model()
    precision.cast_module(model)
    params = list(model.parameters())
    masters = precision.master_params(params)
    assert all(a is b for a, b in zip(masters, params)) and precision.dtype == torch.float32
    loss = torch.tensor(3.0)
    assert precision.scale_loss(loss) is loss and precision.loss_scale == 1.0
    params[0].grad = torch.full_like(params[0], float("inf"))
    assert precision.unscale_grads() is False
    assert torch.isinf(params[0].grad).all()
    precision.zero_model_grads()
    assert params[0].grad is None


@pytest.mark.parametrize("config", [(fp16_config(), OFF), (OFF, BF16)], ids=["fp16", "bf16"])
def test_cast_module_casts_the_parameters_only(config):
    precision = make_precision(*config)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    precision.cast_module(model)
    assert {p.dtype for p in model.parameters()} == {precision.dtype}
    assert model[1].running_mean.dtype == torch.float32  # buffers: casting.cast_buffers, by data_types
    assert model[1].num_batches_tracked.dtype == torch.int64
    masters = precision.master_params(list(model.parameters()))
    assert all(m.dtype == torch.float32 and m.is_leaf and m.requires_grad for m in masters)
    assert precision.master_params([model[0].weight])[0] is masters[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_check_supported_passes_for_cpu_basics(dtype):
    """torch >= 2.1 CPU builds run Linear/matmul/cross_entropy forward+backward in fp16 and bf16."""
    check_supported(dtype, "cpu")
    check_supported(torch.float32, "cpu")


def test_check_supported_explains_a_missing_cpu_kernel(monkeypatch):
    def no_half_addmm(dtype, device):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    precision_module._first_failure.cache_clear()
    monkeypatch.setattr(precision_module, "_probe_ops", no_half_addmm)
    try:
        with pytest.raises(CrewError, match=r"fp16 is not supported on CPU .*addmm_impl_cpu_.*"
                                            r"fp16.enabled to false.*bf16.enabled: true"):
            check_supported(torch.float16, torch.device("cpu"))
        precision = make_precision(fp16_config(), OFF)
        with pytest.raises(CrewError, match="fp16 is not supported on CPU"):
            precision.cast_module(torch.nn.Linear(2, 2))
    finally:
        precision_module._first_failure.cache_clear()


@pytest.mark.parametrize("config", [(fp16_config(), OFF), (OFF, BF16)], ids=["fp16", "bf16"])
def test_guard_names_an_op_without_a_low_precision_cpu_kernel(config):
    precision = make_precision(*config)
    x = torch.randn(3, 3, dtype=precision.dtype)
    try:
        torch.linalg.svd(x)
    except (RuntimeError, NotImplementedError):
        pass
    else:
        pytest.skip(f"this torch ({torch.__version__}) has svd for {precision.dtype} on CPU")
    expected = rf"{precision.name} is not supported on CPU for op 'linalg_svd_cpu'.*x\.float\(\)"
    with pytest.raises(CrewError, match=expected), precision.guard():
        torch.linalg.svd(x)


@pytest.mark.parametrize("layer", [torch.nn.Linear(4, 2), torch.nn.LayerNorm(4)], ids=repr)
def test_guard_explains_an_fp32_input(layer):
    precision = make_precision(fp16_config(), OFF)
    precision.cast_module(layer)
    expected = r"cast to torch.float16 \(fp16.enabled\).*x.to\(torch.float16\)"
    with pytest.raises(CrewError, match=expected), precision.guard():
        layer(torch.randn(1, 4))


def test_guard_passes_other_errors_through():
    precision = make_precision(OFF, BF16)
    with pytest.raises(RuntimeError, match="^boom$"), precision.guard():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="Long"), precision.guard():  # not about bf16
        raise RuntimeError("expected scalar type Long but found Int")
    target = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="target dtype"), precision.guard():
        torch.nn.functional.nll_loss(torch.randn(2, 3), target)


RANK_SCRIPT = """
    import json, os, sys, torch, torch.distributed as dist
    from types import SimpleNamespace
    from crew.runtime.precision import make_precision
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = {}
    for dtype in (torch.float16, torch.bfloat16):
        t = torch.full((4,), 1.5 + rank, dtype=dtype)
        dist.all_reduce(t)
        result[str(dtype)] = [t.dtype == dtype, t.tolist()]
    fp16 = SimpleNamespace(enabled=True, loss_scale=0.0, initial_scale_power=4, loss_scale_window=10,
                           hysteresis=1, consecutive_hysteresis=False, min_loss_scale=1)
    precision = make_precision(fp16, SimpleNamespace(enabled=False))
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    precision.master_params([param])
    param.grad = torch.tensor([1.0, float("inf") if rank == 1 else 2.0], dtype=torch.float16)
    overflow = precision.unscale_grads()
    precision.update_scale(overflow)
    result["overflow"] = [overflow, precision.loss_scale]
    dist.destroy_process_group()
    open(sys.argv[1], "w").write(json.dumps(result))
"""


def test_gloo_two_ranks_reduce_low_precision_and_agree_on_overflow(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"rank{rank}.json")],
                              env={**env, "RANK": str(rank)}, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        errors = [proc.communicate(timeout=120)[1] for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    assert [proc.returncode for proc in ranks] == [0, 0], errors
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["torch.float16"] == [True, [4.0] * 4]
        assert result["torch.bfloat16"] == [True, [4.0] * 4]
        # only rank 1 saw the inf, yet both skip the step and halve the scale
        assert result["overflow"] == [True, 8.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_probe_leaves_the_scripts_random_stream_alone(dtype):
    precision_module._first_failure.cache_clear()  # probe again, as the first engine of a process does
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    try:
        check_supported(dtype, "cpu")
    except CrewError:
        pass  # a build without the kernels: the probe ran all the same
    assert torch.equal(torch.rand(3), expected)
