"""Throughput on two unequal ranks: an even split vs micro batches set by hand vs crew's "auto".

Two CPU ranks (gloo, one thread each) train the same MLP on the same synthetic data, a map-style
TensorDataset passed as initialize(training_data=...) so that crew's loader splits every global
batch of 48. Rank 1 is made 3x slower: both ranks do the same real compute per sample, and rank 1
also sleeps, in forward, twice that compute time per sample. The compute time is calibrated once,
before the jobs, in this process on one thread as each rank has: the median of 15 forward+backward
passes of the MLP over a micro batch of 24, per sample. Every job gets that one figure, so every
mode runs against the same slowdown; calibrated in each job instead (on rank 0, 7 passes), it
spread by 30% and more over the jobs of one run on a quiet machine (e.g. 1.46-1.92 ms), and the
modes' throughput with it.
Each sample is 32 vectors of 512, so even a micro batch of 8 is a 256-row matmul and one thread's
cost per sample stays within about 20% from 8 to 48 samples (with one vector per sample it is 2-3x
higher at 8 than at 48, and the 3:1 ratio would hold only at the calibrated size); and the 1536 rows
of a step outweigh its fixed costs (all-reduce, AdamW), which would otherwise cap every speed-up.

Modes, each a `crew run --num_gpus 2` job of its own, AdamW, gradient clipping 1.0, no accumulation:
  ddp        plain torch DDP (benchmarks/_ddp_baseline.py), 24 + 24 from torch's DistributedSampler
  even       crew, train_micro_batch_size_per_gpu 24 (DeepSpeed's config and split)
  30/18 ...  crew, train_micro_batch_size_per_rank set by hand ([36, 12] is ideal for 3:1 speeds)
  auto       crew, train_micro_batch_size_per_rank "auto": starts at 24/24, re-balances at step 5
  deepspeed  DeepSpeed's engine, 24 + 24, when installed (it has no unequal split)
Throughput = samples / second over steps 11..N (wall time on rank 0; every step ends in an
all-reduce, so rank 0's clock is the job's), which leaves out auto's first two decisions (after
steps 5 and 10; a later move, every 4 steps, falls in the window): auto is also shown over steps
2..N, balancing included, with the log line of every move it made. Per mode: the median of
--repeat jobs, the order of the modes rotating from round to round. Another process busy on the
same cores skews the figures: run alone.

    .venv/bin/python benchmarks/hetero.py               # 3 runs x 40 steps per mode, ~2.5 minutes
    .venv/bin/python benchmarks/hetero.py --quick       # 1 run x 20 steps per mode, ~40 seconds
    .venv/bin/python benchmarks/hetero.py --repeat 5    # more runs against drift
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

WIDTH, DEPTH, SEQ, GLOBAL_BATCH, LR, CLIP = 512, 4, 32, 48, 1e-3, 1.0
SLOWDOWN = 3            # rank 1's time per sample, in units of the compute both ranks do
CALIBRATION_PASSES = 15
FIRST_TIMED_STEP = 11   # auto decides after step 5, again after step 10, then every 4 steps
HAND_SET = ([30, 18], [36, 12], [40, 8])
EVEN = f"{GLOBAL_BATCH // 2}/{GLOBAL_BATCH // 2}"
MODES = ["ddp", "even", *(f"{a}/{b}" for a, b in HAND_SET), "auto"]
ROWS = {"ddp": "torch DDP", "even": "crew even", "auto": "crew auto", "deepspeed": "deepspeed"}


# -- the job: model, data, mode --------------------------------------------------------------------

class Slowed(torch.nn.Module):
    """The MLP, and `delay` seconds of sleep per sample before it in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = make_mlp()
        self.delay = 0.0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay * len(inputs))
        return self.mlp(inputs)


