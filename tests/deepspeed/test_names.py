"""DeepSpeed's utility names on crew: deepspeed.utils (log_dist, RepeatingLoader, safe_get_full_*),
deepspeed.utils.zero_to_fp32, deepspeed.ops.adam, deepspeed.runtime.utils,
deepspeed.moe.utils and the deepspeed.comm collectives.

One spawned world of two ranks checks everything that needs a process group (log_dist, the
collectives, safe_get_full_* and checkpoints at ZeRO stages 0 and 3); the rest runs in this process.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
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


ACCELERATE_TIMEOUT = datetime.timedelta(seconds=90)


def _join_as_accelerate() -> dict:
    """The process group as TrainingArguments(deepspeed=...) and Accelerator() make it: Accelerate's own
    PartialState under ACCELERATE_USE_DEEPSPEED with LOCAL_RANK set calls `from deepspeed import comm as
    dist; dist.init_distributed(dist_backend=..., auto_mpi_discovery=False, timeout=...)`, GPU or not."""
    import torch.distributed as dist

    from crew.deepspeed import alias
    from crew.runtime import comm

    alias.install()  # `from deepspeed import comm` is crew's comm, as under crew run --as_deepspeed
    calls = []
    original = comm.init_distributed
    comm.init_distributed = lambda **kwargs: calls.append(kwargs) or original(**kwargs)
    try:
        from accelerate import state
    except ImportError:  # without the test extra: the call Accelerate makes
        comm.init_distributed(dist_backend=None, auto_mpi_discovery=False, timeout=ACCELERATE_TIMEOUT)
        accelerate = None
    else:
        state.is_deepspeed_available = lambda: True  # the distribution record is the launcher's business
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        partial = state.PartialState(timeout=ACCELERATE_TIMEOUT)
        accelerate = (str(partial.distributed_type), partial.num_processes, partial.process_index)
    finally:
        comm.init_distributed = original
    return {"calls": calls, "world": dist.get_world_size(), "backend": dist.get_backend(), "accelerate": accelerate}


def _log_dist_lines(rank: int, joined: dict) -> list[str]:
    """log_dist before the process group (every rank, rank -1), then after it with each kind of ranks."""
    from crew.deepspeed.utils import log_dist, logger

    handler = _Lines()
    logger.addHandler(handler)
    try:
        log_dist("before")
        joined.update(_join_as_accelerate())
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
    consolidated = None
    if engine.zero.shards_params:
        from crew.runtime.checkpoint.sharded import full_module_state
        weights = full_module_state(engine.module)  # rank 0 only
        consolidated = engine._zero3_consolidated_16bit_state_dict()  # Accelerate's get_state_dict at stage 3
        engine.module[0].bias.requires_grad_(False)  # frozen, as a PEFT base weight
        trainable = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        engine.module[0].bias.requires_grad_(True)
        consolidated = consolidated and {"all": consolidated, "trainable": sorted(trainable)}
    else:
        from crew.runtime.checkpoint.state import fp32_module_state, gathered_masters
        weights = fp32_module_state(engine, gathered_masters(engine))  # stage 2: the masters from their owners
    return {"names": names, "grads": grads, "params": params, "weights": dict(weights),
            "param_dtype": next(engine.module.parameters()).dtype, "consolidated": consolidated,
            "gather_on_save": engine.zero_gather_16bit_weights_on_model_save()}


def world(rank: int, folders: list[str]) -> dict:
    from crew.deepspeed import DeepSpeedConfig

    joined: dict = {}
    result = {"log": _log_dist_lines(rank, joined), "joined": joined, "comm": _collectives(rank)}
    result["config_world"] = DeepSpeedConfig({"train_batch_size": 8}).train_micro_batch_size_per_gpu
    result["stage0"] = _train_and_save(0, "bf16", folders[0])
    result["stage3"] = _train_and_save(3, "fp32", folders[1])
    result["stage2"] = _train_and_save(2, "bf16", folders[2])  # owners hold the masters and grads
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    folders = [str(root / "stage0"), str(root / "stage3"), str(root / "stage2")]
    return run_ranks(world, 2, folders), folders


def test_log_dist_follows_deepspeeds_rules(ranks):
    results, _ = ranks
    assert results[0]["log"] == ["[Rank -1] before", "[Rank 0] zero", "[Rank 0] all"]
    assert results[1]["log"] == ["[Rank -1] before", "[Rank 1] all", "[Rank 1] one"]


def test_accelerate_joins_one_world_through_deepspeed_comm(ranks):
    results, _ = ranks
    for result in results:
        joined = result["joined"]
        assert joined["calls"] == [{"dist_backend": None, "auto_mpi_discovery": False, "timeout": ACCELERATE_TIMEOUT}]
        assert (joined["world"], joined["backend"]) == (2, "gloo")
        if joined["accelerate"] is not None:
            # Stock Accelerate on a machine without a GPU, as with DeepSpeed 0.19.8 itself: the group has both
            # ranks, but Accelerate's own count says one process, rank 0 on each (its backend stays None).
            # crew's rank site (crew/launcher/node/site) corrects that under crew run --as_deepspeed.
            assert joined["accelerate"] == ("DistributedType.DEEPSPEED", 1, 0)


def test_comm_tensor_collectives(ranks):
    results, _ = ranks
    for rank, result in enumerate(results):
        assert torch.equal(result["comm"]["gathered"], torch.tensor([1.0, 1.0, 2.0, 2.0]))
        # sum over ranks of arange(4) * (rank + 1) = arange(4) * 3, split in halves
        assert torch.equal(result["comm"]["scattered"], torch.arange(4.0)[2 * rank:2 * rank + 2] * 3)
        assert result["comm"]["local_rank"] == rank and result["comm"]["world_group"]


@pytest.mark.parametrize("stage", ["stage0", "stage2", "stage3"])
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
    if stage != "stage3":  # bf16 model, fp32 masters: the fp32 value is the master, not the bf16 param
        assert first["param_dtype"] == torch.bfloat16


def test_full_grads_are_the_same_at_stages_0_2_and_3(ranks):
    results, _ = ranks
    for name in results[0]["stage0"]["names"]:
        torch.testing.assert_close(results[0]["stage0"]["grads"][name], results[0]["stage3"]["grads"][name],
                                   atol=0.05, rtol=0.05)  # bf16 against fp32
        torch.testing.assert_close(results[0]["stage0"]["grads"][name], results[0]["stage2"]["grads"][name])


def test_the_stage3_consolidated_state_dict_is_whole_on_rank_0_only(ranks):
    results, _ = ranks
    first, second = results[0]["stage3"], results[1]["stage3"]
    assert second["consolidated"] is None and first["consolidated"]["all"].keys() == first["weights"].keys()
    assert all(torch.equal(first["consolidated"]["all"][name], value) for name, value in first["weights"].items())
    assert first["consolidated"]["trainable"] == ["0.weight", "2.bias", "2.weight"]
    assert not first["gather_on_save"]  # stage3_gather_16bit_weights_on_model_save: False unless set


@pytest.mark.parametrize("index", [0, 1, 2])
def test_zero_to_fp32_on_crew_checkpoints(ranks, tmp_path, index):
    from crew.deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    results, folders = ranks
    expected = results[0][["stage0", "stage3", "stage2"][index]]["weights"]
    state = get_fp32_state_dict_from_zero_checkpoint(folders[index])
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    assert get_fp32_state_dict_from_zero_checkpoint(folders[index], tag="global_step1").keys() == state.keys()
    with_frozen = get_fp32_state_dict_from_zero_checkpoint(folders[index], exclude_frozen_parameters=True)
    assert with_frozen.keys() == state.keys()  # no frozen parameters in this model

    assert convert_zero_checkpoint_to_fp32_state_dict(folders[index], tmp_path / "out") is None  # as DeepSpeed's
    loaded = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
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

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match="FusedAdam does not support the AMSGrad variant."):
        FusedAdam(params, amsgrad=True)
    assert DeepSpeedCPUAdam(params, bias_correction=False).param_groups[0]["bias_correction"] is False  # as DeepSpeed
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
    schedules = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES  # as Accelerate reads it: no import of its own
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import RepeatingLoader, logger, log_dist, safe_get_full_fp32_param
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
    from deepspeed.runtime.utils import set_random_seed, see_memory_usage
    print(deepspeed.checkpointing.__name__, deepspeed.ops.adam.FusedAdam is FusedAdam, deepspeed.log_dist is log_dist)
    try:
        expert = __import__("torch").nn.Parameter(__import__("torch").zeros(1))
        expert.allreduce = False  # how DeepSpeed's MoE layers mark an expert's parameters
        split_params_into_different_moe_groups_for_optimizer({"params": [expert], "name": "g"})
    except deepspeed.CrewError as error:
        print(error)
    try:
        import deepspeed.moe.layer
    except ImportError as error:
        print(type(error).__name__, error)
    from deepspeed import comm as dist
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.utils import set_z3_leaf_modules
    from deepspeed.runtime.engine import DeepSpeedEngine
    print(schedules, dist.is_initialized(), DEEPSPEED_ENVIRONMENT_NAME, type(logger).__name__)
    try:
        import deepspeed.ops.lamb
    except ImportError as error:
        print(type(error).__name__, error)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, GatheredParameters
    from deepspeed.runtime.zero import partition_parameters as pp  # what transformers patches
    status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus  # DeepSpeed-Chat's spelling
    print(status is ZeroParamStatus, GatheredParameters is deepspeed.zero.GatheredParameters,
          pp._orig_torch_arange is __import__("torch").arange, callable(pp.zero_wrapper_for_fp_tensor_constructor),
          deepspeed.zero.register_external_parameter.__module__, ZeroParamStatus.NOT_AVAILABLE.value)
"""


