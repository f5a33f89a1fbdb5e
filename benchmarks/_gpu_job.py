"""The job benchmarks/gpu_check.py runs, written against DeepSpeed's API so that the same file runs under
`crew run --as_deepspeed` and under DeepSpeed's own launcher. Rank 0 prints one line `GPUCHECK {json}`.

    --mode allreduce   all-reduce bus bandwidth at --sizes MB (as nccl-tests: algbw x 2(n-1)/n)
    --mode train       an MLP at --precision and --stage for --steps steps: the losses (the global batch's
                       mean), the median step time of the second half, each rank's peak device memory, and
                       what --feature checks: cpu_checkpointing (activation checkpoints kept on the CPU),
                       offload_optimizer (stage 1-2), offload_param (stage 3), pinned_loader (the engine's
                       loader gives page-locked batches)
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--mode", choices=("allreduce", "train"), default="train")
parser.add_argument("--sizes", default="1,16,256")
parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
parser.add_argument("--stage", type=int, default=0)
parser.add_argument("--feature", default="none",
                    choices=("none", "cpu_checkpointing", "offload_optimizer", "offload_param", "pinned_loader"))
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--layers", type=int, default=6)
args = parser.parse_args()

deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
    torch.device("cpu")


def say(result: dict) -> None:
    if rank == 0:
        print("GPUCHECK " + json.dumps(result), flush=True)


def synchronize() -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def allreduce() -> None:
    rows = []
    for megabytes in (float(size) for size in args.sizes.split(",")):
        tensor = torch.ones(int(megabytes * 2**20 / 4), device=device)
        for _ in range(3):
            dist.all_reduce(tensor)
        synchronize()
        started, repeats = time.perf_counter(), 10
        for _ in range(repeats):
            dist.all_reduce(tensor)
        synchronize()
        seconds = (time.perf_counter() - started) / repeats
        algbw = tensor.numel() * 4 / seconds / 1e9
        rows.append({"mb": megabytes, "ms": seconds * 1e3, "busbw_gbs": algbw * 2 * (world - 1) / world})
    say({"mode": "allreduce", "world": world, "rows": rows})


class Block(torch.nn.Module):
    def __init__(self, width: int, checkpointed: bool):
        super().__init__()
        self.linear, self.checkpointed = torch.nn.Linear(width, width), checkpointed

    def forward(self, x):
        if self.checkpointed:
            return deepspeed.checkpointing.checkpoint(lambda h: torch.tanh(self.linear(h)), x)
        return torch.tanh(self.linear(x))


def config() -> dict:
    zero: dict = {"stage": args.stage}
    if args.feature == "offload_optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if args.feature == "offload_param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    section = {"fp16": {"enabled": args.precision == "fp16", "initial_scale_power": 8},
               "bf16": {"enabled": args.precision == "bf16"}}
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero, **section}


def train() -> None:
    torch.manual_seed(0)
    checkpointed = args.feature == "cpu_checkpointing"
    if checkpointed:
        deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    model = torch.nn.Sequential(*[Block(args.width, checkpointed) for _ in range(args.layers)],
                                torch.nn.Linear(args.width, 1))
    data = [(x, x[:16].sum().reshape(1) / 4) for x in torch.randn(8 * world * args.steps, args.width)]
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(),
                                                training_data=data)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    losses, times, pinned = [], [], []
    for x, y in loader:
        pinned.append(x.is_pinned() if device.type == "cuda" else None)
        synchronize()
        started = time.perf_counter()
        x, y = x.to(device, dtype), y.to(device, dtype)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        synchronize()
        times.append(time.perf_counter() - started)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0],
                        device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    say({"mode": "train", "precision": args.precision, "stage": args.stage, "feature": args.feature,
         "world": world, "device": device.type, "losses": losses,
         "step_ms": statistics.median(times[len(times) // 2:]) * 1e3, "peak_mib": [p.item() for p in peaks],
         "pinned": pinned[-1] if pinned else None, "params": sum(p.numel() for p in model.parameters())})


allreduce() if args.mode == "allreduce" else train()
