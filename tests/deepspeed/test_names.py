"""DeepSpeed's utility names on crew: deepspeed.utils (log_dist, RepeatingLoader, safe_get_full_*),
deepspeed.utils.zero_to_fp32, deepspeed.ops.adam, deepspeed.runtime.utils,
deepspeed.moe.utils and the deepspeed.comm collectives.

One spawned world of two ranks checks everything that needs a process group (log_dist, the
collectives, safe_get_full_* and checkpoints at ZeRO stages 0 and 3); the rest runs in this process.
"""

from __future__ import annotations

import json
import logging
import random

import numpy
import pytest
import torch
from dist import run_ranks
from shimrun import run_as_deepspeed

from crew.runtime.checkpoint import CheckpointError


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def config(stage: int, precision: str) -> dict:
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage}, **extra}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record) -> None:
        if record.getMessage().startswith("[Rank"):
            self.lines.append(record.getMessage())


def _log_dist_lines(rank: int) -> list[str]:
    """log_dist before the process group (every rank, rank -1), then after it with each kind of ranks."""
    from crew.deepspeed.utils import log_dist, logger
    from crew.runtime import comm

    handler = _Lines()
    logger.addHandler(handler)
    try:
        log_dist("before")
        comm.init_distributed()
        log_dist("none")
        log_dist("empty", ranks=[])
        log_dist("zero", ranks=[0])
        log_dist("all", ranks=[-1])
        log_dist("one", ranks=[1], level=logging.WARNING)
    finally:
        logger.removeHandler(handler)
    return handler.lines


def _collectives(rank: int) -> dict:
    import torch.distributed as dist

    from crew.runtime import comm

    gathered = torch.zeros(4)
    comm.all_gather_into_tensor(gathered, torch.full((2,), float(rank + 1)))
    scattered = torch.zeros(2)
    comm.reduce_scatter_tensor(scattered, torch.arange(4.0) * (rank + 1))
    return {"gathered": gathered, "scattered": scattered, "local_rank": comm.get_local_rank(),
            "world_group": comm.get_world_group() is dist.group.WORLD}


def _train_and_save(stage: int, precision: str, folder: str) -> dict:
    """One step, the full fp32 params and grads between backward and step, then a saved checkpoint
    and the engine's own whole fp32 weights to compare the export with."""
    import crew
    from crew.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from crew.runtime import comm

    engine, *_ = crew.initialize(model=make_model(), config=config(stage, precision))
    torch.manual_seed(comm.get_rank() + 1)  # different data on each rank: the grads are averaged
    inputs = torch.randn(4, 8)
    loss = torch.nn.functional.mse_loss(engine(inputs.to(engine.precision.dtype)).float(),
                                        inputs.sum(dim=1, keepdim=True))
    engine.backward(loss)
    names = [name for name, _ in engine.module.named_parameters()]
    grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
    engine.step()
    params = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
    engine.save_checkpoint(folder)
    if engine.zero.shards_params:
        from crew.runtime.checkpoint.sharded import full_module_state
        weights = full_module_state(engine.module)  # rank 0 only
    else:
        from crew.runtime.checkpoint import fp32_module_state
        weights = fp32_module_state(engine)
    return {"names": names, "grads": grads, "params": params, "weights": dict(weights),
            "param_dtype": next(engine.module.parameters()).dtype}


def world(rank: int, folders: list[str]) -> dict:
    from crew.deepspeed import DeepSpeedConfig

    result = {"log": _log_dist_lines(rank), "comm": _collectives(rank)}
    result["config_world"] = DeepSpeedConfig({"train_batch_size": 8}).train_micro_batch_size_per_gpu
    result["stage0"] = _train_and_save(0, "bf16", folders[0])
    result["stage3"] = _train_and_save(3, "fp32", folders[1])
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    folders = [str(root / "stage0"), str(root / "stage3")]
    return run_ranks(world, 2, folders), folders


