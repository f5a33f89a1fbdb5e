"""The job benchmarks/zero_numerics.py runs: a DeepSpeed script (deepspeed.initialize with a config dict, AdamW
from the config's optimizer section, a small residual MLP with LayerNorms) that trains on fixed seeded data
towards a fixed teacher and records the loss of every optimizer step, once per configuration.

The same file runs under DeepSpeed (torchrun from DeepSpeed's venv) and under `crew run --as_deepspeed`. One
job runs several configurations one after the other (one start-up for all); each builds its model (seed 0)
and engine, trains --steps optimizer steps of --ga micro steps and drops the engine. The loss of an optimizer
step is the mean of its micro-step losses over the micro steps and the ranks, in fp32. Rank 0 writes
`<out>/<tag>.json`: per configuration the losses, or the error that stopped it (the other configurations
still run where the engine could be dropped).
"""

import argparse
import gc
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import deepspeed  # crew under --as_deepspeed

IN_FEATURES, OUT_FEATURES, TEACHER_HIDDEN, MICRO_BATCH = 32, 8, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Block(torch.nn.Module):
    """Pre-LayerNorm MLP block with a residual: two (width x 4 width) matrices, sharded at stage 3 (> 1e5
    elements); their biases and the LayerNorm stay whole (below stage3_param_persistence_threshold)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_model(width: int, blocks: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, width), *(Block(width) for _ in range(blocks)),
                               torch.nn.LayerNorm(width), torch.nn.Linear(width, OUT_FEATURES))


def make_data(steps: int, ga: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [steps, ga, world, micro, in] and the teacher's targets: the same on every rank and engine."""
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(steps, ga, world, MICRO_BATCH, IN_FEATURES, generator=generator)
    first = torch.randn(IN_FEATURES, TEACHER_HIDDEN, generator=generator) / IN_FEATURES ** 0.5
    second = torch.randn(TEACHER_HIDDEN, OUT_FEATURES, generator=generator) / TEACHER_HIDDEN ** 0.5
    return inputs, torch.tanh(inputs @ first) @ second


def ds_config(run: dict, ga: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": ga,
              "steps_per_print": 10**9, "bf16": {"enabled": run["dtype"] == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": run["stage"], **run.get("zero", {})}}
    if run.get("comm"):
        config["communication_data_type"] = run["comm"]
    if run.get("accum"):
        config["data_types"] = {"grad_accum_dtype": run["accum"]}
    return config


def train(run: dict, args, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
    config, dtype = ds_config(run, args.ga), DTYPES[run["dtype"]]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=run["stage"] == 3 and run.get("zero_init", True)):
        model = make_model(args.width, args.blocks)
    if run.get("bf16_init"):  # the masters DeepSpeed makes: from the model cast to bf16
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    try:
        for step in range(args.steps):
            total = torch.zeros(())
            for micro in range(args.ga):
                output = engine(inputs[step, micro, rank].to(dtype))
                loss = torch.nn.functional.mse_loss(output.float(), targets[step, micro, rank])
                engine.backward(loss)
                engine.step()
                total += loss.detach().float()
            dist.all_reduce(total)
            losses.append(total.item() / (args.ga * world))
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, model
        gc.collect()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--runs", required=True,
                        help="JSON list of {stage, dtype, comm, zero_init, accum, bf16_init, zero}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ga", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    inputs, targets = make_data(args.steps, args.ga, dist.get_world_size())
    params = sum(p.numel() for p in make_model(args.width, args.blocks).parameters())
    results = []
    for run in json.loads(args.runs):
        try:
            results.append({**run, "params": params, "losses": train(run, args, inputs, targets)})
        except Exception as error:  # the table says which configuration failed, and why
            traceback.print_exc()
            results.append({**run, "error": f"{type(error).__name__}: {str(error)[:300]}"})
    if dist.get_rank() == 0:
        (Path(args.out) / f"{args.tag}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
