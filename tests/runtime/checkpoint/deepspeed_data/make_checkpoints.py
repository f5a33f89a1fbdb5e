"""Writes the DeepSpeed 0.19.8 checkpoints beside this file, with real DeepSpeed, and what DeepSpeed does
after loading each of them (expected.json). Not a test: tests/runtime/checkpoint/test_deepspeed_checkpoints.py
reads what it writes.

    cd /work/main   # the repository root
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /opt/dsvenv/bin/python \\
        tests/runtime/checkpoint/deepspeed_data/make_checkpoints.py [CASE ...]

With case names, only those are written again (expected.json keeps the other cases' entries); without, all.
/opt/dsvenv: Python 3.11 with torch 2.13.0+cpu and deepspeed 0.19.8 (pip install deepspeed==0.19.8 into a venv
that has torch). The script starts itself twice under that venv's torchrun (2 CPU ranks, gloo): "save" builds
the model (fixed seed), trains K_STEPS optimizer steps on fixed data in every case, and saves one checkpoint
per case with a client_state; then "resume", a fresh pair of processes as a user's restart would be, builds
the model again from another seed, lets DeepSpeed's load_checkpoint restore it, records what it returned, and
trains M_STEPS more steps. Each case's save dir keeps only DeepSpeed's checkpoint (`latest` and the tag
folder); the zero_to_fp32.py/zero_to_torch.py scripts DeepSpeed copies beside the tags are deleted.
DeepSpeed's first init_distributed on a machine compiles a C++ op (about 30 s), and its CPU optimizers (FusedAdam's
CPU build, CPU Adam, Adagrad and Lion) one each (minutes); after that the whole run takes about 90 s on 2 cores.
The files take about 1 MB.

Cases: ZeRO stages 0-3 in fp32 and bf16 with torch's AdamW (torch_adam); stage 1 bf16 with fp32 gradient
accumulation (DeepSpeed's BF16_Optimizer); stages 0 and 3 in bf16 with two param groups (weights, then biases
without weight decay). Then one a layout of DeepSpeed's own optimizers a CPU reaches: "Adam" as FusedAdam's CPU
build at stages 0 (with WarmupDecayLR), 1, 2 (bf16) and 3; DeepSpeedCPUAdam (offload_optimizer) at stages 1, 2
and 3 (bf16); DeepSpeedCPUAdagrad and DeepSpeedCPULion (offload, stage 2); a client torch.optim.SGD with momentum
at stages 0 and 1; and a LoRA fine-tune at ZeRO 2 and 3 (frozen base, trainable adapters; Transformers' two
param groups, the second empty, which DeepSpeed drops). FusedAdam's CUDA build runs the same Python step
(deepspeed/ops/adam/fused_adam.py) as its CPU build, so its state has the same layout.
Under bf16 DeepSpeed names the optimizer files bf16_zero_pp_rank_*. Not among them:
- fp16: DeepSpeed 0.19.8 refuses it on its CPU accelerator (ValueError "Type fp16 is not supported on your
  device." from engine._do_sanity_check: torch.ops.mkldnn._is_mkldnn_fp16_supported() is False here), and
  this machine has no GPU;
- zero_optimization.elastic_checkpoint, which DeepSpeed 0.19.8 cannot load back itself with torch's Adam
  (an AssertionError in _restore_step_from_elastic_checkpoint: the step is in the optimizer state).

Every micro step's loss is averaged over the two ranks (each rank's micro batch is a different slice of the
same data), so a run on one rank with twice the micro batch computes the same numbers. expected.json holds,
per case: the config, DeepSpeed's losses before the save and after its own resume, the lr after each resumed
step, the counters after load and at the end, and the client_state load_checkpoint returned (its keys; the
values of the keys the script saved). reference_fp32.pt (one per case) holds DeepSpeed's fp32 master weights
at the save, by parameter name, as DeepSpeed's safe_get_full_fp32_param assembles them (the module's own
weights in fp32 at stage 0, the fp32 copies FP16_UnfusedOptimizer keeps under bf16 at stage 0).

The model, data, config and batches are plain torch, importable without deepspeed (the test uses them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
K_STEPS, M_STEPS = 3, 3
MICRO, ACCUMULATION, WORLD = 4, 2, 2
CLIENT_STATE = {"epoch": 1, "note": "saved by deepspeed", "seen": [3, 5, 8]}
CASES = {  # name: (ZeRO stage, precision, extra config, two param groups (weights, biases) or one)
    "stage0_fp32": (0, "fp32", {}, False),
    "stage1_fp32": (1, "fp32", {}, False),
    "stage2_fp32": (2, "fp32", {}, False),
    "stage3_fp32": (3, "fp32", {}, False),
    "stage0_bf16": (0, "bf16", {}, False),
    "stage1_bf16": (1, "bf16", {}, False),
    "stage2_bf16": (2, "bf16", {}, False),
    "stage3_bf16": (3, "bf16", {}, False),
    "stage1_bf16_fp32accum": (1, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}, False),
    "stage0_bf16_groups": (0, "bf16", {}, True),
    "stage3_bf16_groups": (3, "bf16", {}, True),
}
TAGS = {"stage2_fp32": "my_tag"}  # an explicit tag; the others take DeepSpeed's default, global_step<N>

# The optimizer layouts DeepSpeed 0.19.8 writes on a CPU. "Adam" without torch_adam is FusedAdam (its CPU build,
# deepspeed/ops/op_builder/cpu/fused_adam.py) without offload, DeepSpeedCPUAdam with offload_optimizer
# (engine.py get_optimizer_configuration); "Adagrad"/"Lion" with offload are DeepSpeedCPUAdagrad/DeepSpeedCPULion.
FUSED_ADAM = {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 2,
                                             "total_num_steps": 8, "warmup_type": "linear"}}
CASES.update({
    "fusedadam_stage0_fp32_decay": (0, "fp32", {"optimizer": FUSED_ADAM, "scheduler": DECAY}, False),
    "fusedadam_stage1_fp32": (1, "fp32", {"optimizer": FUSED_ADAM}, False),
    "fusedadam_stage2_bf16": (2, "bf16", {"optimizer": FUSED_ADAM}, False),
    "fusedadam_stage3_fp32": (3, "fp32", {"optimizer": FUSED_ADAM}, False),
    "cpuadam_stage1_offload": (1, "fp32", {"optimizer": FUSED_ADAM, "zero_optimization": {"stage": 1, **OFFLOAD}},
                               False),
    "cpuadam_stage2_offload": (2, "fp32", {"optimizer": FUSED_ADAM, "zero_optimization": {"stage": 2, **OFFLOAD}},
                               False),
    "cpuadam_stage3_offload_bf16": (3, "bf16", {"optimizer": FUSED_ADAM,
                                                "zero_optimization": {"stage": 3, **OFFLOAD}}, False),
    "cpuadagrad_stage2_offload": (2, "fp32", {"optimizer": {"type": "Adagrad", "params": {"lr": 0.05,
                                                                                          "weight_decay": 0.01}},
                                              "zero_optimization": {"stage": 2, **OFFLOAD}}, False),
    "cpulion_stage2_offload": (2, "fp32", {"optimizer": {"type": "Lion", "params": {"lr": 0.002,
                                                                                    "weight_decay": 0.01}},
                                           "zero_optimization": {"stage": 2, **OFFLOAD}}, False),
    "sgd_client_stage0": (0, "fp32", {}, False),
    "sgd_client_stage1": (1, "fp32", {"zero_allow_untested_optimizer": True}, False),
    "lora_stage3": (3, "fp32", {"optimizer": FUSED_ADAM}, False),
    "lora_stage2": (2, "fp32", {"optimizer": FUSED_ADAM}, False),
})
CLIENT_OPTIMIZER = {"sgd_client_stage0": "sgd", "sgd_client_stage1": "sgd"}  # passed to initialize, no section
LORA = {"lora_stage3", "lora_stage2"}  # LoraModel, its groups as lora_groups()


class TinyModel(torch.nn.Module):
    """Two Linear layers with odd sizes (the flat partitions need padding) and a persistent buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(9, 23)
        self.fc2 = torch.nn.Linear(23, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def build_model(seed: int) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel()


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    samples = (K_STEPS + M_STEPS) * MICRO * ACCUMULATION * WORLD
    inputs = torch.randn(samples, 9, generator=generator)
    targets = torch.randn(samples, 5, generator=generator) * 0.1 + inputs[:, :5].sin()
    return inputs, targets


def batch(step: int, micro_step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro batch (of `world` ranks sharing the global batch of MICRO * WORLD samples a micro
    step) at optimizer step `step`, micro step `micro_step` of its accumulation."""
    inputs, targets = dataset()
    global_micro = MICRO * WORLD
    per_rank = global_micro // world
    start = (step * ACCUMULATION + micro_step) * global_micro + rank * per_rank
    return inputs[start:start + per_rank], targets[start:start + per_rank]


class LoraModel(TinyModel):
    """A PEFT-style LoRA fine-tune: TinyModel's weights frozen, a rank-2 adapter (A, then B) beside each Linear."""

    def __init__(self):
        super().__init__()
        for name, layer in (("fc1", self.fc1), ("fc2", self.fc2)):
            layer.requires_grad_(False)
            self.add_module(f"{name}_lora_a", torch.nn.Linear(layer.in_features, 2, bias=False))
            self.add_module(f"{name}_lora_b", torch.nn.Linear(2, layer.out_features, bias=False))

    def forward(self, x):
        h = torch.relu(self.fc1(x) + self.fc1_lora_b(self.fc1_lora_a(x)))
        return (self.fc2(h) + self.fc2_lora_b(self.fc2_lora_a(h))) * self.scale


def build_lora_model(seed: int) -> LoraModel:
    torch.manual_seed(0)  # the base model as pretrained: the same in every run
    model = LoraModel()
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora" in name:
            torch.nn.init.normal_(param, std=0.2)
    return model


def lora_groups(model: torch.nn.Module) -> list[dict]:
    """Transformers' Trainer's groups for a LoRA model (LLaMA-Factory's): the trainable weights with weight
    decay, and the trainable biases and norms without it: none here, an empty group."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    return [{"params": trainable, "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}]


def client_optimizer(kind: str, params) -> torch.optim.Optimizer:
    assert kind == "sgd"
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """The grouped cases' model_parameters: weights with weight decay, biases without (in that order, which is
    not the order of model.parameters())."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def config(stage: int, precision: str, extra: dict, client: bool = False) -> dict:
    out = {
        "train_batch_size": MICRO * ACCUMULATION * WORLD, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 10,
                                 "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision == "bf16"},
        **extra,
    }
    if client:  # the optimizer is passed to initialize
        del out["optimizer"]
    return out


def loss_of(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output.float(), targets)


# -- under torchrun, with deepspeed --------------------------------------------------------------

def _train(engine, steps: range, dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Train `steps`; every micro step's loss averaged over the ranks, the lr after each step."""
    import deepspeed.comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, lrs = [], []
    for step in steps:
        for micro_step in range(ACCUMULATION):
            inputs, targets = batch(step, micro_step, rank, world)
            loss = loss_of(engine(inputs.to(dtype)), targets)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        lrs.append(engine.get_lr()[0])
    return losses, lrs


def _masters(engine, stage: int, precision: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master weights by parameter name (a collective at stages 1-3)."""
    from deepspeed.utils import safe_get_full_fp32_param
    named = list(engine.module.named_parameters())
    if precision == "fp32" and stage == 0:
        return {name: param.detach().float().clone() for name, param in named}
    if stage == 0:  # FP16_UnfusedOptimizer (bf16, torch's AdamW): an fp32 copy of each param, as grouped
        names = {id(param): name for name, param in named}
        return {names[id(param)]: copy.detach().clone()
                for model_group, copies in zip(engine.optimizer.fp16_groups, engine.optimizer.fp32_groups)
                for param, copy in zip(model_group, copies, strict=True)}
    return {name: safe_get_full_fp32_param(param).detach().float().cpu().clone() for name, param in named
            if param.requires_grad}  # a frozen parameter has no master


def case_config(name: str) -> dict:
    return config(*CASES[name][:3], client=name in CLIENT_OPTIMIZER)


def case_model(name: str, seed: int) -> tuple[torch.nn.Module, list | object]:
    """The case's model and the model_parameters it is initialized with."""
    if name in LORA:
        model = build_lora_model(seed)
        return model, lora_groups(model)
    model = build_model(seed)
    return model, param_groups(model) if CASES[name][3] else model.parameters()


def _initialize(name: str, seed: int):
    import deepspeed
    stage, precision, _, _ = CASES[name]
    model, params = case_model(name, seed)
    if name in CLIENT_OPTIMIZER:
        engine, _, _, _ = deepspeed.initialize(model=model, config=case_config(name),
                                               optimizer=client_optimizer(CLIENT_OPTIMIZER[name], params))
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, config=case_config(name), model_parameters=params)
    return engine, stage, precision


def _counters(engine) -> dict:
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps}


def save_phase(names: list[str]) -> None:
    import deepspeed.comm as dist
    results = {}
    for name in names:
        engine, stage, precision = _initialize(name, seed=0)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        losses, lrs = _train(engine, range(K_STEPS), dtype)
        save_dir = HERE / name
        if dist.get_rank() == 0:
            shutil.rmtree(save_dir, ignore_errors=True)
        dist.barrier()
        engine.save_checkpoint(str(save_dir), tag=TAGS.get(name), client_state=dict(CLIENT_STATE))
        masters = _masters(engine, stage, precision)
        if dist.get_rank() == 0:
            torch.save(masters, save_dir / "reference_fp32.pt")
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                (save_dir / script).unlink(missing_ok=True)
            results[name] = {"optimizer": type(engine.optimizer).__name__, "saved_losses": losses,
                             "saved_lrs": lrs, "saved_counters": _counters(engine),
                             "tag": TAGS.get(name, f"global_step{K_STEPS}")}
        dist.barrier()
    if dist.get_rank() == 0:
        (HERE / "saved.json").write_text(json.dumps(results))


def resume_phase(names: list[str]) -> None:
    import deepspeed.comm as dist
    saved = json.loads((HERE / "saved.json").read_text()) if dist.get_rank() == 0 else None
    expected = {}
    for name in names:
        engine, stage, precision = _initialize(name, seed=99)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        path, client_state = engine.load_checkpoint(str(HERE / name))
        after_load = {**_counters(engine), "lr": engine.get_lr()[0]}
        losses, lrs = _train(engine, range(K_STEPS, K_STEPS + M_STEPS), dtype)
        if dist.get_rank() == 0:
            expected[name] = {
                **saved[name], "stage": stage, "precision": precision, "config": case_config(name),
                "grouped": CASES[name][3], "client_optimizer": CLIENT_OPTIMIZER.get(name),
                "model": "lora" if name in LORA else "tiny",
                "loaded_path": os.path.relpath(path, HERE), "client_state_keys": sorted(client_state),
                "client_state": {key: client_state[key] for key in CLIENT_STATE},
                "after_load": after_load, "resumed_losses": losses, "resumed_lrs": lrs,
                "final_counters": _counters(engine),
            }
        dist.barrier()
    if dist.get_rank() == 0:
        (HERE / "saved.json").unlink()
        versions = {"deepspeed": __import__("deepspeed").__version__, "torch": torch.__version__}
        previous = json.loads((HERE / "expected.json").read_text())["cases"] if (HERE / "expected.json").is_file() \
            else {}
        cases = {case: expected.get(case, previous.get(case)) for case in CASES if case in expected or case in previous}
        document = {"made_by": "make_checkpoints.py", "versions": versions, "world_size": WORLD,
                    "k_steps": K_STEPS, "m_steps": M_STEPS, "client_state": CLIENT_STATE, "cases": cases}
        (HERE / "expected.json").write_text(json.dumps(document, indent=1) + "\n")


def main() -> None:
    if sys.argv[1:2] in (["save"], ["resume"]):
        __import__("deepspeed").init_distributed(dist_backend="gloo")
        {"save": save_phase, "resume": resume_phase}[sys.argv[1]](sys.argv[2:])
        return
    names = sys.argv[1:] or list(CASES)  # the cases named (expected.json keeps the others'), or all
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"no such case: {unknown}; the cases are {list(CASES)}")
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for phase in ("save", "resume"):
        subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(WORLD), __file__, phase, *names],
                       env=env, check=True)


if __name__ == "__main__":
    main()