def test_the_names_import_as_deepspeed(tmp_path):
    lines = run_as_deepspeed(SCRIPT, tmp_path)
    assert lines[0] == "crew.deepspeed.checkpointing True True"
    assert lines[1].startswith("deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer "
                               "(mixture of experts) is not supported by crew")
    assert lines[2].startswith("UnsupportedModule deepspeed.moe.layer (mixture of experts) is not supported")
    schedules = "['LRRangeTest', 'OneCycle', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR']"
    assert lines[3] == f"{schedules} False .deepspeed_env Logger"
    assert lines[4].startswith("UnsupportedModule deepspeed.ops.lamb (DeepSpeed's FusedLamb CUDA kernel) is not "
                               "supported")
    assert lines[5] == "True True True True crew.runtime.zero.partition_parameters 2"


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


# --------------------------------------------------------------------------------------------
# The names the Hugging Face libraries use (transformers, Accelerate, PEFT, TRL), each against DeepSpeed 0.19.8

def _defaults(function) -> list[tuple[str, object]]:
    import inspect

    return [(p.name, p.default) for p in inspect.signature(function).parameters.values() if p.name != "self"]


_EMPTY = __import__("inspect").Parameter.empty
# DeepSpeed 0.19.8's signatures (deepspeed/ops/*, deepspeed/comm/comm.py, deepspeed/checkpoint/utils.py)
DEEPSPEED_SIGNATURES = {
    "ops.adam.DeepSpeedCPUAdam": [("model_params", _EMPTY), ("lr", 1e-3), ("bias_correction", True),
                                  ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0), ("amsgrad", False),
                                  ("adamw_mode", True), ("fp32_optimizer_states", True)],
    "ops.adam.FusedAdam": [("params", _EMPTY), ("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
                           ("eps", 1e-8), ("adam_w_mode", True), ("weight_decay", 0.0), ("amsgrad", False),
                           ("set_grad_none", True)],
    "ops.adagrad.DeepSpeedCPUAdagrad": [("model_params", _EMPTY), ("lr", 1e-2), ("eps", 1e-10), ("weight_decay", 0),
                                        ("amsgrad", False), ("fp32_optimizer_states", True)],
    "ops.lion.DeepSpeedCPULion": [("model_params", _EMPTY), ("lr", 1e-3), ("betas", (0.9, 0.999)),
                                  ("weight_decay", 0), ("fp32_optimizer_states", True)],
    "ops.lion.FusedLion": [("params", _EMPTY), ("lr", 1e-3), ("betas", (0.9, 0.999)), ("weight_decay", 0.0),
                           ("set_grad_none", True)],
    "checkpoint.utils.clone_tensors_for_torch_save": [("item", _EMPTY), ("device", torch.device("cpu"))],
    "runtime.lr_schedules.WarmupLR": [("optimizer", _EMPTY), ("warmup_min_lr", 0.0), ("warmup_max_lr", None),
                                      ("warmup_num_steps", 1000), ("warmup_type", "log"),
                                      ("last_batch_iteration", -1)],
    "runtime.lr_schedules.WarmupDecayLR": [("optimizer", _EMPTY), ("total_num_steps", _EMPTY),
                                           ("warmup_min_lr", 0.0), ("warmup_max_lr", 0.001),
                                           ("warmup_num_steps", 1000), ("warmup_type", "log"),
                                           ("last_batch_iteration", -1)],
    "runtime.lr_schedules.WarmupCosineLR": [("optimizer", _EMPTY), ("total_num_steps", _EMPTY),
                                            ("warmup_min_ratio", 0.0), ("warmup_num_steps", 1000),
                                            ("cos_min_ratio", 0.0001), ("warmup_type", "log"),
                                            ("last_batch_iteration", -1)],
    "runtime.lr_schedules.LRRangeTest": [("optimizer", _EMPTY), ("lr_range_test_min_lr", 1e-3),
                                         ("lr_range_test_step_size", 2000), ("lr_range_test_step_rate", 1.0),
                                         ("lr_range_test_staircase", False), ("last_batch_iteration", -1)],
    "runtime.lr_schedules.OneCycle": [("optimizer", _EMPTY), ("cycle_min_lr", _EMPTY), ("cycle_max_lr", _EMPTY),
                                      ("decay_lr_rate", 0.0), ("cycle_first_step_size", 2000),
                                      ("cycle_second_step_size", None), ("cycle_first_stair_count", 0),
                                      ("cycle_second_stair_count", None), ("decay_step_size", 0),
                                      ("cycle_momentum", True), ("cycle_min_mom", 0.8), ("cycle_max_mom", 0.9),
                                      ("decay_mom_rate", 0.0), ("last_batch_iteration", -1)],
}


