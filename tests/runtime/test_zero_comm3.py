"""Stage 3's traffic with DeepSpeed's stage-3 keys (crew/runtime/zero/fetching.py, persistence.py): gradients reduced
in the communication dtype, each unit gathered once per micro step while it is within stage3_max_reuse_distance,
the small parameters whole on every rank (stage3_param_persistence_threshold) and averaged once per step. Every
collective FSDP2 and crew make is counted on 2 gloo ranks, in one set of processes for the whole file."""

from __future__ import annotations

import pytest
import torch
from dist import run_parts

WIDTH = 320  # each block's weight has 102,400 elements: over DeepSpeed's default persistence threshold (1e5)
BLOCKS = 3
STEPS = 3
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(BLOCKS)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, 1))


def train(rank: int, precision: str = "fp32", accumulation: int = 1, **zero) -> dict:
    """STEPS optimizer steps; the collectives of the last one, as (name, dtype, elements)."""
    import torch.distributed as dist

    import crew
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
              "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, **zero}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "bf16_fp32_reduce":
        config.update(bf16={"enabled": True}, communication_data_type="fp32")
    engine, _, _, _ = crew.initialize(model=make_model(), config=config)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    generator = torch.Generator().manual_seed(rank)
    calls: list[tuple[str, torch.dtype, int]] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def spy(name):
        def call(*args, **kwargs):
            # the payload: the whole tensor (an all-gather's output, a reduce-scatter's input), the larger one
            payload = max((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), key=torch.numel)
            calls.append((name, payload.dtype, payload.numel()))
            return originals[name](*args, **kwargs)
        return call

    losses = []
    try:
        for step in range(STEPS):
            if step == STEPS - 1:
                for name in COLLECTIVES:
                    setattr(dist, name, spy(name))
            for _ in range(accumulation):
                x = torch.randn(2, WIDTH, generator=generator)
                loss = (engine(x.to(dtype)).float() - x.sum(1, keepdim=True)).pow(2).mean()
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
    finally:
        for name in COLLECTIVES:
            setattr(dist, name, originals[name])
    whole = {name: getattr(p, "ds_persist", False) for name, p in engine.module.named_parameters()}
    return {"losses": losses, "calls": calls, "whole": whole, "engine": _after(engine, dtype)}


