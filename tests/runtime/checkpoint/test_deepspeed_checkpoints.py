"""DeepSpeed 0.19.8 checkpoints (written by real DeepSpeed: deepspeed_data/make_checkpoints.py) loaded by crew's
load_checkpoint and `crew export`: training goes on with the losses DeepSpeed itself had after its own resume,
at world size 2 and 1 and at another ZeRO stage, for every optimizer layout DeepSpeed writes on a CPU (torch's
AdamW, FusedAdam, DeepSpeedCPUAdam/Adagrad/Lion, a client SGD, a ZeRO-3 LoRA with an empty param group);
client_state, counters and lr as DeepSpeed returned them; the fp32 master weights; files naming a class outside
the allow-list, another optimizer's state and model-parallel, MoE or pipeline checkpoints are refused."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import crew as run_crew
from dist import run_ranks

from crew.runtime.checkpoint import CheckpointError

DATA = Path(__file__).parent / "deepspeed_data"
EXPECTED = json.loads((DATA / "expected.json").read_text())
_spec = importlib.util.spec_from_file_location("make_checkpoints", DATA / "make_checkpoints.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)

# fp32: crew's forward, backward, all-reduce and AdamW are the same torch ops as DeepSpeed's: the losses are equal
# at world size 2 and differ by 3e-8 at world size 1 (one micro batch of twice the size sums in another order).
# bf16: under 7e-5 (bf16 gradients reduced in another order); it was 3.3e-4 while crew cast the model's fp32
# buffer to bf16, which DeepSpeed 0.19.8 keeps (crew/runtime/casting.py). Losing the optimizer state moves these
# losses by 2.7e-2 or more. DeepSpeed's C++ kernels (FusedAdam's CPU build, DeepSpeedCPUAdam/Adagrad) round
# otherwise than torch's Adam/Adagrad: relative 2.2e-6 at most in fp32 (a step count off by the 3 saved steps, as
# crew read FusedAdam's stage 0 state before, moves them by 1e-2).
TOLERANCE = {"fp32": {"abs": 1e-6, "rel": 0}, "bf16": {"abs": 1e-4, "rel": 0}, "kernel": {"abs": 0, "rel": 1e-5}}


def tolerance(case: dict) -> dict:
    torch_optimizer = "optimizer" not in case["config"] or case["config"]["optimizer"]["params"].get("torch_adam")
    return TOLERANCE["kernel" if case["precision"] == "fp32" and not torch_optimizer else case["precision"]]


def deepspeed_ops_optimizer(section: dict, params) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed builds for an offloaded config section, as a script under crew builds it itself
    from crew's deepspeed.ops."""
    from crew.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from crew.deepspeed.ops.adam import DeepSpeedCPUAdam
    from crew.deepspeed.ops.lion import DeepSpeedCPULion
    classes = {"Adam": DeepSpeedCPUAdam, "Adagrad": DeepSpeedCPUAdagrad, "Lion": DeepSpeedCPULion}
    return classes[section["type"]](params, **section["params"])


def initialize(name: str, config: dict, seed: int = 99, empty_groups: int = 0, ops: bool = False):
    """crew.initialize as make_checkpoints.py initializes DeepSpeed for case `name`, with `empty_groups` more param
    groups without parameters; `ops`: the config's optimizer built from deepspeed.ops."""
    import crew

    case = EXPECTED["cases"][name]
    model, params = made.case_model(name, seed=seed)
    if empty_groups:
        params = list(params) + [{"params": [], "weight_decay": 0.0} for _ in range(empty_groups)]
    if case.get("client_optimizer"):
        optimizer = made.client_optimizer(case["client_optimizer"], params)
    elif ops:
        optimizer = deepspeed_ops_optimizer(config.pop("optimizer"), params)
    else:
        return crew.initialize(model=model, model_parameters=params, config=config)[0]
    return crew.initialize(model=model, optimizer=optimizer, config=config)[0]