@pytest.mark.parametrize("dotted", sorted(DEEPSPEED_SIGNATURES))
def test_signatures_are_deepspeeds(dotted):
    import importlib

    module, _, name = f"crew.deepspeed.{dotted}".rpartition(".")
    assert _defaults(getattr(importlib.import_module(module), name)) == DEEPSPEED_SIGNATURES[dotted]


def test_init_distributed_has_deepspeeds_signature():
    from crew.runtime import comm

    found = [(name, default) for name, default in _defaults(comm.init_distributed) if name != "timeout"]
    assert found == [("dist_backend", None), ("auto_mpi_discovery", True), ("distributed_port", 29500),
                     ("verbose", True), ("init_method", None), ("dist_init_required", None), ("config", None),
                     ("rank", -1), ("world_size", -1)]
    assert _defaults(comm.init_distributed)[4] == ("timeout", comm.DEFAULT_TIMEOUT)


def test_init_distributed_takes_init_method_rank_and_world_size(monkeypatch):
    """tcp:// needs rank and world_size in torch's call: they are passed on, not put in the environment."""
    import torch.distributed as dist
    from dist import free_port

    from crew.runtime import comm

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    comm.init_distributed(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                          timeout=datetime.timedelta(seconds=30), verbose=False)
    assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (1, 0, "gloo")
    assert "RANK" not in os.environ and comm.is_initialized()
    comm.init_distributed(dist_init_required=False)  # joined already: nothing to do, as in DeepSpeed