def _after(engine, dtype: torch.dtype) -> dict:
    """What a user reads after training: the whole small parameters' values, a no-grad forward's effect."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    head = engine.module[BLOCKS]
    with torch.no_grad():
        engine(torch.zeros(1, WIDTH, dtype=dtype))
    states = [fsdp_param.sharded_state for unit in engine.module.modules() if isinstance(unit, FSDPModule)
              for group in unit._get_fsdp_state()._fsdp_param_groups for fsdp_param in group.fsdp_params]
    all_sharded = bool(states) and set(states) == {ShardedState.SHARDED}
    return {"head": head.weight.detach().clone(), "bias": engine.module[0][0].bias.detach().clone(),
            "state_bias": engine.module.state_dict()["0.0.bias"].clone(), "resharded": all_sharded}


def gathered_write(rank: int) -> dict:
    """GatheredParameters(modifier_rank=0) on a whole small parameter: rank 0's values reach every rank."""
    import crew
    engine, _, _, _ = crew.initialize(model=make_model(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    bias = engine.module[0][0].bias
    with crew.zero.GatheredParameters([bias], modifier_rank=0):
        bias.data.fill_(float(rank + 1))
    return {"bias": bias.detach().clone(), "status": bias.ds_status.name, "persist": bias.ds_persist}


def _train_with(rank: int, precision: str, accumulation: int, zero: dict) -> dict:
    return train(rank, precision, accumulation, **zero)


# crew 0.1's stage 3: all parameters sharded, each unit on its own and sharded again after its forward
OLD = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
RUNS = {
    "bf16": (_train_with, "bf16", 1, {}),
    "bf16_fp32_reduce": (_train_with, "bf16_fp32_reduce", 1, {}),
    "bf16_accumulation": (_train_with, "bf16", 2, {}),
    "fp32": (_train_with, "fp32", 1, {}),
    "fp32_two_groups": (_train_with, "fp32", 1, {"stage3_prefetch_bucket_size": 2 * WIDTH * WIDTH + 2 * WIDTH}),
    "fp32_old": (_train_with, "fp32", 1, OLD),
    "bf16_old": (_train_with, "bf16_fp32_reduce", 1, OLD),
    "gathered": (gathered_write,),
}


@pytest.fixture(scope="module")
def runs():
    return run_parts(RUNS, 2, timeout=300)


def _by_kind(calls: list) -> dict:
    kinds: dict[str, list] = {}
    for name, dtype, numel in calls:
        kinds.setdefault(name, []).append((dtype, numel))
    return kinds


SHARDED = BLOCKS * WIDTH * WIDTH  # the block weights' elements; the biases and the head are whole
WHOLE = BLOCKS * WIDTH + WIDTH + 1
WHOLE_FLAGS = BLOCKS + 2  # with their gradients, PersistentGrads sends how many ranks had each
NORM = (torch.float64, 1)  # the global gradient norm's sum of the shards' squares (as DeepSpeed's)


def test_small_parameters_are_whole_on_every_rank_and_equal(runs):
    for result in runs["bf16"]:
        assert result["whole"] == {**{f"{b}.0.weight": False for b in range(BLOCKS)},
                                   **{f"{b}.0.bias": True for b in range(BLOCKS)},
                                   f"{BLOCKS}.weight": True, f"{BLOCKS}.bias": True}
    first, second = (r["engine"] for r in runs["bf16"])
    assert torch.equal(first["head"], second["head"]) and torch.equal(first["bias"], second["bias"])
    assert torch.equal(first["state_bias"], first["bias"])  # state_dict() holds it whole, as DeepSpeed's


def test_bf16_reduces_in_bf16_by_default_and_in_fp32_when_asked(runs):
    for name, dtype in (("bf16", torch.bfloat16), ("bf16_fp32_reduce", torch.float32)):
        kinds = _by_kind(runs[name][0]["calls"])
        assert {d for d, _ in kinds["reduce_scatter_single"]} == {dtype}, name
        assert sum(n for _, n in kinds["reduce_scatter_single"]) == SHARDED
        assert kinds["all_reduce"] == [(dtype, WHOLE + WHOLE_FLAGS), NORM], name  # the whole ones: one call


def test_the_units_are_gathered_once_per_micro_step_in_groups_of_the_prefetch_bucket(runs):
    # the default bucket (5e7 elements) holds all three blocks: one all-gather and one reduce-scatter per micro
    # step; a bucket of two blocks makes two groups; the units stay whole for the backward (reuse distance)
    for name, micro_steps, groups in (("bf16", 1, 1), ("bf16_accumulation", 2, 1), ("fp32", 1, 1),
                                      ("fp32_two_groups", 1, 2)):
        kinds = _by_kind(runs[name][0]["calls"])
        gathers = kinds["all_gather_single"]
        assert len(gathers) == groups * micro_steps, name
        assert sum(n for _, n in gathers) == SHARDED * micro_steps
        assert len(kinds["reduce_scatter_single"]) == groups * micro_steps  # DeepSpeed's: every micro step
        assert len(kinds["all_reduce"]) == 2  # the whole parameters' gradients at the boundary, and the norm
        assert "broadcast" not in kinds
    old = _by_kind(runs["fp32_old"][0]["calls"])
    assert len(old["all_gather_single"]) == 2 * BLOCKS + 1  # forward and backward, and the head's unit (root)
    assert len(old["reduce_scatter_single"]) == BLOCKS + 1


def test_the_new_traffic_trains_as_the_old(runs):
    for rank in range(2):
        assert runs["fp32"][rank]["losses"] == pytest.approx(runs["fp32_old"][rank]["losses"], rel=1e-5)
        assert runs["fp32_two_groups"][rank]["losses"] == pytest.approx(runs["fp32"][rank]["losses"], rel=1e-5)
        # bf16 gradients on the wire instead of fp32: within bf16's own precision
        assert runs["bf16"][rank]["losses"] == pytest.approx(runs["bf16_old"][rank]["losses"], rel=2e-2)


def test_gathered_parameters_keep_the_modifier_ranks_value_of_a_whole_parameter(runs):
    for result in runs["gathered"]:
        assert torch.all(result["bias"] == 1.0)
        assert (result["status"], result["persist"]) == ("AVAILABLE", True)


def test_a_forward_without_gradients_leaves_every_unit_sharded(runs):
    for name in ("bf16", "fp32"):
        assert all(result["engine"]["resharded"] for result in runs[name])


@pytest.mark.parametrize("key, value", [("stage3_max_reuse_distance", -1), ("stage3_prefetch_bucket_size", "5e7"),
                                        ("stage3_param_persistence_threshold", 1.5),
                                        ("stage3_max_live_parameters", float("inf")),
                                        ("stage3_model_persistence_threshold", True)])
def test_a_bad_value_names_the_key_and_the_default(key, value):
    from crew.errors import ConfigError
    from crew.runtime.zero import fetching
    with pytest.raises(ConfigError, match=rf"zero_optimization.{key} is .*DeepSpeed's default is"):
        fetching.policy({key: value})
    assert fetching.policy({key: "auto"}) == fetching.FetchPolicy()  # unfilled "auto": DeepSpeed's default
