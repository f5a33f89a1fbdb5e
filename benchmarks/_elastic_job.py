"""The job benchmarks/elastic.py loses a node under: plain torch DDP (gloo), an MLP of --width, one checkpoint
after every step (written to a temporary name, then renamed), loaded at the start of every attempt.

The same script runs under `crew run` and torchrun, so that what differs is the launcher. Rank 0 prints
`BENCH_STEP <attempt> <step> <world> <time.time()>` after each step and `BENCH_RESUMED <attempt> <time>`
once the checkpoint is loaded; at step --lose_at of the first attempt it writes `ready` and waits for
`killed` (the harness has then lost a node) before going on, into the collective that fails.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--lose_at", type=int, default=4)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()
attempt = int(os.environ.get("CREW_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                            torch.nn.Linear(args.width, args.width))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
step = 0
if os.path.exists("ckpt.pt"):
    state = torch.load("ckpt.pt", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
ddp = DistributedDataParallel(model)
if rank == 0:
    print(f"BENCH_RESUMED {attempt} {time.time()}", flush=True)
while step < args.steps:
    batch = torch.randn(8, args.width)
    loss = ddp(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, "ckpt.pt.tmp")
        os.replace("ckpt.pt.tmp", "ckpt.pt")
        print(f"BENCH_STEP {attempt} {step} {world} {time.time()}", flush=True)
    dist.barrier()
    if step == args.lose_at and attempt == 0 and rank == 0:
        open("ready", "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists("killed") and time.monotonic() < deadline:
            time.sleep(0.02)
dist.destroy_process_group()