def make_mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def make_dataset(samples: int) -> torch.utils.data.TensorDataset:
    inputs = torch.randn(samples, SEQ, WIDTH, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(inputs, inputs.mean(dim=-1, keepdim=True))


def ds_config(mode: str) -> dict:
    config = {"gradient_accumulation_steps": 1, "gradient_clipping": CLIP, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    if mode in ("even", "deepspeed"):
        config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // 2
    elif mode == "auto":
        config.update(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_rank="auto")
    else:
        config["train_micro_batch_size_per_rank"] = [int(size) for size in mode.split("/")]
    return config


def build(mode: str, model: Slowed, dataset):
    """(step(inputs, targets), this rank's loader, its current micro batch); joins the process group."""
    if mode == "ddp":
        return build_ddp(model, dataset)
    deepspeed = importlib.import_module("deepspeed" if mode == "deepspeed" else "crew")
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=ds_config(mode), training_data=dataset)

    def step(inputs, targets):
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    return step, loader, engine.train_micro_batch_size_per_gpu


def build_ddp(model: Slowed, dataset):
    """Plain torch: each rank takes its 24 of every 48 samples with DistributedSampler."""
    from _ddp_baseline import ddp_stepper

    dist.init_process_group("gloo")
    sampler = torch.utils.data.DistributedSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH // 2, sampler=sampler)
    return ddp_stepper(model, LR, CLIP)[0], loader, lambda: GLOBAL_BATCH // 2


# -- the worker (one process per rank, under `crew run`) ------------------------------------------

def clock_steps(step, loader, steps: int) -> list[float]:
    """perf_counter before the first step and after each one."""
    clock = [time.perf_counter()]
    for inputs, targets in itertools.islice(loader, steps):
        step(inputs, targets)
        clock.append(time.perf_counter())
    return clock


def worker(mode: str, steps: int, per_sample: float, out: str) -> None:
    torch.set_num_threads(1)  # what `crew run` gives each of 2 ranks on 2 cores, and what calibrate() times
    model = Slowed()
    step, loader, micro_batch = build(mode, model, make_dataset(GLOBAL_BATCH * steps))
    if dist.get_rank() == 1:
        model.delay = (SLOWDOWN - 1) * per_sample
    clock = clock_steps(step, loader, steps)
    shares = [0, 0]
    dist.all_gather_object(shares, micro_batch())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"clock": clock, "shares": shares, "threads": torch.get_num_threads()}))


# -- the harness -----------------------------------------------------------------------------------