def resume(rank: int, name: str, world: int, stage: int | None = None, folder: Path | None = None,
           empty_groups: int = 0, ops: bool = False, **load: bool) -> dict:
    """A fresh crew engine (as a user's restart: another seed) loads DeepSpeed's checkpoint `name` (from `folder`,
    if given) and trains the steps DeepSpeed trained after its own resume; every micro step's loss averaged over
    the ranks."""
    case = EXPECTED["cases"][name]
    config = copy.deepcopy(case["config"])
    config["train_micro_batch_size_per_gpu"] = made.MICRO * made.WORLD // world
    if stage is not None:
        config["zero_optimization"] = {"stage": stage}
    engine = initialize(name, config, empty_groups=empty_groups, ops=ops)
    path, client = engine.load_checkpoint(folder or DATA / name, **load)
    weights = fp32_weights(engine)
    after_load = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                  "skipped_steps": engine.skipped_steps, "lr": engine.get_lr()[0]}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case["precision"], torch.float32)
    losses, lrs = [], []
    for step in range(made.K_STEPS, made.K_STEPS + made.M_STEPS):
        for micro_step in range(made.ACCUMULATION):
            inputs, targets = made.batch(step, micro_step, rank, world)
            loss = made.loss_of(engine(inputs.to(dtype)), targets)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            if world > 1:
                torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        lrs.append(engine.get_lr()[0])
    return {"path": path, "client": client, "after_load": after_load, "losses": losses, "lrs": lrs, "weights": weights,
            "final": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                      "skipped_steps": engine.skipped_steps}}


def fp32_weights(engine) -> dict[str, torch.Tensor]:
    """The engine's fp32 weights (its masters under bf16), whole, on rank 0 (a collective at stages 2-3)."""
    from crew.runtime.checkpoint.state import fp32_module_state, gathered_masters
    if engine.zero.shards_params:
        from crew.runtime.checkpoint.sharded import full_module_state
        whole = full_module_state(engine.module)
    else:
        whole = fp32_module_state(engine, gathered_masters(engine))
    return {name: value.clone() for name, value in whole.items()}  # fp32 ones are the live parameters