def test_log_dist_follows_deepspeeds_rules(ranks):
    results, _ = ranks
    assert results[0]["log"] == ["[Rank -1] before", "[Rank 0] zero", "[Rank 0] all"]
    assert results[1]["log"] == ["[Rank -1] before", "[Rank 1] all", "[Rank 1] one"]


def test_comm_tensor_collectives(ranks):
    results, _ = ranks
    for rank, result in enumerate(results):
        assert torch.equal(result["comm"]["gathered"], torch.tensor([1.0, 1.0, 2.0, 2.0]))
        # sum over ranks of arange(4) * (rank + 1) = arange(4) * 3, split in halves
        assert torch.equal(result["comm"]["scattered"], torch.arange(4.0)[2 * rank:2 * rank + 2] * 3)
        assert result["comm"]["local_rank"] == rank and result["comm"]["world_group"]


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_safe_get_full_values_are_whole_fp32_and_agree_across_ranks(ranks, stage):
    results, _ = ranks
    first, second = results[0][stage], results[1][stage]
    for name in first["names"]:
        weight = first["weights"][name]
        for result in (first, second):
            assert result["params"][name].dtype == torch.float32
            assert torch.equal(result["params"][name], weight), f"{stage}: {name} is not the fp32 weight"
            assert result["grads"][name].shape == weight.shape
        assert torch.equal(first["grads"][name], second["grads"][name])  # averaged over ranks
    if stage == "stage0":  # bf16 model, fp32 masters: the fp32 value is the master, not the bf16 param
        assert first["param_dtype"] == torch.bfloat16


def test_full_grads_are_the_same_at_stages_0_and_3(ranks):
    results, _ = ranks
    for name in results[0]["stage0"]["names"]:
        torch.testing.assert_close(results[0]["stage0"]["grads"][name], results[0]["stage3"]["grads"][name],
                                   atol=0.05, rtol=0.05)  # bf16 against fp32


@pytest.mark.parametrize("index", [0, 1])
def test_zero_to_fp32_on_crew_checkpoints(ranks, tmp_path, index, capsys):
    from crew.deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    results, folders = ranks
    expected = results[0][["stage0", "stage3"][index]]["weights"]
    state = get_fp32_state_dict_from_zero_checkpoint(folders[index])
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    assert get_fp32_state_dict_from_zero_checkpoint(folders[index], tag="global_step1").keys() == state.keys()
    from crew.log import warn_once

    warn_once.cache_clear()
    with_frozen = get_fp32_state_dict_from_zero_checkpoint(folders[index], exclude_frozen_parameters=True)
    assert with_frozen.keys() == state.keys()  # crew's checkpoints do not record which were frozen: it says so
    assert "exclude_frozen_parameters has no effect" in capsys.readouterr().out

    written = convert_zero_checkpoint_to_fp32_state_dict(folders[index], tmp_path / "out")
    assert written == tmp_path / "out" / "pytorch_model.bin"
    as_file = convert_zero_checkpoint_to_fp32_state_dict(folders[index], tmp_path / "weights.pt")
    for path in (written, as_file):
        loaded = torch.load(path, weights_only=True)
        assert all(torch.equal(loaded[name], value) for name, value in expected.items())

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    assert load_state_dict_from_zero_checkpoint(model, folders[index]) is model
    assert all(torch.equal(model.state_dict()[name], value) for name, value in expected.items())


def test_zero_to_fp32_names_the_folder_when_latest_or_tag_is_missing(ranks, tmp_path):
    from crew.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, folders = ranks
    with pytest.raises(CheckpointError, match=f"Unable to find 'latest' file at {tmp_path}/latest"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"no tag 'nope' in {folders[0]}"):
        get_fp32_state_dict_from_zero_checkpoint(folders[0], tag="nope")