def test_init_distributed_refuses_what_deepspeed_refuses(monkeypatch):
    from crew.errors import CrewError
    from crew.runtime import comm

    with pytest.raises(CrewError, match=r"init_distributed\(dist_init_required=False\) found no process group"):
        comm.init_distributed(dist_init_required=False)
    with pytest.raises(CrewError, match=r"init_distributed\(timeout=30\): expected a datetime.timedelta"):
        comm.init_distributed(timeout=30)
    assert not comm.is_initialized()
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "7")
    assert comm._default_timeout() == datetime.timedelta(minutes=7)  # DeepSpeed's variable, in minutes
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "1h")
    with pytest.raises(CrewError, match="DEEPSPEED_TIMEOUT='1h': expected whole minutes"):
        comm._default_timeout()


def test_lr_schedules_as_accelerate_reads_them():
    import crew.deepspeed as deepspeed
    from crew.deepspeed.errors import UnsupportedAttribute

    schedules = deepspeed.runtime.lr_schedules
    assert schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.5)
    built = [schedules.WarmupLR(optimizer, warmup_num_steps=10), schedules.WarmupDecayLR(optimizer, 100),
             schedules.WarmupCosineLR(optimizer, 100), schedules.OneCycle(optimizer, 0.1, 1.0, cycle_momentum=False),
             schedules.LRRangeTest(optimizer)]
    assert [type(s).__name__ for s in built] == ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                                 "LRRangeTest"]  # all in VALID_LR_SCHEDULES: Accelerate's test
    wrapper = type("Wrapper", (), {"optimizer": optimizer})()
    assert schedules.get_torch_optimizer(wrapper) is optimizer
    with pytest.raises(UnsupportedAttribute, match="deepspeed.runtime.lr_schedules.add_tuning_arguments"):
        schedules.add_tuning_arguments  # noqa: B018


