"""Real DeepSpeed 0.19.8 loads crew's ZeRO-3 state written as its stage-3 files and trains on with crew's own next
losses; DeepSpeed's own zero_to_fp32.py on the folder gives crew's weights (a check run by hand; needs DeepSpeed).

crew (2 CPU ranks, gloo, its venv) trains each case 3 steps at ZeRO stage 3 and saves with engine.save_checkpoint
(`latest`, zero_pp_rank_R_mp_rank_00_model_states.pt and [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt per rank,
from crew/runtime/checkpoint/deepspeed_zero3.py, crew's own files beside), then trains 3 more steps and records
their losses. DeepSpeed (2 CPU ranks, its venv, the same config, the model built from another seed) loads the
folder with load_checkpoint and trains the same 3 steps. Then DeepSpeed's zero_to_fp32.py, copied beside the tag as
DeepSpeed copies it, converts the folder; its weights must equal crew's fp32 weights at the save.

    .venv/bin/python benchmarks/deepspeed_zero3_check.py [--dsvenv /opt/dsvenv] [--out /tmp/ds_zero3_check]
        [--only stage3_fp32,...] [--plain]

--plain: write only DeepSpeed's files, from deepspeed_zero3.py's two dicts with torch.save here (the keys common
to every stage added as DeepSpeed's engine.py adds them), not through save_checkpoint. DeepSpeed's first start
compiles its C++ ops (FusedAdam's, CPU Adam's and CPU Adagrad's CPU builds: a minute or two); after that the whole
check takes about 3 minutes on 2 busy cores. Measured 2026-11-28, both ways, every case ok: fp32 with torch's
AdamW and CPU Adagrad bitwise, FusedAdam within 6e-7 (its kernel is not torch's), bf16 within 4.3e-5 (the first
two losses after the load equal; bf16 gradients then reduce in another order), zero_to_fp32 bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
_spec = importlib.util.spec_from_file_location(
    "make_checkpoints", REPO / "tests/runtime/checkpoint/deepspeed_data/make_checkpoints.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)  # DeepSpeed's fixtures' model, data and config: plain torch
K_STEPS, M_STEPS = 3, 3
TOLERANCE = {"fp32": 1e-6, "bf16": 1e-4}
FUSED_ADAM = {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01}}  # FusedAdam (CPU build) in DeepSpeed
# With offload, DeepSpeed's CPU Adagrad. Not without: DeepSpeed's stage 3 then rebuilds torch's Adagrad over its flat
# groups, and a fresh engine cannot load even DeepSpeed's own checkpoint of it (ValueError "loaded state dict contains
# a parameter group that doesn't match the size of optimizer's group": the rebuilt group still holds the flat
# tensor when _rigid_load_state_dict appends it again).
ADAGRAD = {"type": "Adagrad", "params": {"lr": 0.05, "weight_decay": 0.01}}
# name: (model "tiny", "lora" (make_checkpoints.py's) or "tied" (below), precision, config changes,
#        param groups: None, "weights_biases", "with_empty")
CASES = {
    "stage3_fp32": ("tiny", "fp32", {}, None),
    "stage3_bf16": ("tiny", "bf16", {}, None),
    "stage3_bf16_groups": ("tiny", "bf16", {}, "weights_biases"),
    "stage3_fp32_fusedadam_subgroups": ("tiny", "fp32", {"optimizer": FUSED_ADAM,
                                                         "zero_optimization": {"stage": 3, "sub_group_size": 100}},
                                        None),
    "stage3_bf16_cpuadam_offload": ("tiny", "bf16", {"optimizer": FUSED_ADAM, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}}}, None),
    "stage3_fp32_cpuadagrad_offload": ("tiny", "fp32", {"optimizer": ADAGRAD, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}}}, None),
    # PEFT-style: frozen base, LoRA's A matrices with rows that divide by 2 (written from crew's own shard), an
    # empty no-decay group
    "stage3_fp32_lora_fusedadam": ("lora", "fp32", {"optimizer": FUSED_ADAM}, None),
    "stage3_fp32_tied_frozen_empty_group": ("tied", "fp32", {"optimizer": FUSED_ADAM, "zero_optimization": {
        "stage": 3, "sub_group_size": 40}}, "with_empty"),
}


# -- the cases (both venvs) ---------------------------------------------------------------------------

def _tied_model():
    import torch

    class TiedFrozen(torch.nn.Module):
        """An embedding tied to the output layer, a frozen layer, sizes that do not divide by 2."""

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 7)
            self.frozen = torch.nn.Linear(7, 5)
            self.frozen.requires_grad_(False)
            self.mid = torch.nn.Linear(5, 7)
            self.out = torch.nn.Linear(7, 11, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(torch.relu(self.mid(self.frozen(self.embed(ids)))))

    return TiedFrozen()


def case_model(name: str, seed: int):
    import torch
    kind, _, _, grouping = CASES[name]
    if kind == "lora":
        model = made.build_lora_model(seed)
        return model, made.lora_groups(model)
    if kind == "tiny":
        model = made.build_model(seed)
    else:
        torch.manual_seed(0)  # the frozen layer as pretrained: the same in every run
        model = _tied_model()
        torch.manual_seed(seed)
        for param in (model.embed.weight, model.mid.weight, model.mid.bias):
            torch.nn.init.normal_(param, std=0.3)
    if grouping == "weights_biases":
        return model, made.param_groups(model)
    if grouping == "with_empty":  # Transformers' Trainer's groups for a model without biases or norms to train
        trainable = [param for param in model.parameters() if param.requires_grad]
        return model, [{"params": trainable, "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}]
    return model, model.parameters()


def case_config(name: str) -> dict:
    kind, precision, changes, _ = CASES[name]
    config = {**made.config(3, precision, {}), **changes}
    if kind == "tied":
        config.update(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    return config


def micro_loss(name: str, engine, step: int, micro_step: int, rank: int, world: int):
    import torch
    kind, precision, _, _ = CASES[name]
    if kind in ("tiny", "lora"):
        inputs, targets = made.batch(step, micro_step, rank, world)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        return made.loss_of(engine(inputs.to(dtype)), targets)
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro_step + rank)
    ids = torch.randint(0, 11, (2, 5), generator=generator)
    logits = engine(ids[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), ids[:, 1:].reshape(-1))


def train(name: str, engine, steps: range, all_reduce) -> list[float]:
    """Every micro step's loss, averaged over the ranks."""
    import torch
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in steps:
        for micro_step in range(engine.gradient_accumulation_steps()):
            loss = micro_loss(name, engine, step, micro_step, rank, world)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            all_reduce(mean)
            losses.append(mean.item() / world)
    return losses