def test_repeating_loader_restarts():
    from crew.deepspeed.utils import RepeatingLoader

    loader = RepeatingLoader([1, 2, 3])
    assert iter(loader) is loader
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adam_steps_as_torch(weight_decay):
    from crew.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    cases = [(lambda p: FusedAdam(p, lr=0.01, weight_decay=weight_decay),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=weight_decay)),
             (lambda p: FusedAdam(p, lr=0.01, weight_decay=weight_decay, adam_w_mode=False),
              lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=weight_decay)),
             (lambda p: DeepSpeedCPUAdam(p, lr=0.01, weight_decay=weight_decay),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=weight_decay))]
    for ours, theirs in cases:
        weights = []
        for make in (ours, theirs):
            torch.manual_seed(0)
            model = torch.nn.Linear(6, 3)
            optimizer = make(model.parameters())
            for step in range(5):
                torch.manual_seed(step)
                model(torch.randn(4, 6)).pow(2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            weights.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_fused_adam_refuses_what_torch_cannot_do():
    from crew.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from crew.errors import CrewError

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match="FusedAdam does not support the AMSGrad variant."):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(CrewError, match="bias_correction=False"):
        DeepSpeedCPUAdam(params, bias_correction=False)
    optimizer = FusedAdam(params)
    params[0].grad = torch.ones(2)
    optimizer.zero_grad()
    assert params[0].grad is None  # set_grad_none


def test_set_random_seed_is_reproducible(capsys):
    from crew.deepspeed.runtime.utils import see_memory_usage, set_random_seed

    draws = []
    for _ in range(2):
        set_random_seed(1234)
        draws.append((random.random(), numpy.random.rand(), torch.rand(3)))
    assert draws[0][:2] == draws[1][:2] and torch.equal(draws[0][2], draws[1][2])
    see_memory_usage("quiet")
    see_memory_usage("loud", force=True)
    out = capsys.readouterr().out
    assert "quiet" not in out and "loud\nMA " in out


SCRIPT = """
    import sys
    sys.path.insert(0, sys.argv[1])
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import RepeatingLoader, logger, log_dist, safe_get_full_fp32_param
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
    from deepspeed.runtime.utils import set_random_seed, see_memory_usage
    print(deepspeed.checkpointing.__name__, deepspeed.ops.adam.FusedAdam is FusedAdam, deepspeed.log_dist is log_dist)
    try:
        split_params_into_different_moe_groups_for_optimizer([])
    except deepspeed.CrewError as error:
        print(error)
    try:
        import deepspeed.moe.layer
    except ImportError as error:
        print(type(error).__name__, error)
"""


def test_the_names_import_as_deepspeed(tmp_path):
    lines = run_as_deepspeed(SCRIPT, tmp_path)
    assert lines[0] == "crew.deepspeed.checkpointing True True"
    assert lines[1].startswith("deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer "
                               "(mixture of experts) is not supported by crew")
    assert lines[2].startswith("UnsupportedModule deepspeed.moe.layer (mixture of experts) is not supported")


def test_deepspeed_config_resolves_for_the_world_it_is_built_in(ranks, tmp_path):
    import crew
    from crew.deepspeed import DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedEngine

    assert [seen["config_world"] for seen in ranks[0]] == [4, 4]  # 8 samples over 2 ranks
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2, "fp16": {"enabled": True},
                                "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                                "zero_optimization": {"stage": 2}}))
    config = DeepSpeedConfig(str(path))
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.world_size, config.global_rank) == (8, 4, 2, 1, 0)
    assert config.zero_enabled and config.zero_optimization_stage == 2 and config.float16_config.enabled
    assert not config.bfloat16_config.enabled and config.gradient_clipping == 1.0
    assert (config.optimizer_name, config.optimizer_params, config.scheduler_name) == ("adam", {"lr": 0.1}, None)
    not_a_multiple = "train_batch_size 8 is not a positive multiple of train_micro_batch_size_per_gpu 3"
    with pytest.raises(DeepSpeedConfigError, match=not_a_multiple):
        DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3})
    engine, *_ = crew.initialize(model=make_model(), config=str(path))
    assert isinstance(engine, DeepSpeedEngine)
    assert engine._config.train_batch_size == 8 and engine._config.optimizer_name == "adam"
