"""A small regression model on synthetic data, trained data-parallel on every rank crew starts.

    crew run --num_gpus 2 examples/train.py --deepspeed --deepspeed_config examples/ds_config.json

It takes DeepSpeed's script arguments (--local_rank, --deepspeed, --deepspeed_config) and reads the
batch and optimizer settings from the DeepSpeed JSON. Until crew's engine lands it trains with plain
torch.distributed (DistributedDataParallel over gloo on CPU, NCCL on GPU).
"""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--deepspeed_config", default="examples/ds_config.json")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--fail_at_step", type=int, default=-1, help="raise at this step (demo)")
    return parser.parse_args()


def synthetic_batch(generator: torch.Generator, size: int, weights: torch.Tensor):
    inputs = torch.randn(size, weights.shape[0], generator=generator)
    return inputs, inputs @ weights + 0.01 * torch.randn(size, 1, generator=generator)


def main() -> None:
    args = parse_args()
    config = json.load(open(args.deepspeed_config))
    micro = config.get("train_micro_batch_size_per_gpu", 8)
    accumulation = config.get("gradient_accumulation_steps", 1)
    lr = config.get("optimizer", {}).get("params", {}).get("lr", 1e-3)
    every = config.get("steps_per_print", 10)

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same initial weights on every rank
    true_weights = torch.randn(32, 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(model.to(device), device_ids=[device.index] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    if rank == 0:
        print(f"micro {micro} x accumulation {accumulation} x {world} ranks = "
              f"{micro * accumulation * world} samples per step; {args.steps} steps", flush=True)

    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step == args.fail_at_step:
            raise RuntimeError(f"failing on purpose at step {step} (--fail_at_step)")
        for micro_step in range(accumulation):
            inputs, targets = synthetic_batch(generator, micro, true_weights)
            last = micro_step == accumulation - 1
            with contextlib.nullcontext() if last else model.no_sync():  # sync once per step
                loss = torch.nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
                (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.get("gradient_clipping", 1.0))
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and step % every == 0:
            rate = step * micro * accumulation * world / (time.perf_counter() - started)
            print(f"step {step}: loss {loss.item():.4f}, {rate:.0f} samples/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