def reference(name: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master weights at the save, by name (make_checkpoints.py)."""
    return torch.load(DATA / name / "reference_fp32.pt", weights_only=True)


def check_resumed(name: str, got: dict, stage: int | None = None) -> None:
    """`got` (from resume) against what DeepSpeed did after loading `name`; `stage`: crew's, if not the saved."""
    case = EXPECTED["cases"][name]
    assert Path(got["path"]) == DATA / name / case["tag"]
    assert got["losses"] == pytest.approx(case["resumed_losses"], **tolerance(case))
    assert got["lrs"] == pytest.approx(case["resumed_lrs"], rel=1e-12)
    assert got["after_load"] == pytest.approx(case["after_load"], rel=1e-12)
    assert got["final"] == case["final_counters"]
    if got["weights"]:  # rank 0: the fp32 masters DeepSpeed saved, exactly
        for key, value in reference(name).items():
            assert torch.equal(got["weights"][key], value), key
    # what DeepSpeed's load_checkpoint returned: the script's keys and DeepSpeed's own (ds_config, ...); and, where
    # the loading engine runs stage 0, the optimizer's state dict from the model states file (None at stages 1-3)
    stage0 = (case["stage"] if stage is None else stage) == 0
    keys = set(case["client_state_keys"]) - {"optimizer"} | ({"optimizer"} if stage0 else set())
    assert set(got["client"]) == keys
    assert {key: got["client"][key] for key in EXPECTED["client_state"]} == case["client_state"]
    assert got["client"]["ds_version"] == "0.19.8"


# (case, crew ZeRO stage: None = the saved one, load_checkpoint's keyword arguments) for the two-rank run
TWO_RANKS = [(name, None, {}) for name in EXPECTED["cases"]] + [
    ("stage3_bf16", 1, {}),  # ZeRO-3's per-parameter partitions into a sharded optimizer
    ("stage1_fp32", 3, {}),  # flat partitions into FSDP2 shards
    ("stage0_fp32", 3, {}),  # by position into FSDP2 shards
    ("stage0_bf16_groups", 2, {}),  # by position, two param groups, into stage 2's owners
    ("stage2_fp32", 0, {"tag": "my_tag"}),
    ("fusedadam_stage0_fp32_decay", 2, {}),  # FusedAdam's stage-0 step into stage 2's owners
    ("cpuadam_stage2_offload", 3, {}),  # CPU Adam's int step and group keys into FSDP2 shards
    ("fusedadam_stage3_fp32", 0, {}),
    ("cpuadagrad_stage2_offload", 0, {}),
    ("lora_stage3", 1, {}),  # an empty group at ZeRO 1
    ("lora_stage3", None, {"empty_groups": 1}),  # two empty groups: DSD takes one at most
]


def in_turn(rank: int, calls: list[tuple]) -> list[dict]:
    return [resume(rank, name, 2, stage, **load) for name, stage, load in calls]


def test_two_ranks_continue_with_deepspeeds_losses():
    """Every case at world size 2, DeepSpeed's own world, at the saved ZeRO stage and at another, in one pair
    of processes."""
    results = run_ranks(in_turn, 2, TWO_RANKS, timeout=240)
    for (name, stage, _), got in zip(TWO_RANKS, results[0], strict=True):
        check_resumed(name, got, stage)


@pytest.mark.parametrize("name", sorted(EXPECTED["cases"]))
def test_one_rank_continues_with_deepspeeds_losses(name):
    """World size 1 (DeepSpeed saved on 2): each rank's partitions merged, the same global batch."""
    check_resumed(name, resume(0, name, 1))


@pytest.mark.parametrize("name", ["cpuadam_stage3_offload_bf16", "cpuadagrad_stage2_offload", "cpulion_stage2_offload"])
def test_deepspeeds_optimizer_built_by_the_script_continues(name):
    """The script builds DeepSpeedCPUAdam/Adagrad/Lion itself (crew's deepspeed.ops), as the config would have."""
    check_resumed(name, resume(0, name, 1, ops=True))


def test_load_flags_as_deepspeed():
    """load_optimizer_states=False: the module's 16-bit weights (DeepSpeed restores its masters from them), no
    optimizer state, the scheduler and counters; load_module_only: weights alone; load_lr_scheduler_states=False:
    a fresh schedule. client_state keeps what the engine did not take, as DeepSpeed's does."""
    case = EXPECTED["cases"]["stage1_bf16"]
    weights_only = resume(0, "stage1_bf16", 1, load_optimizer_states=False)
    for key, value in reference("stage1_bf16").items():
        assert torch.equal(weights_only["weights"][key], value.to(torch.bfloat16).float()), key
    assert weights_only["client"]["optimizer"] is None  # not taken: DeepSpeed returns it (None at ZeRO stages)
    assert weights_only["after_load"]["global_steps"] == 3 and weights_only["lrs"] == case["resumed_lrs"]
    assert max(abs(a - b) for a, b in zip(weights_only["losses"], case["resumed_losses"])) > 1e-2  # no Adam state

    module_only = resume(0, "stage3_fp32", 1, load_module_only=True)
    assert module_only["after_load"]["global_steps"] == 0 and module_only["client"]["global_steps"] == 3
    assert {"skipped_steps", "dp_world_size", "mp_world_size", "data_sampler"} <= set(module_only["client"])
    assert "lr_scheduler" not in module_only["client"] and "optimizer" not in module_only["client"]
    for key, value in reference("stage3_fp32").items():
        assert torch.equal(module_only["weights"][key], value), key

    fresh_schedule = resume(0, "stage2_fp32", 1, load_lr_scheduler_states=False)
    assert fresh_schedule["client"]["lr_scheduler"] == {"last_batch_iteration": 2}
    assert fresh_schedule["after_load"]["lr"] == case["after_load"]["lr"]  # the optimizer's, as saved
    assert fresh_schedule["lrs"] != case["resumed_lrs"]


class Wider(made.TinyModel):
    def __init__(self):
        super().__init__()
        self.fc3 = torch.nn.Linear(5, 5)


def test_strict_and_non_strict_module_loading():
    import crew

    engine, _, _, _ = crew.initialize(model=Wider(), config=EXPECTED["cases"]["stage1_fp32"]["config"] | {
        "train_micro_batch_size_per_gpu": 8})
    with pytest.raises(CheckpointError, match=r"missing \['fc3.bias', 'fc3.weight'\].*load_module_strict=False"):
        engine.load_checkpoint(DATA / "stage1_fp32", load_optimizer_states=False)
    engine.load_checkpoint(DATA / "stage1_fp32", load_module_strict=False, load_optimizer_states=False)
    assert torch.equal(engine.module.fc2.bias.detach(), reference("stage1_fp32")["fc2.bias"])


def test_crew_export_writes_deepspeeds_fp32_master_weights(tmp_path):
    from crew.runtime.checkpoint import export

    for name, case in EXPECTED["cases"].items():  # a tag folder; each case's bf16 module is only the rounded copy
        exported = tmp_path / f"{name}.pt"
        export(DATA / name / case["tag"], exported)
        weights = torch.load(exported, weights_only=True)
        assert list(weights) == list(made.case_model(name, 0)[0].state_dict())
        assert all(value.dtype == torch.float32 for value in weights.values())
        for key, value in reference(name).items():
            assert torch.equal(weights[key], value), (name, key)
    result = run_crew("export", str(DATA / "stage3_bf16"), str(tmp_path / "model.pt"), cwd=tmp_path)  # a save dir
    assert result.code == 0, result.err
    assert "stage3_bf16/global_step3" in result.err
    made.TinyModel().load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))


