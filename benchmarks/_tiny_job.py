"""The tiny 2-rank job that benchmarks/launch.py starts with crew, torchrun and deepspeed.

gloo process group from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which every
launcher sets), a Linear(64, 64) under DDP, a few SGD steps on synthetic data, one all_reduce, then
destroy_process_group. `--local_rank=N` (crew and deepspeed pass it, torchrun does not) is accepted
and ignored.

Rank 0 prints two lines the harness parses:
    BENCH_FIRST_STEP <time.time() right after the first optimizer step>
    BENCH_THREADS <torch.get_num_threads()> OMP_NUM_THREADS=<value or unset>
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    parser.parse_known_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        inputs = torch.randn(32, 64, generator=generator)
        targets = torch.randn(32, 64, generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here, so every rank is at this step
        optimizer.step()
        if step == 0 and rank == 0:
            print(f"BENCH_FIRST_STEP {time.time():.6f}", flush=True)
            print(f"BENCH_THREADS {torch.get_num_threads()} "
                  f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        print(f"BENCH_DONE loss_sum={total.item():.4f}", flush=True)
    # Tear down in order. Without this, about 1 run in 30 (seen under torchrun) had a rank abort
    # after BENCH_DONE with "terminate called without an active exception", likely gloo state kept
    # alive past destroy_process_group (DDP's reducer holds the group) and freed at interpreter
    # shutdown. The barrier keeps one rank from closing connections the other still uses.
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