# -- crew's side (crew's venv, under its torchrun) ---------------------------------------------------------

def crew_phase(out: Path, only: list[str], use_save_checkpoint: bool) -> None:
    import torch

    import crew
    rank = int(os.environ["RANK"])
    for name in only:
        model, params = case_model(name, seed=0)
        engine, _, _, _ = crew.initialize(model=model, model_parameters=params, config=case_config(name))
        train(name, engine, range(K_STEPS), torch.distributed.all_reduce)
        folder = out / name
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        torch.distributed.barrier()
        weights = {key: param.full_tensor().detach().clone() for key, param in engine.module.named_parameters()}
        if use_save_checkpoint:
            engine.save_checkpoint(str(folder), client_state={"epoch": 1})
        else:
            _write_tag(engine, folder, f"global_step{engine.global_steps}", client_state={"epoch": 1})
        losses = train(name, engine, range(K_STEPS, K_STEPS + M_STEPS), torch.distributed.all_reduce)
        if rank == 0:
            torch.save(weights, folder / "crew_fp32.pt")
            (folder / "crew.json").write_text(json.dumps({"losses": losses, "lr": engine.get_lr()[0]}))
        torch.distributed.barrier()


def _write_tag(engine, folder: Path, tag: str, client_state: dict) -> None:
    """The files DeepSpeed's save_checkpoint writes at stage 3, with torch.save: the stage-3 dicts, the keys
    common to every stage (engine.py _common_checkpoint_state)."""
    import copy

    import torch

    from crew.runtime.checkpoint.deepspeed_writing import DEEPSPEED_PICKLE  # the stand-ins as DeepSpeed's classes
    from crew.runtime.checkpoint.deepspeed_zero3 import zero3_model_states, zero3_optim_states
    rank = engine.global_rank
    model = zero3_model_states(engine, exclude_frozen=False)
    optim = zero3_optim_states(engine)
    common = {"optimizer": None, "lr_scheduler": engine.lr_scheduler.state_dict(), "data_sampler": None,
              "random_ltd": None, "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
              "global_samples": engine.global_samples, "dp_world_size": engine.world_size, "mp_world_size": 1,
              "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
              "ds_config": copy.deepcopy(engine.crew_config.raw), "ds_version": "0.19.8"}
    order = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", *[key for key in common if key != "optimizer"]]
    states = {key: {**model, **common}[key] for key in order}
    states.update(client_state)
    (folder / tag).mkdir(exist_ok=True)
    bf16 = engine.precision.sharded_compute_dtype is torch.bfloat16
    torch.save(states, folder / tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    torch.save(optim, folder / tag / f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
               pickle_module=DEEPSPEED_PICKLE)
    torch.distributed.barrier()
    if rank == 0:
        (folder / "latest").write_text(tag)


# -- DeepSpeed's side (its venv, under its torchrun) -------------------------------------------------------

def deepspeed_phase(out: Path, only: list[str]) -> None:
    import deepspeed
    import deepspeed.comm as dist
    for name in only:
        model, params = case_model(name, seed=99)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=case_config(name))
        path, client = engine.load_checkpoint(str(out / name))
        after_load = {"global_steps": engine.global_steps, "lr": engine.get_lr()[0], "epoch": client.get("epoch")}
        losses = train(name, engine, range(K_STEPS, K_STEPS + M_STEPS), dist.all_reduce)
        if dist.get_rank() == 0:
            (out / name / "deepspeed.json").write_text(json.dumps(
                {"path": path, "after_load": after_load, "losses": losses, "lr": engine.get_lr()[0],
                 "optimizer": type(engine.optimizer.optimizer).__name__}))
        dist.barrier()