def test_clone_tensors_for_torch_save(tmp_path):
    from collections import OrderedDict

    from crew.deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    big = torch.arange(1000.0, requires_grad=True)
    item = OrderedDict(view=big[:2], nested=[(big[2:3], "text")], number=3)
    cloned = clone_tensors_for_torch_save(item)
    assert type(cloned) is OrderedDict and cloned["number"] == 3 and cloned["nested"][0][1] == "text"
    assert isinstance(cloned["nested"], list) and isinstance(cloned["nested"][0], tuple)
    assert torch.equal(cloned["view"], torch.tensor([0.0, 1.0])) and not cloned["view"].requires_grad
    assert cloned["view"].untyped_storage().nbytes() == 8  # its own 2 floats, not the 1000 it was a view of
    torch.save(cloned, tmp_path / "small.pt")
    torch.save(item, tmp_path / "big.pt")
    assert (tmp_path / "small.pt").stat().st_size < (tmp_path / "big.pt").stat().st_size - 3000
    on_cpu = clone_tensors_for_torch_save(big, device="cpu")
    assert on_cpu.data_ptr() != big.data_ptr() and torch.equal(on_cpu, big.detach())


def test_launcher_constants_and_refused_names():
    from crew.deepspeed.checkpoint import utils as checkpoint_utils
    from crew.deepspeed.errors import UnsupportedAttribute
    from crew.deepspeed.launcher import runner

    assert runner.DEEPSPEED_ENVIRONMENT_NAME == os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    assert (runner.PDSH_MAX_FAN_OUT, runner.DEEPSPEED_ENVIRONMENT_PATHS[1]) == (1024, ".")
    with pytest.raises(UnsupportedAttribute, match=r"deepspeed.launcher.runner.main \(DeepSpeed's launcher: `crew "
                                                   r"run` starts the job\) is not supported by crew"):
        runner.main  # noqa: B018
    with pytest.raises(UnsupportedAttribute, match=r"deepspeed.checkpoint.utils.DeepSpeedCheckpoint \("
                                                   "DeepSpeed's checkpoint reshaping"):
        checkpoint_utils.DeepSpeedCheckpoint  # noqa: B018


def test_utils_logger_and_leaf_modules():
    from crew.deepspeed import utils

    assert isinstance(utils.logger, logging.Logger)
    level = utils.logger.level
    try:
        utils.logger.setLevel(logging.WARNING)  # transformers' deepspeed_init does this
        assert not utils.logger.isEnabledFor(logging.INFO)
    finally:
        utils.logger.setLevel(level)
    model = make_model()
    assert utils.set_z3_leaf_modules(model, [torch.nn.Linear]) == [model[0], model[2]]
    assert utils.get_z3_leaf_modules(model) == [model[0], model[2]] and utils.z3_leaf_module(model[0])
    assert utils.unset_z3_leaf_modules(model, ["torch.nn.modules.linear.Linear"]) == [model[0], model[2]]
    assert utils.get_z3_leaf_modules(model) == []
    assert utils.set_z3_leaf_modules(model, ["Tanh"]) == [model[1]]
    with pytest.raises(ValueError, match="No modules of type"):
        utils.set_z3_leaf_modules(model, [torch.nn.Conv1d])
    assert utils.set_z3_leaf_modules(model, [torch.nn.Conv1d], raise_if_not_found=False) == []


