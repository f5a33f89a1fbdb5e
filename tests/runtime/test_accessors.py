"""DeepSpeed's engine accessors (crew/runtime/accessors.py): values for a config, and in two real gloo
processes the global grad norm, was_step_applied, no_sync and batch-size changes at ZeRO stages 0-3."""

from __future__ import annotations

import collections

import pytest
import torch
from dist import run_ranks

from crew.errors import CrewError

GLOBAL_BATCH = 16
STAGES = (0, 1, 2, 3)
CLIPPING = 0.01  # far below the gradient norm of these data: the norm reported must be the unclipped one


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_data():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4 * GLOBAL_BATCH, 8, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True) ** 2


def config(micro: int = 4, accumulation: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": CLIPPING, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **extra}


def reference_norm() -> float:
    """One process, the whole first global batch: the L2 norm of the gradients at the start."""
    model = make_model()
    inputs, targets = make_data()
    torch.nn.functional.mse_loss(model(inputs[:GLOBAL_BATCH]), targets[:GLOBAL_BATCH]).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def loss_of(engine, rows: slice) -> torch.Tensor:
    inputs, targets = make_data()
    return torch.nn.functional.mse_loss(engine(inputs[rows]), targets[rows])


def two_rank_checks(rank: int, stage: int) -> dict:
    import crew

    seen: dict = {}
    engine, _, _, _ = crew.initialize(model=make_model(), config=config(zero_optimization={"stage": stage}))
    full = engine.module_state_dict()
    seen["state_dict_whole"] = {k: torch.equal(v, make_model().state_dict()[k]) for k, v in full.items()}
    seen["before"] = (engine.get_global_grad_norm(), engine.was_step_applied())
    # global batch 16 = 2 micro steps x 2 ranks x 4 rows; rank r's micro step m: rows (2m + r) * 4
    for m in range(2):
        start = (2 * m + rank) * 4
        engine.backward(loss_of(engine, slice(start, start + 4)))
        engine.step()
        norm = engine.get_global_grad_norm()
        seen[f"micro{m}"] = (norm if norm is None else (type(norm), norm.shape, norm.item()),
                             engine.was_step_applied())

    # batch sizes: 24 = 3 micro steps x 2 ranks x 4
    engine.set_train_batch_size(24)
    seen["batch"] = (engine.train_batch_size(), engine.gradient_accumulation_steps())
    # micro steps 2..5: the boundary is (micro_steps + 1) % 3 == 0, counted from the start (DeepSpeed)
    seen["boundaries"], seen["applied_steps"] = [], []
    for _ in range(4):
        seen["boundaries"].append(engine.is_gradient_accumulation_boundary())
        engine.backward(loss_of(engine, slice(rank * 4, rank * 4 + 4)))
        engine.step()
        seen["applied_steps"].append(engine.was_step_applied())
    seen["global_steps"] = engine.global_steps
    with pytest.raises(crew.ConfigError) as error:
        engine.set_train_batch_size(20)
    seen["batch_error"] = str(error.value)
    engine.set_train_micro_batch_size(2)
    seen["micro"] = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                     engine.gradient_accumulation_steps())

    if stage >= 2:
        with pytest.raises(CrewError) as error:
            with engine.no_sync():
                pass
        seen["no_sync_error"] = str(error.value)
    else:
        seen.update(no_sync_checks(rank, stage))
    engine.destroy()
    engine.destroy()
    seen["destroyed"] = engine._ddp is None and engine not in crew.runtime.registry.live_engines()
    return seen


def grads_agree(engine) -> bool:
    grad = next(engine.module.parameters()).grad.detach().clone()
    gathered = [torch.zeros_like(grad) for _ in range(2)]
    torch.distributed.all_gather(gathered, grad)
    return torch.equal(gathered[0], gathered[1])


def no_sync_checks(rank: int, stage: int) -> dict:
    """Accumulation 1: every backward is a boundary and would all-reduce, but not inside no_sync."""
    import crew

    engine, _, _, _ = crew.initialize(model=make_model(), config=config(
        accumulation=1, zero_optimization={"stage": stage}))
    seen = {}
    with engine.no_sync():
        engine.backward(loss_of(engine, slice(rank * 4, rank * 4 + 4)))
        seen["agree_inside"] = grads_agree(engine)
        with pytest.raises(CrewError) as error:
            engine.step()
        seen["step_error"] = str(error.value)
        with pytest.raises(CrewError) as error:
            with engine.no_sync():
                pass
        seen["reentry_error"] = str(error.value)
    engine.backward(loss_of(engine, slice(8 + rank * 4, 12 + rank * 4)))
    seen["agree_after"] = grads_agree(engine)
    engine.step()
    seen["applied"] = engine.was_step_applied()
    return seen