# -- the run -------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsvenv", type=Path, default=Path("/opt/dsvenv"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/ds_zero3_check"))
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--phase", choices=["crew", "deepspeed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = args.only.split(",")
    if args.phase == "crew":
        crew_phase(args.out, only, not args.plain)
        return
    if args.phase == "deepspeed":
        __import__("deepspeed").init_distributed(dist_backend="gloo")
        deepspeed_phase(args.out, only)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--standalone", "--nproc_per_node", "2", str(HERE), "--out", str(args.out), "--only", args.only]
    extra = ["--plain"] if args.plain else []
    subprocess.run([str(Path(sys.executable).parent / "torchrun"), *common, "--phase", "crew", *extra],
                   env={**env, "PYTHONPATH": str(REPO)}, check=True)
    subprocess.run([str(args.dsvenv / "bin" / "torchrun"), *common, "--phase", "deepspeed"],
                   env={**env, "DS_ACCELERATOR": "cpu"}, check=True)
    report(args, only, env)


def report(args, only: list[str], env: dict) -> None:
    import torch
    print(f"{'case':38} {'DeepSpeed opt':16} {'max |Δloss|':>12} {'zero_to_fp32 Δ':>15}  result")
    failed = []
    for name in only:
        folder = args.out / name
        ours, theirs = (json.loads((folder / f"{who}.json").read_text()) for who in ("crew", "deepspeed"))
        loss_diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        script = _deepspeed_zero_to_fp32(args.dsvenv, folder, env)
        converted = torch.load(folder / "fp32" / "pytorch_model.bin", weights_only=True)
        weights = torch.load(folder / "crew_fp32.pt", weights_only=True)
        weight_diff = max((converted[key].float() - value).abs().max().item() for key, value in weights.items())
        tied = all(torch.equal(converted[key], converted[value]) for key, value in _tied(name).items())
        ok = (loss_diff <= TOLERANCE[CASES[name][1]] and weight_diff == 0 and tied and script == 0
              and abs(ours["lr"] - theirs["lr"]) < 1e-12 and theirs["after_load"]["epoch"] == 1)
        failed += [] if ok else [name]
        print(f"{name:38} {theirs['optimizer']:16} {loss_diff:12.2e} {weight_diff:15.2e}  {'ok' if ok else 'FAILED'}")
        for who, losses in (("crew", ours["losses"]), ("DeepSpeed", theirs["losses"])):
            print(f"    {who:10}{[round(loss, 7) for loss in losses]}")
    sys.exit(1 if failed else 0)


def _tied(name: str) -> dict[str, str]:
    return {"out.weight": "embed.weight"} if CASES[name][0] == "tied" else {}


def _deepspeed_zero_to_fp32(dsvenv: Path, folder: Path, env: dict) -> int:
    """Run DeepSpeed's own zero_to_fp32.py, copied beside the tag as DeepSpeed's save_checkpoint copies it."""
    find = "import deepspeed, pathlib; print(pathlib.Path(deepspeed.__file__).parent / 'utils' / 'zero_to_fp32.py')"
    source = subprocess.run([str(dsvenv / "bin" / "python"), "-c", find], capture_output=True, text=True,
                            env={**env, "DS_ACCELERATOR": "cpu"}, check=True).stdout.strip()
    shutil.copy(source, folder / "zero_to_fp32.py")
    shutil.rmtree(folder / "fp32", ignore_errors=True)
    done = subprocess.run([str(dsvenv / "bin" / "python"), str(folder / "zero_to_fp32.py"), str(folder),
                           str(folder / "fp32")], capture_output=True, text=True, env={**env, "DS_ACCELERATOR": "cpu"})
    if done.returncode:
        print(done.stdout[-2000:], done.stderr[-2000:])
    return done.returncode


if __name__ == "__main__":
    main()