def copy_case(name: str, tmp_path: Path) -> Path:
    shutil.copytree(DATA / name, tmp_path / name)
    return tmp_path / name


def model_states_with(folder: Path, **extra) -> None:
    """Rewrite the tag's model states file with `extra` keys, as a script's client_state would add them."""
    from crew.runtime.checkpoint.deepspeed_files import read
    path = folder / "global_step3" / "mp_rank_00_model_states.pt"
    torch.save({**read(path), **extra}, path)


class Payload:
    def __reduce__(self):
        import os
        return os.system, (f"touch {MARKER}",)


MARKER = Path("/tmp/crew-deepspeed-unpickled-payload")


@pytest.mark.parametrize("value, named", [(argparse.Namespace(lr=1.0), "argparse.Namespace"),
                                          (Payload(), "system")])
def test_a_class_outside_the_allow_list_is_refused(tmp_path, value, named):
    import crew
    from crew.runtime.checkpoint import export

    MARKER.unlink(missing_ok=True)
    folder = copy_case("stage1_fp32", tmp_path)
    model_states_with(folder, args=value)
    engine, _, _, _ = crew.initialize(model=made.build_model(0), config=EXPECTED["cases"]["stage1_fp32"]["config"] | {
        "train_micro_batch_size_per_gpu": 8})
    with pytest.raises(CheckpointError) as raised:
        engine.load_checkpoint(folder)
    message = str(raised.value)
    assert "mp_rank_00_model_states.pt holds a pickled" in message and named in message
    assert "weights_only=True" in message and "Weights only load failed" not in message
    assert not MARKER.exists()
    with pytest.raises(CheckpointError, match=named):  # `crew export` too
        export(folder, tmp_path / "out.pt")
    assert not MARKER.exists()


