"""The job benchmarks/hsdp.py runs: crew's engine at ZeRO stage 3 (or --stage 2) on an MLP, with every collective
that spans "nodes" (ranks // --ranks_per_node) delayed as a slow inter-node link would: latency + bytes crossing /
bandwidth.

Bytes a rank sends over the link, per call, for a group of n ranks spread over k nodes (ring algorithms, the
fraction of the ring's hops that cross nodes being k/n): all-gather and reduce-scatter (n-1)/n of the whole
tensor, all-reduce twice that, broadcast and reduce the whole tensor; times k/n. Collectives inside one node cost
nothing extra. Rank 0 prints
`BENCH {"step_s": [...], "cross_bytes": N, "calls": {...}}`.
"""

import argparse
import inspect
import json
import time

import torch
import torch.distributed as dist

import crew

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--stage", type=int, default=3, choices=(2, 3))
parser.add_argument("--group", type=int, default=0, help="mics_shard_size (0: plain stage 3)")
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ranks_per_node", type=int, default=2)
parser.add_argument("--gbit", type=float, default=1.0, help="the simulated inter-node link, Gbit/s")
parser.add_argument("--latency_ms", type=float, default=0.5)
args = parser.parse_args()

crossing = {"bytes": 0, "calls": {}}


def _delay(name: str, tensor: torch.Tensor, group) -> None:
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    nodes = len({rank // args.ranks_per_node for rank in ranks})
    if nodes < 2:
        return
    n = len(ranks)
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1, "reduce": 1}.get(name, (n - 1) / n)
    tensors = tensor if isinstance(tensor, list) else [tensor]
    moved = sum(t.numel() * t.element_size() for t in tensors) * factor * nodes / n
    crossing["bytes"] += moved
    crossing["calls"][name] = crossing["calls"].get(name, 0) + 1
    time.sleep(args.latency_ms / 1000 + moved * 8 / (args.gbit * 1e9))


def _slow(name: str, whole_arg: int):
    call = getattr(dist, name)
    signature = inspect.signature(call)
    whole = list(signature.parameters)[whole_arg]

    def wrapper(*call_args, **kwargs):
        bound = signature.bind(*call_args, **kwargs).arguments
        _delay(name, bound[whole], bound.get("group"))
        return call(*call_args, **kwargs)
    setattr(dist, name, wrapper)


for name in ("all_gather_single", "all_gather_into_tensor", "all_gather"):
    _slow(name, 0)  # the whole (output) tensor
for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
    _slow(name, 1)  # the whole (input) tensor
for name in ("all_reduce", "broadcast", "reduce"):
    _slow(name, 0)

crew.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU())
                              for _ in range(args.layers)])
zero = {"stage": args.stage, **({"mics_shard_size": args.group} if args.group else {})}
config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": zero, "steps_per_print": 1000}
engine, _, _, _ = crew.initialize(model=model, model_parameters=model.parameters(), config=config)
times = []
for step in range(args.steps):
    dist.barrier()
    started = time.perf_counter()
    loss = engine(torch.randn(8, args.width)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    dist.barrier()
    times.append(time.perf_counter() - started)
    if step == 0:
        crossing = {"bytes": 0, "calls": {}}  # count the steady steps' traffic from here
if dist.get_rank() == 0:
    per_step = crossing["bytes"] / (args.steps - 1)
    print("BENCH " + json.dumps({"step_s": times, "cross_bytes": per_step,
                                 "calls": {k: v / (args.steps - 1) for k, v in crossing["calls"].items()},
                                 "params": sum(p.numel() for p in model.parameters())}), flush=True)