@pytest.fixture(scope="module")
def ranks() -> list:
    """One pair of processes for every distributed check: {stage: results}, by rank."""
    return run_ranks(_both_stages, 2)


def _both_stages(rank: int) -> dict:
    return {stage: two_rank_checks(rank, stage) for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_global_grad_norm_is_the_unclipped_norm_of_the_global_batch_on_every_rank(ranks, stage):
    expected = reference_norm()
    assert expected > 10 * CLIPPING
    for seen in ranks:
        result = seen[stage]
        assert result["before"] == (None, False)
        assert result["micro0"] == (None, False)  # no boundary yet
        norm, applied = result["micro1"]
        kind, shape, value = norm
        assert kind is torch.Tensor and shape == () and applied  # a 0-dim tensor, as DeepSpeed's ZeRO
        assert value == pytest.approx(expected, rel=1e-5)
    assert ranks[0][stage]["micro1"] == ranks[1][stage]["micro1"]


@pytest.mark.parametrize("stage", STAGES)
def test_batch_size_changes_and_state_dict(ranks, stage):
    for seen in ranks:
        result = seen[stage]
        assert all(result["state_dict_whole"].values()) and len(result["state_dict_whole"]) == 4
        assert result["batch"] == (24, 3)
        assert result["boundaries"] == result["applied_steps"] == [True, False, False, True]
        assert result["global_steps"] == 3
        assert result["batch_error"].startswith("Train batch size must be divisible by micro-batch "
                                                "data parallelism")
        assert "train_micro_batch_size_per_gpu 4 x 2 ranks = 8" in result["batch_error"]
        assert result["micro"] == (2 * 3 * 2, 2, 3)
        assert result["destroyed"]


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_skips_the_all_reduce_at_stages_0_1(ranks, stage):
    for seen in ranks:
        result = seen[stage]
        assert result["agree_inside"] is False and result["agree_after"] is True
        assert result["applied"]
        assert result["step_error"].startswith(
            "It is illegal to call Engine.step() inside no_sync context manager")
        assert result["reentry_error"].startswith("no_sync context manager reentry is unsupported")


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_is_refused_at_stages_2_3(ranks, stage):
    for seen in ranks:
        error = seen[stage]["no_sync_error"]
        assert error.startswith("no_sync context manager is incompatible with gradient partitioning "
                                f"logic of ZeRO stage {stage}")
        assert "gradient_accumulation_steps" in error


def test_accessor_values_for_a_config():
    import crew

    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    engine, _, _, _ = crew.initialize(model=make_model(), config=config(
        accumulation=1, fp16=fp16, steps_per_print=7, dataloader_drop_last=True,
        optimizer={"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.99]}},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}}))
    assert engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert not engine.zero_optimization() and engine.zero_optimization_stage() == 0
    assert engine.gradient_clipping() == CLIPPING and engine.steps_per_print() == 7
    assert engine.dynamic_loss_scale() and engine.dataloader_drop_last()
    assert engine.optimizer_name() == "adam" and engine.scheduler_name() == "WarmupLR"
    assert [tuple(m) for m in engine.get_mom()] == [(0.8, 0.99)]
    assert engine.get_data_types() == (torch.float16, torch.float16)
    assert engine.communication_data_type == torch.float16
    assert not engine.wall_clock_breakdown() and not engine.memory_breakdown() and not engine.is_compiled
    engine.empty_partition_cache()
    engine.communication_data_type = "fp32"
    assert engine.communication_data_type == torch.float32

    engine, _, _, _ = crew.initialize(model=make_model(), config={
        "train_batch_size": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
        "fp16": {"loss_scale": 128}, "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    assert engine.bfloat16_enabled() and engine.zero_optimization() and engine.zero_optimization_stage() == 1
    assert engine.gradient_clipping() == 1.0 and engine.steps_per_print() == 10  # crew's defaults
    assert not engine.dynamic_loss_scale() and not engine.dataloader_drop_last()
    assert engine.optimizer_name() == "SGD" and engine.scheduler_name() is None and engine.get_mom() == [0.9]
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.communication_data_type == torch.bfloat16

    model = make_model()
    engine, _, _, _ = crew.initialize(model=model, optimizer=torch.optim.RMSprop(model.parameters(), momentum=0.5),
                                      config={"train_batch_size": 4})
    assert engine.optimizer_name() == "RMSprop" and engine.get_mom() == [0.5]
    assert not engine.fp16_enabled() and engine.get_data_types() == (torch.float32, torch.float32)
    engine, _, _, _ = crew.initialize(model=make_model(), config={"train_batch_size": 4},
                                      optimizer=lambda params: torch.optim.Adam(params))
    assert engine.optimizer_name() == "Adam"


def test_fp16_norm_is_unscaled_and_an_overflow_is_not_applied():
    import crew

    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, _, _, _ = crew.initialize(model=make_model(), config=config(micro=GLOBAL_BATCH, accumulation=1,
                                                                       fp16=fp16))
    inputs, targets = make_data()
    rows = slice(0, GLOBAL_BATCH)
    engine.backward(torch.nn.functional.mse_loss(engine(inputs[rows].half()).float(), targets[rows]))
    engine.step()
    assert engine.was_step_applied()
    assert engine.get_global_grad_norm().item() == pytest.approx(reference_norm(), rel=2e-2)
    engine.backward(torch.nn.functional.mse_loss(engine(inputs[rows].half()).float(), targets[rows]) * float("inf"))
    engine.step()
    assert not engine.was_step_applied() and engine.get_global_grad_norm().item() == float("inf")


def test_boundary_override_is_sticky_and_per_rank_sizes_are_refused():
    import crew

    engine, _, _, _ = crew.initialize(model=make_model(), config=config(accumulation=4, gradient_clipping=0.0))
    assert not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(loss_of(engine, slice(0, 4)))
    engine.step()
    assert engine.is_gradient_accumulation_boundary() and engine.was_step_applied()
    assert engine.get_global_grad_norm() > 0  # measured with clipping off too
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(loss_of(engine, slice(0, 4)))
    engine.step()
    assert not engine.was_step_applied() and engine.global_steps == 1

    engine, _, _, _ = crew.initialize(model=make_model(), config={
        "train_micro_batch_size_per_rank": [4], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(crew.ConfigError, match="set_train_batch_size.*train_micro_batch_size_per_rank"):
        engine.set_train_batch_size(8)
    engine, _, _, _ = crew.initialize(model=make_model(), config=config())
    with pytest.raises(crew.ConfigError, match="positive integer"):
        engine.set_train_micro_batch_size(0)


def test_fp16_auto_cast_casts_the_positional_inputs():
    import crew
    from crew.runtime.engine import _cast_half

    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x, extra=None):
            seen.append((x.dtype, extra.dtype))
            return super().forward(x)

    for auto_cast in (True, False):
        engine, _, _, _ = crew.initialize(model=Probe(4, 2), config=config(
            micro=2, accumulation=1, fp16={"enabled": True, "auto_cast": auto_cast}))
        assert engine.fp16_auto_cast() is auto_cast
        if auto_cast:
            engine(torch.randn(2, 4), extra=torch.ones(1))
            assert seen == [(torch.float16, torch.float32)]  # keyword inputs stay, as in DeepSpeed
        else:
            with pytest.raises(CrewError, match=r'or set "fp16": \{"auto_cast": true\}'):
                engine(torch.randn(2, 4), extra=torch.ones(1))  # fp32 inputs into an fp16 model
    nested = _cast_half(([torch.ones(1), 3], {"a": torch.ones(1, dtype=torch.float64), "i": torch.ones(1).long()}))
    assert nested[0][0].dtype == nested[1]["a"].dtype == torch.float16 and nested[0][1] == 3
    assert nested[1]["i"].dtype == torch.int64
    Pair = collections.namedtuple("Pair", "x y")
    pair = _cast_half(Pair(torch.ones(1), 2))
    assert type(pair) is Pair and pair.x.dtype == torch.float16 and pair.y == 2
