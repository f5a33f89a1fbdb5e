"""Steady-state training step time: crew's engine vs plain torch DDP (vs DeepSpeed when installed).

Each mode trains the same MLP (~17M parameters) on the same synthetic batches on 2 CPU ranks
(gloo), with AdamW, gradient clipping 1.0 and no accumulation, and times every optimizer step on
rank 0. crew's engine and plain DDP run in the same job, each rank alternating one crew step and one
DDP step on two copies of the model: a 2-core machine drifts by 10% from run to run, and
alternating makes the drift hit both alike. DeepSpeed (when installed) runs in a job of its own.
The table pools steps 20-120 (warm-up excluded) of --repeat jobs: median and ratio to plain DDP.

    .venv/bin/python benchmarks/step.py             # 3 runs x 120 steps per mode
    .venv/bin/python benchmarks/step.py --steps 60  # quicker, median over steps 20-60
    .venv/bin/python benchmarks/step.py --monitors  # crew with csv_monitor + tensorboard on vs off

With --monitors, the crew job alternates three steppers: plain DDP, crew, and crew with the
csv_monitor and tensorboard sections enabled ("monitored"), both crew engines at steps_per_print 10.
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


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}


def engine_step(module_name: str, **extra):
    """One training step through crew's (or DeepSpeed's) engine; joins the process group."""
    import torch

    deepspeed = importlib.import_module(module_name)
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config={**ds_config(), **extra})

    def step(inputs, targets):
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    step.engine = engine
    return step


def timed_monitor(monitor) -> list[float]:
    """Wrap the monitor's record and flush: the seconds spent in them, appended to the list returned."""
    spent: list[float] = []
    for name in ("record", "flush"):
        method = getattr(monitor, name)

        def timed(*args, method=method):
            started = time.perf_counter()
            method(*args)
            spent.append(time.perf_counter() - started)
        setattr(monitor, name, timed)
    return spent


def ddp_step():
    """The same step in plain torch: DDP, clip_grad_norm_, AdamW, zero_grad."""
    from _ddp_baseline import ddp_stepper

    return ddp_stepper(make_model(), LR, CLIP)[0]


def timed_steps(steppers: dict, steps: int) -> dict[str, list[float]]:
    """Alternate the steppers step by step, so that machine drift hits each of them alike, and rotate
    which one goes first, so that none always runs right after the batch is made."""
    times: dict[str, list[float]] = {name: [] for name in steppers}
    order = list(steppers.items())
    for index, (inputs, targets) in enumerate(batches(int(os.environ.get("RANK", 0)), steps)):
        shift = index % len(order)
        for name, step in order[shift:] + order[:shift]:
            started = time.perf_counter()
            step(inputs, targets)
            times[name].append(time.perf_counter() - started)
    return times


def worker(mode: str, steps: int, out: str) -> None:
    if mode == "crew":  # crew's engine and plain DDP side by side in one job
        crew = engine_step("crew")  # first: it joins the process group that DDP then uses
        times = timed_steps({"ddp": ddp_step(), "crew": crew}, steps)
    elif mode == "monitors":
        folder = tempfile.mkdtemp(prefix="crew-monitors-")
        monitors = {key: {"enabled": True, "output_path": folder} for key in ("csv_monitor", "tensorboard")}
        crew = engine_step("crew", steps_per_print=10)
        monitored = engine_step("crew", steps_per_print=10, **monitors)
        spent = timed_monitor(monitored.engine.monitor)
        times = timed_steps({"ddp": ddp_step(), "crew": crew, "monitored": monitored}, steps)
        times["monitor calls"] = [sum(spent) / steps]  # seconds per step in record + flush (rank 0)
    else:
        times = timed_steps({mode: engine_step(mode)}, steps)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out).write_text(json.dumps(times))


def launch(mode: str, steps: int) -> dict[str, list[float]] | str:
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
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode, alternating modes")
    parser.add_argument("--monitors", action="store_true", help="crew with monitors on vs off")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out)
    jobs = ["crew"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    modes = ["ddp", *jobs]
    if args.monitors:
        jobs, modes = ["monitors"], ["ddp", "crew", "monitored"]
    runs: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    failures: dict[str, str] = {}
    monitor_calls: list[float] = []
    for _ in range(args.repeat):
        for job in jobs:
            result = launch(job, args.steps)
            if isinstance(result, str):
                failures[job] = result
                continue
            monitor_calls += result.pop("monitor calls", [])
            for mode, times in result.items():
                runs[mode].append(times[FIRST_TIMED_STEP:])
    print_table(runs, failures, args, monitor_calls)


def print_table(runs: dict[str, list[list[float]]], failures: dict[str, str], args,
                monitor_calls: list[float]) -> None:
    from _ddp_baseline import step_time_table

    print(f"model: {DEPTH} x Linear({WIDTH}, {WIDTH}) + head, micro batch {MICRO_BATCH}, "
          f"2 CPU ranks (gloo), AdamW, clip {CLIP}; steps {FIRST_TIMED_STEP}-{args.steps} of "
          f"{args.repeat} run(s) per mode")
    medians = step_time_table(runs, failures)
    if "deepspeed" not in runs:
        print(f"{'deepspeed':<11} | not installed")
    if "crew" in medians and "ddp" in medians:
        print(f"crew / DDP step time: {medians['crew'] / medians['ddp']:.3f} (target <= 1.05)")
    if "monitored" in medians and "crew" in medians:
        print(f"crew with monitors / without: {medians['monitored'] / medians['crew']:.4f} (target <= 1.01)")
    if monitor_calls:
        per_step = statistics.median(monitor_calls)
        print(f"monitor record + flush on rank 0: {per_step * 1e3:.3f} ms per step "
              f"({per_step / medians['crew']:.2%} of a crew step)")


if __name__ == "__main__":
    main()
