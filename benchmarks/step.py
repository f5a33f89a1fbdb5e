"""Steady-state training step time: crew's engine vs plain torch DDP (vs DeepSpeed when installed).

Each mode trains the same MLP (~17M parameters, ~100 ms a step here) on the same synthetic batches
on 2 CPU ranks (gloo), with AdamW, gradient clipping 1.0 and no accumulation, and times every
optimizer step on rank 0. The table shows the median over steps 20-120 (warm-up excluded) and the
ratio to plain DDP. Each mode runs in its own `crew run` job, so the launcher is the same for all.

    .venv/bin/python benchmarks/step.py             # 120 steps per mode
    .venv/bin/python benchmarks/step.py --steps 60  # quicker, median over steps 20-60
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH, DEPTH, MICRO_BATCH, LR, CLIP = 2048, 4, 32, 1e-3, 1.0
FIRST_TIMED_STEP = 20


def make_model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def batches(rank: int, steps: int):
    import torch

    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        inputs = torch.randn(MICRO_BATCH, WIDTH, generator=generator)
        yield inputs, inputs.mean(dim=1, keepdim=True)


def run_plain_ddp(steps: int) -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    times = []
    for inputs, targets in batches(dist.get_rank(), steps):
        started = time.perf_counter()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return times


def run_engine(module_name: str, steps: int) -> list[float]:
    import torch

    deepspeed = importlib.import_module(module_name)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    times = []
    for inputs, targets in batches(engine.global_rank, steps):
        started = time.perf_counter()
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def worker(mode: str, steps: int, out: str) -> None:
    times = run_plain_ddp(steps) if mode == "ddp" else run_engine(mode, steps)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out).write_text(json.dumps(times))


def launch(mode: str, steps: int) -> list[float] | str:
    crew = Path(sys.executable).parent / "crew"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "times.json"
        proc = subprocess.run(
            [str(crew), "run", "--num_gpus", "2", __file__, "--worker", mode, "--steps", str(steps),
             "--out", str(out)], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out)
    modes = ["ddp", "crew"]
    if importlib.util.find_spec("deepspeed"):
        modes.append("deepspeed")
    medians: dict[str, float] = {}
    print(f"model: {DEPTH} x Linear({WIDTH}, {WIDTH}) + head, micro batch {MICRO_BATCH}, "
          f"2 CPU ranks (gloo), AdamW, clip {CLIP}; median of steps {FIRST_TIMED_STEP}-{args.steps}")
    print(f"{'mode':<10} | {'median ms':>9} | {'min ms':>7} | {'vs DDP':>7}")
    print("-" * 10 + "-+-" + "-" * 9 + "-+-" + "-" * 7 + "-+-" + "-" * 7)
    for mode in modes:
        times = launch(mode, args.steps)
        if isinstance(times, str):
            print(f"{mode:<10} | {times}")
            continue
        steady = times[FIRST_TIMED_STEP:]
        medians[mode] = statistics.median(steady)
        ratio = medians[mode] / medians["ddp"] if "ddp" in medians else float("nan")
        print(f"{mode:<10} | {medians[mode] * 1e3:9.1f} | {min(steady) * 1e3:7.1f} | {ratio:7.3f}")
    if "deepspeed" not in modes:
        print(f"{'deepspeed':<10} | not installed")
    if "crew" in medians and "ddp" in medians:
        print(f"crew / DDP step time: {medians['crew'] / medians['ddp']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