def test_a_missing_rank_file_is_named(tmp_path):
    import crew

    folder = copy_case("stage2_fp32", tmp_path)
    (folder / "my_tag" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    engine, _, _, _ = crew.initialize(model=made.build_model(0), config=EXPECTED["cases"]["stage2_fp32"]["config"] | {
        "train_micro_batch_size_per_gpu": 8})
    with pytest.raises(CheckpointError, match="lacks zero_pp_rank_1_mp_rank_00_optim_states.pt.*saved by 2 ranks"):
        engine.load_checkpoint(folder)
    engine.load_checkpoint(folder, load_optimizer_states=False)  # stages 0-2: the weights are in the module file
    assert engine.global_steps == 3


def rewrite_stage0_step(folder: Path, in_group: bool) -> None:
    """The FusedAdam case's optimizer with its step in the param group only (in_group: an older FusedAdam's, whose
    step counted the group's; 0.19.8 still starts from it, fused_adam.py 150-153: "In order to keep backward
    compatibility for the existing checkpoints, we use group['state'] to initialize state['step'] if it
    exists"), or with every parameter's step at 0, as crew took the group's first parameter's."""
    from crew.runtime.checkpoint.deepspeed_files import read
    path = folder / "global_step3" / "mp_rank_00_model_states.pt"
    saved = read(path)
    optimizer = saved["optimizer"]
    for entry in optimizer["state"].values():
        del entry["step"]
        if not in_group:
            entry["step"] = 0
    optimizer["param_groups"][0]["step"] = 3 if in_group else 0
    torch.save(saved, path)


def test_fused_adams_step_in_the_group_or_counted_on_the_last_parameter(tmp_path):
    """FusedAdam's CUDA build has no fixture (no GPU here): it runs the same Python step as the CPU build
    (deepspeed/ops/adam/fused_adam.py 130-193, only FusedAdamBuilder differs), so fusedadam_stage0_fp32_decay
    is its layout too: the step counted on the group's last parameter only. Its older layout keeps the step in
    the param group; a step count of 0, as crew read the group's first parameter's, moves the losses."""
    name = "fusedadam_stage0_fp32_decay"
    case = EXPECTED["cases"][name]
    older = copy_case(name, tmp_path / "older")
    rewrite_stage0_step(older, in_group=True)
    assert resume(0, name, 1, folder=older)["losses"] == pytest.approx(case["resumed_losses"], **tolerance(case))
    restarted = copy_case(name, tmp_path / "restarted")
    rewrite_stage0_step(restarted, in_group=False)
    losses = resume(0, name, 1, folder=restarted)["losses"]
    assert max(abs(a - b) / b for a, b in zip(losses, case["resumed_losses"])) > 1e-3


@pytest.mark.parametrize("name, optimizer, named", [
    ("cpuadagrad_stage2_offload", "Adam", r"holds \['exp_avg_sq', 'step'\], which this engine's AdamW cannot take"),
    ("cpulion_stage2_offload", "Adam", "group 0 has no eps, which this engine's AdamW needs"),
    ("fusedadam_stage1_fp32", "Adagrad", r"holds \['exp_avg', 'exp_avg_sq', 'step'\].*Adagrad cannot take"),
])
def test_an_optimizer_state_of_another_optimizer_is_refused(name, optimizer, named):
    """DeepSpeed's state of one optimizer into an engine built with another: one error naming the file and what
    does not fit, not a silent load."""
    case = EXPECTED["cases"][name]
    config = case["config"] | {"train_micro_batch_size_per_gpu": 8,
                               "optimizer": {"type": optimizer, "params": {"lr": 0.01}}}
    engine = initialize(name, config)
    with pytest.raises(CheckpointError, match=f"zero_pp_rank_0_mp_rank_00_optim_states.pt: .*{named}.*"
                                              "load_optimizer_states=False"):
        engine.load_checkpoint(DATA / name)


@pytest.mark.parametrize("extra, what", [
    ("mp_rank_01_model_states.pt", "tensor \\(model\\) parallel ranks"),
    ("layer_0_expert_0_mp_rank_00_model_states.pt", "mixture-of-experts layers"),  # engine._get_expert_ckpt_name
    ("layer_01-model_states.pt", "pipeline-parallel layers"),  # PipelineModule.ckpt_layer_path
])
def test_model_parallel_experts_and_pipeline_are_refused(tmp_path, extra, what):
    """A DeepSpeed checkpoint crew does not read: one error naming the file and what it holds."""
    folder = copy_case("stage1_fp32", tmp_path)
    torch.save({}, folder / "global_step3" / extra)
    config = EXPECTED["cases"]["stage1_fp32"]["config"] | {"train_micro_batch_size_per_gpu": 8}
    engine = initialize("stage1_fp32", config)
    with pytest.raises(CheckpointError, match=f"global_step3 holds {extra}: a DeepSpeed checkpoint with {what}, "
                                              "which crew does not read.*zero_to_fp32.py"):
        engine.load_checkpoint(folder)


def test_fused_lambs_state_is_refused_by_adam(tmp_path):
    """FusedLamb has no CPU build, so no fixture: its state is built here as deepspeed/ops/lamb/fused_lamb.py
    (0.19.8) keeps it, per parameter step (an int), exp_avg and exp_avg_sq, as Adam's, and param groups with
    max_grad_norm, max_coeff and min_coeff (lines 56-64). crew has no LAMB: loaded into Adam it is one error."""
    from crew.runtime.checkpoint.deepspeed_files import read
    name = "fusedadam_stage1_fp32"
    folder = copy_case(name, tmp_path)
    for path in (folder / "global_step3").glob("zero_pp_rank_*_optim_states.pt"):
        state = read(path)["optimizer_state_dict"]
        for group in state["base_optimizer_state"]["param_groups"]:
            del group["step"]
            group.update(max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01)
        # without DeepSpeed's pickled objects, which would be saved under crew's stand-ins' names
        plain = ("loss_scaler", "zero_stage", "param_slice_mappings")
        torch.save({"optimizer_state_dict": {key: value for key, value in state.items() if key not in plain}}, path)
    engine = initialize(name, EXPECTED["cases"][name]["config"] | {"train_micro_batch_size_per_gpu": 8})
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt: the saved param group of "
                                              "this engine's group 0 has max_grad_norm=0.0, which this engine's "
                                              "AdamW has no setting for"):
        engine.load_checkpoint(folder)