def _grouped_params(model: torch.nn.Module) -> list[dict]:
    """Trainer's shape: weights with decay, biases without, each group its own lr."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 0.002}]


def _steps(make_optimizer, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = make_optimizer(model)
    for step in range(steps):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("source, adamw_mode, reference", [
    (torch.optim.AdamW, True, torch.optim.AdamW),
    (torch.optim.Adam, False, torch.optim.Adam),
    (torch.optim.AdamW, False, torch.optim.Adam),  # the mode holds for every group, whatever the group came from
])
def test_cpu_adam_takes_another_optimizers_param_groups(source, adamw_mode, reference):
    """What Accelerate does when a config offloads the optimizer: DeepSpeedCPUAdam(optimizer.param_groups,
    lr=, weight_decay=, adamw_mode=); each group keeps its own lr and weight decay."""
    from crew.deepspeed.ops.adam import DeepSpeedCPUAdam

    def as_accelerate(model):
        original = source(_grouped_params(model), lr=0.01, weight_decay=0.05)
        return DeepSpeedCPUAdam(original.param_groups, lr=0.01, weight_decay=0.05, adamw_mode=adamw_mode)

    ours = _steps(as_accelerate)
    theirs = _steps(lambda model: reference(_grouped_params(model), lr=0.01, weight_decay=0.05))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not all(torch.equal(a, b) for a, b in zip(ours, _steps(lambda model: reference(model.parameters()))))


def test_cpu_adam_refuses_per_group_what_deepspeed_refuses(capsys):
    from crew.deepspeed.ops.adam import DeepSpeedCPUAdam
    from crew.log import warn_once

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match="DeepSpeedCPUAdam does not support the AMSGrad variant."):
        DeepSpeedCPUAdam([{"params": params, "amsgrad": True}])
    assert not DeepSpeedCPUAdam([{"params": params, "bias_correction": False}]).param_groups[0]["bias_correction"]
    warn_once.cache_clear()
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    assert "optimizer states of bfloat16 parameters are kept in that dtype" in capsys.readouterr().out


def test_cpu_adagrad_is_deepspeeds_kernel():
    """DeepSpeed's kernel: g += wd * p; sum += g²; p -= lr * g / (sqrt(sum) + eps); from torch Adagrad's groups
    (as Accelerate hands them) without their lr_decay and initial accumulator, which the kernel lacks."""
    from crew.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

    def as_accelerate(model):
        original = torch.optim.Adagrad(_grouped_params(model), lr=0.05, lr_decay=0.1, initial_accumulator_value=0.5)
        return DeepSpeedCPUAdagrad(original.param_groups, lr=0.05, weight_decay=0)

    class Kernel(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.05, "eps": 1e-10})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    grad = p.grad + group["weight_decay"] * p
                    total = self.state[p].setdefault("sum", torch.zeros_like(p)).add_(grad * grad)
                    p.sub_(group["lr"] * (grad / (total.sqrt() + group["eps"])))

    ours, kernel = _steps(as_accelerate), _steps(lambda model: Kernel(_grouped_params(model)))
    for a, b in zip(ours, kernel):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_lion_steps_as_deepspeeds_kernels(weight_decay):
    """c = 0.9 m + 0.1 g = (0.05, -0.05, 0): the param moves by lr against c's sign, after decay by 1 - lr * wd;
    at c == 0 the CPU kernel takes the sign bit (+0: down), the CUDA kernel c > 0 (no: up)."""
    from crew.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    decayed = 1 - 0.1 * weight_decay
    for cls, expected in [(DeepSpeedCPULion, [decayed - 0.1, decayed + 0.1, decayed - 0.1]),
                          (FusedLion, [decayed - 0.1, decayed + 0.1, decayed + 0.1])]:
        param = torch.nn.Parameter(torch.ones(3))
        optimizer = cls([param], lr=0.1, weight_decay=weight_decay)
        param.grad = torch.tensor([0.5, -0.5, 0.0])
        optimizer.step()
        torch.testing.assert_close(param.detach(), torch.tensor(expected))
        torch.testing.assert_close(optimizer.state[param]["exp_avg"], torch.tensor([0.0005, -0.0005, 0.0]))
    low = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    low.grad = torch.ones(2, dtype=torch.bfloat16)
    states = []
    for optimizer in (DeepSpeedCPULion([low]), DeepSpeedCPULion([low], fp32_optimizer_states=False), FusedLion([low])):
        optimizer.step()
        states.append(optimizer.state[low]["exp_avg"].dtype)
    assert states == [torch.float32, torch.bfloat16, torch.bfloat16]