def calibrate() -> float:
    """Seconds of forward+backward per sample of the MLP on one thread: the median of the passes."""
    torch.set_num_threads(1)
    mlp = make_mlp()
    inputs = torch.randn(GLOBAL_BATCH // 2, SEQ, WIDTH)
    targets = inputs.mean(dim=-1, keepdim=True)
    times = []
    for _ in range(CALIBRATION_PASSES):
        started = time.perf_counter()
        torch.nn.functional.mse_loss(mlp(inputs), targets).backward()
        times.append((time.perf_counter() - started) / len(inputs))
    return statistics.median(times)


def launch(mode: str, steps: int, per_sample: float) -> dict | str:
    """One 2-rank job: rank 0's figures and crew's balance log lines, or why it failed."""
    crew = Path(sys.executable).parent / "crew"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        proc = subprocess.run(
            [str(crew), "run", "--num_gpus", "2", __file__, "--worker", mode, "--steps", str(steps),
             "--per_sample", repr(per_sample), "--out", str(out)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
        result = json.loads(out.read_text())
    result["log"] = re.findall(r"\[crew\] (auto balance.*)", proc.stdout)
    return result


def run_all(modes: list[str], per_sample: float, args) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """--repeat rounds of one job per mode, the order rotating; {mode: runs}, {mode: failure}."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    failures: dict[str, str] = {}
    for round_ in range(args.repeat):
        shift = round_ % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            result = launch(mode, args.steps, per_sample)
            if isinstance(result, str):
                failures[mode] = result
            else:
                runs[mode].append(result)
    return runs, failures


def throughput(clock: list[float], first_step: int) -> float:
    """Samples per second over steps first_step..N (clock[i]: the end of step i)."""
    return GLOBAL_BATCH * (len(clock) - first_step) / (clock[-1] - clock[first_step - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per job (default 40)")
    parser.add_argument("--repeat", type=int, default=3, help="jobs per mode, the order rotating (default 3)")
    parser.add_argument("--quick", action="store_true", help="--steps 20 --repeat 1")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--per_sample", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeat = 20, 1
    if args.steps <= FIRST_TIMED_STEP:
        parser.error(f"--steps must be more than {FIRST_TIMED_STEP}: steps {FIRST_TIMED_STEP}..N are timed")
    if args.worker:
        return worker(args.worker, args.steps, args.per_sample, args.out)
    started = time.perf_counter()
    per_sample = calibrate()
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    runs, failures = run_all(MODES + (["deepspeed"] if has_deepspeed else []), per_sample, args)
    report(runs, failures, has_deepspeed, per_sample, args, time.perf_counter() - started)


# -- the table -------------------------------------------------------------------------------------

def header(runs: dict[str, list[dict]], per_sample: float, args) -> None:
    threads = sorted({run["threads"] for mode_runs in runs.values() for run in mode_runs})
    print(f"model: {DEPTH} x (Linear({WIDTH}, {WIDTH}), GELU) + Linear({WIDTH}, 1), each sample {SEQ} x {WIDTH}; "
          f"global batch {GLOBAL_BATCH}, AdamW, clip {CLIP}; 2 CPU ranks (gloo), torch threads per rank {threads}")
    print(f"calibrated forward+backward: {per_sample * 1e3:.2f} ms/sample (1 thread); rank 1 sleeps "
          f"{SLOWDOWN - 1}x that per sample ({SLOWDOWN}x slower)")
    print(f"throughput: samples/s over steps {FIRST_TIMED_STEP}-{args.steps}, median of {args.repeat} "
          "run(s) per mode")


def shares_of(mode: str, mode_runs: list[dict]) -> str:
    if mode in ("ddp", "even", "deepspeed"):
        return EVEN
    if mode != "auto":
        return mode
    ended = sorted({"/".join(map(str, run["shares"])) for run in mode_runs})
    return ", ".join(ended)


def row(label: str, shares: str, runs: list[float], even: float | None) -> None:
    median = statistics.median(runs)
    ratio = f"{median / even:7.2f}" if even else f"{'-':>7}"
    per_run = ", ".join(f"{value:.0f}" for value in runs)
    print(f"{label:<28} | {shares:<12} | {median:9.0f} | {ratio} | {per_run}")


def table(runs: dict[str, list[dict]], failures: dict[str, str], has_deepspeed: bool, args) -> dict[str, float]:
    """Prints one row per mode; returns {mode: median samples/s}."""
    speeds = {mode: [throughput(run["clock"], FIRST_TIMED_STEP) for run in mode_runs]
              for mode, mode_runs in runs.items() if mode_runs}
    medians = {mode: statistics.median(values) for mode, values in speeds.items()}
    even = medians.get("even")
    print(f"{'mode':<28} | {'shares':<12} | {'samples/s':>9} | {'vs even':>7} | per run")
    print("-" * 29 + "+" + "-" * 14 + "+" + "-" * 11 + "+" + "-" * 9 + "+" + "-" * 20)
    for mode, mode_runs in runs.items():
        label = ROWS.get(mode, "crew hand-set")
        if mode not in speeds:
            print(f"{label:<28} | {failures.get(mode, 'no run')}")
            continue
        row(label, shares_of(mode, mode_runs), speeds[mode], even)
        if mode == "auto":
            whole = [throughput(run["clock"], 2) for run in mode_runs]
            row(f"crew auto, steps 2-{args.steps}", f"from {EVEN}", whole, even)
    if not has_deepspeed:
        print(f"{'deepspeed':<28} | not installed")
    return medians


def report(runs: dict[str, list[dict]], failures: dict[str, str], has_deepspeed: bool, per_sample: float, args,
           wall_s: float) -> None:
    header(runs, per_sample, args)
    medians = table(runs, failures, has_deepspeed, args)
    for number, run in enumerate(runs["auto"], 1):
        for line in run["log"]:
            print(f"  auto run {number}: {line}")
    print(f"benchmark wall time: {wall_s:.0f} s")
    hand_set = {mode: medians[mode] for mode in MODES if "/" in mode and mode in medians}
    if "auto" not in medians or "even" not in medians or not hand_set:
        print("auto/even throughput ratio: not measured (a job failed)")
        return
    best = max(hand_set, key=hand_set.get)
    to_best, to_even = medians["auto"] / hand_set[best], medians["auto"] / medians["even"]
    print(f"auto/best hand-set ({best}): {to_best:.2f} (target >= 0.90): {'PASS' if to_best >= 0.9 else 'FAIL'}")
    print(f"auto/even target >= 1.40: {'PASS' if to_even >= 1.4 else 'FAIL'}")
    print(f"auto/even throughput ratio: {to_even:.2f}")


if __name__ == "__main__":
    main()
