"""Per-rank memory and step time at ZeRO stages 0-3: crew's engine vs plain torch DDP (vs DeepSpeed).

The model is 12 residual MLP blocks (LayerNorm, Linear(1024, 4096), GELU, Linear(4096, 1024)) and a
Linear(1024, 1) head: 100.7M fp32 parameters, no embedding. It trains with AdamW (fp32), gradient
clipping 1.0, micro batch 8, on 2 CPU ranks (gloo). Modes: plain torch DDP (DistributedDataParallel
with its defaults, clip_grad_norm_, AdamW); crew's engine with {"zero_optimization": {"stage": N}},
N = 0-3 (at stage 3 the model is built under crew.zero.Init(), as DeepSpeed users do); DeepSpeed's
engine at each stage when `import deepspeed` works (a "not installed" row otherwise).

Every mode runs in a `crew run --num_gpus 2` job of its own (launched as benchmarks/step.py does), so
that each process's peak RSS and allocator state are that mode's alone: --warmup steps (DDP rebuilds
its buckets, FSDP2 initialises lazily, AdamW creates its state), --steps timed steps, then one step
under torch's memory trackers (torch.distributed._tools): MemTracker for DDP and stages 0-2, told
about the module and the optimizer that holds the state (at stages 1-2 ZeroRedundancyOptimizer's inner
`.optim`); FSDPMemTracker for the FSDP2-sharded stage 3. They attribute every tensor storage to a
category (parameters, sharded/unsharded; gradients; optimizer state; activations, temporaries,
all-gather/reduce-scatter buffers) and snapshot the live bytes per category at every module or FSDP
unit boundary and at the peak; an optimizer step post-hook adds a snapshot right after the optimizer
step, before the gradients are dropped (there the module is shown to MemTracker again: DDP's bucket
views, and stage 2's accumulated gradients, were first seen as temporaries, and are labelled gradients
from then on). Per rank:

* model state: parameters + gradients + optimizer state at the snapshot where their sum is largest
  (the step's high-water mark: at stage 3 the units gathered at that moment count), split into its
  parts, per parameter, and the theory (fp32 Adam, N ranks, crew.runtime.estimate: 16 B/param at stage
  0, 4+4+8/N at stage 1, 4+12/N at stage 2 (whole parameters, each rank's own gradients and Adam
  state), 16/N at stage 3); stage 2's gradient buckets (transient, reduce_bucket_size elements: with
  DeepSpeed's default 5e8 the whole gradient of this model, during the backward) are in 'tracked peak';
* tracked after: the same sum right after the optimizer step (persistent state plus gradients);
  tracked peak: every tracked byte at the peak (activations, temporaries, communication buffers too);
* peak RSS (resource.getrusage ru_maxrss) after set-up and at the end of the job.

Plain DDP's gradient buckets (gradient_as_bucket_view=False, DDP's default: a second copy of the
gradients) are not model state; their size, from DDP's logging data, is printed under the table.
DeepSpeed keeps its partitions in flat buffers of its own: its rows show a gc census of live tensors.

Step time: median over the timed steps on rank 0 (pooled over --repeat jobs per mode, the order of
the modes rotating from round to round). Running the modes side by side in one job, one step each
in turn, as benchmarks/step.py does against drift, was tried and dropped: with five such models in
one process glibc's malloc hands the memory one mode frees to the next, so DDP and stages 0-1 took
no page fault at all per step, while alone they take 10k-190k (up to 0.7 GB of fresh pages, 0.2-0.4 s
of system time) on every step. A user's job runs one mode; so does this benchmark. The machine
drifts (the same DDP job: 1.3 s a step in one run, 2.7 s in another an hour earlier): compare modes
within one run, and use --repeat for more than a first look.

Target: per-rank model state at stage 3 <= 55% of stage 0 on 2 ranks (worst rank of each), printed
with PASS/FAIL, for the high-water mark and for the state right after the optimizer step.

    .venv/bin/python benchmarks/zero.py             # 2 warm-up + 6 timed steps per mode, ~3 minutes
    .venv/bin/python benchmarks/zero.py --quick     # 2 timed steps per mode, ~2 minutes
    .venv/bin/python benchmarks/zero.py --repeat 3  # 3 jobs per mode, the order rotating, ~6 minutes

Memory: up to about 2.5 GB per rank (5 GB for the job); one job at a time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

WIDTH, DEPTH, MICRO_BATCH, LR, CLIP, RANKS = 1024, 12, 8, 1e-3, 1.0, 2
STAGES = (0, 1, 2, 3)
TARGET = 0.55
MIB = 2**20
PARAM_KEYS = ("Parameter", "Sharded Param", "Unsharded Param")
GRAD_KEYS = ("Gradient", "Sharded Grad", "Unsharded Grad")
OPT_KEYS = ("Optstate", "OptState")


# --------------------------------------------------------------------------------------------------
# the model and the modes


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(DEPTH)])
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def count_params() -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Net().parameters())


def batches(rank: int, steps: int):
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        inputs = torch.randn(MICRO_BATCH, WIDTH, generator=generator)
        yield inputs, inputs.mean(dim=1, keepdim=True)


# crew-2s: stage 2 with buckets of DDP's size (2^23 fp32 elements, 32 MiB) instead of DeepSpeed's 5e8
SMALL_BUCKETS = {"reduce_bucket_size": 2**23}


def ds_config(stage: int, **zero_keys) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, **zero_keys}}


def stage_of(mode: str) -> int:
    return 0 if mode == "ddp" else int(mode.rsplit("-", 1)[1].rstrip("s"))


@dataclass
class Trainee:
    """One mode, built: its training step and what the memory tracker needs to know about it."""

    step: Callable[[torch.Tensor, torch.Tensor], None]
    module: torch.nn.Module  # the module called (the FSDP2 root at stage 3)
    optimizer: torch.optim.Optimizer  # the one stepped (post-step snapshot hook)
    state_holder: torch.optim.Optimizer  # the one holding the state (ZeRO-1: the inner .optim)
    sharded: bool = False  # FSDP2: FSDPMemTracker


def build(mode: str) -> Trainee:
    """'ddp', 'crew-N', 'crew-2s' or 'deepspeed-N'; joins the process group."""
    if mode == "ddp":
        return build_ddp()
    return build_engine(mode.rsplit("-", 1)[0], stage_of(mode), SMALL_BUCKETS if mode.endswith("s") else {})


def build_ddp() -> Trainee:
    """Plain torch: DDP (its defaults), clip_grad_norm_, AdamW, zero_grad."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from _ddp_baseline import ddp_stepper

    step, model, optimizer = ddp_stepper(make_model(), LR, CLIP)
    return Trainee(step, model, optimizer, optimizer)


def build_engine(library: str, stage: int, zero_keys: dict) -> Trainee:
    """crew's (or DeepSpeed's) engine; at stage 3 the model is built under zero.Init()."""
    deepspeed = importlib.import_module(library)
    with deepspeed.zero.Init(enabled=stage == 3):
        model = make_model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(stage, **zero_keys))

    def step(inputs, targets):
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    holder = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the state in .optim
    return Trainee(step, engine.module, optimizer, holder, sharded=library == "crew" and stage == 3)


# --------------------------------------------------------------------------------------------------
# memory


def by_category(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot {device: {category: bytes}} as {category name: bytes}, devices summed."""
    totals: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = str(getattr(key, "value", key))
            totals[name] = totals.get(name, 0) + value
    return totals


def model_state(categories: dict[str, int]) -> dict[str, int]:
    parts = {"params": PARAM_KEYS, "grads": GRAD_KEYS, "optim": OPT_KEYS}
    state = {part: sum(categories.get(key, 0) for key in keys) for part, keys in parts.items()}
    state["total"] = sum(state.values())
    return state


def make_tracker(trainee: Trainee):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if trainee.sharded:
        return FSDPMemTracker(trainee.module, trainee.state_holder)
    tracker = MemTracker()
    tracker.track_external(trainee.module, trainee.state_holder)
    return tracker


def tracked_step(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """One step under torch's memory tracker: model state at its high-water mark and right after the
    optimizer step, and the breakdown at the tracked peak."""
    tracker = make_tracker(trainee)
    after_step: list[dict] = []

    def snapshot_after_step(*_) -> None:
        if not trainee.sharded:  # DDP's bucket views were first seen as temporaries: label them grads
            tracker.track_external(trainee.module)
        after_step.append(by_category(tracker.get_tracker_snapshot()))
    hook = trainee.optimizer.register_step_post_hook(snapshot_after_step)
    with tracker:
        trainee.step(inputs, targets)
    hook.remove()
    boundaries = [by_category(snapshot) for stats in tracker.memory_tracking.values()
                  for snapshots in stats.snapshots.values() for snapshot in snapshots]
    high_water = max(boundaries + after_step, key=lambda c: model_state(c)["total"])
    peak = by_category(tracker.get_tracker_snapshot("peak"))
    return {"state": model_state(high_water), "after_step": model_state(after_step[-1])["total"],
            "peak_total": peak.get("Total", 0)}


def ddp_bucket_bytes(trainee: Trainee) -> int:
    """Plain DDP's gradient buckets (a copy of the gradients), from DDP's logging data; 0 otherwise."""
    module = trainee.module
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel) or module.gradient_as_bucket_view:
        return 0
    sizes = module._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(size) for size in str(sizes).split(",") if size.strip())


def deepspeed_census() -> int:
    """Bytes of every live tensor storage Python can reach (gc): DeepSpeed keeps its partitions in flat
    buffers of its own, which the trackers' categories do not cover."""
    import gc

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue  # a wrapper subclass (DTensor) has no storage: its local tensor is counted
    return sum(storages.values())


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --------------------------------------------------------------------------------------------------
# the worker (one process per rank, under `crew run`)


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def timed(step: Callable, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    started = time.perf_counter()
    step(inputs, targets)
    return time.perf_counter() - started


def worker(mode: str, args, out: Path) -> None:
    """One mode: warm-up, timed steps, one tracked step; each rank writes its figures."""
    trainee = build(mode)
    result: dict = {"rss_setup": peak_rss()}
    data = batches(rank(), args.warmup + args.steps + 1)
    for _ in range(args.warmup):
        trainee.step(*next(data))
    result["times"] = [timed(trainee.step, *next(data)) for _ in range(args.steps)]
    if mode.startswith("deepspeed"):
        trainee.step(*next(data))
        result["census"] = deepspeed_census()
    else:
        result.update(tracked_step(trainee, *next(data)))
    result["buckets"] = ddp_bucket_bytes(trainee)
    result["rss_peak"] = peak_rss()
    (out / f"{mode}.rank{rank()}.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------------
# the harness


def launch(mode: str, args, out: Path) -> list[dict] | str:
    """Runs one 2-rank job; returns each rank's figures, or why it failed."""
    crew = Path(sys.executable).parent / "crew"
    argv = [str(crew), "run", "--num_gpus", str(RANKS), __file__, "--worker", mode, "--out", str(out),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}"
    return [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(RANKS)]


def run_all(modes: list[str], args) -> tuple[dict[str, list[list[dict]]], dict[str, str]]:
    """Every mode in a job of its own, --repeat rounds, the order rotating from round to round.
    Returns {mode: [per-rank figures of each run]} and {mode: why a run failed}."""
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.repeat):
            shift = round_ % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                result = launch(mode, args, Path(folder))
                if isinstance(result, str):
                    failures[mode] = result
                else:
                    runs[mode].append(result)
    return runs, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per job (default 6)")
    parser.add_argument("--repeat", type=int, default=1, help="jobs per mode, the order rotating (default 1)")
    parser.add_argument("--quick", action="store_true", help="--steps 2 --repeat 1")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeat = 2, 1
    if args.worker:
        return worker(args.worker, args, Path(args.out))
    started = time.perf_counter()
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    modes = ["ddp"] + [f"crew-{stage}" for stage in STAGES] + ["crew-2s"]
    modes += [f"deepspeed-{stage}" for stage in STAGES] if has_deepspeed else []
    runs, failures = run_all(modes, args)
    report(modes, runs, failures, has_deepspeed, args, time.perf_counter() - started)


# --------------------------------------------------------------------------------------------------
# the tables


def theory_bytes(mode: str, num_params: int) -> int:
    from crew.runtime.estimate import model_states_per_rank

    stage = stage_of(mode)
    row = next(r for r in model_states_per_rank(num_params, RANKS, "fp32") if r.stage == stage and not r.offload)
    return row.device_bytes


def mib(value: float) -> str:
    return f"{value / MIB:.0f}"


def memory_row(mode: str, r: int, result: dict, num_params: int) -> str:
    """One rank's memory figures; for DeepSpeed a census of its live tensors instead of the split."""
    theory = mib(theory_bytes(mode, num_params))
    rss = f"{mib(result['rss_setup']):>6} {mib(result['rss_peak']):>6}"
    if "state" not in result:
        census = f"{'all live tensors after a step:':>26} {mib(result['census']):>6}"
        return f"{mode:<11} {r:>4} | {census} {theory:>6} | {'':>6} {'':>6} | {rss}"
    state = result["state"]
    parts = " ".join(f"{mib(state[part]):>6}" for part in ("params", "grads", "optim", "total"))
    return (f"{mode:<11} {r:>4} | {parts} {state['total'] / num_params:5.2f} {theory:>6} | "
            f"{mib(result['after_step']):>6} {mib(result['peak_total']):>6} | {rss}")


def memory_table(modes: list[str], runs: dict[str, list[list[dict]]], failures: dict[str, str],
                 num_params: int) -> None:
    print(f"{'':<16} | {'model state, at its high-water mark in the step':^41} | {'tracked':^13} | "
          f"{'peak RSS':^13}")
    print(f"{'mode':<11} {'rank':>4} | {'params':>6} {'grads':>6} {'optim':>6} {'total':>6} {'B/par':>5} "
          f"{'theory':>6} | {'after':>6} {'peak':>6} | {'set-up':>6} {'job':>6}")
    print("-" * 96)
    for mode in modes:
        if not runs[mode]:
            print(f"{mode:<11} {'':>4} | {failures.get(mode, 'no run')}")
            continue
        for r, result in enumerate(runs[mode][0]):
            print(memory_row(mode, r, result, num_params))


def ratio_lines(runs: dict[str, list[list[dict]]]) -> None:
    if not runs.get("crew-0") or not runs.get("crew-3"):
        print("stage 3 / stage 0 model state: not measured (a job failed)")
        return
    for label, figure in (("high-water", lambda r: r["state"]["total"]), ("after step", lambda r: r["after_step"])):
        zero = max(figure(r) for r in runs["crew-0"][0])
        three = max(figure(r) for r in runs["crew-3"][0])
        verdict = "PASS" if three <= TARGET * zero else "FAIL"
        print(f"stage 3 / stage 0 model state per rank ({label}, worst rank): {mib(three)} / {mib(zero)} MiB = "
              f"{three / zero:.1%} (target <= {TARGET:.0%}): {verdict}")


def time_table(modes: list[str], runs: dict[str, list[list[dict]]], failures: dict[str, str]) -> None:
    from _ddp_baseline import step_time_table

    medians = step_time_table({mode: [run[0]["times"] for run in runs[mode]] for mode in modes}, failures)
    for mode in ("crew-2", "crew-2s"):
        if "crew-1" in medians and mode in medians:
            print(f"{mode} / crew-1 step time: {medians[mode] / medians['crew-1']:.3f}")


def stage2_line(runs: dict[str, list[list[dict]]], num_params: int) -> None:
    """Stage 2's model state per parameter (DeepSpeed 0.19.8 measured 12 bytes on 2 ranks, fp32 Adam)."""
    for mode in ("crew-2", "crew-2s"):
        if runs.get(mode):
            ranks = runs[mode][0]
            figures = [max(figure(r) for r in ranks) / num_params for figure in
                       (lambda r: r["state"]["total"], lambda r: r["after_step"], lambda r: r["peak_total"])]
            print(f"{mode} bytes/param per rank (worst rank): model state high-water {figures[0]:.2f}, after "
                  f"the step {figures[1]:.2f}, tracked peak {figures[2]:.2f} (theory 4+12/N = {4 + 12 / RANKS:g}; "
                  "DeepSpeed 0.19.8's stage 2: 12)")


LEGEND = """\
model state = parameters + gradients + optimizer state held by the rank, in the tracker snapshot (an FSDP unit or
  module boundary, or right after optimizer.step) where their sum is largest; B/par = total / parameter count;
  theory = fp32 Adam on 2 ranks (crew.runtime.estimate: 16, 4+4+8/N, 4+12/N, 16/N bytes per parameter);
  tracked after = the same sum right after optimizer.step (gradients still held); tracked peak = every byte the
  tracker saw at its peak (activations, temporaries, communication buffers included);
  peak RSS = ru_maxrss after set-up (imports, model, wrapping) and at the end of the job;
  crew-2 = stage 2 with DeepSpeed's reduce_bucket_size 5e8 (this whole model's gradients wait for one reduction
  at the end of the backward: they count in the high-water mark), crew-2s = stage 2 with 2^23-element buckets"""

TIMING = """\
Each mode runs in a job of its own, as a user's would. Stepping all modes in turn in one job (benchmarks/step.py's
guard against drift) is not sound here: with five such models in one process, malloc hands the memory one mode
frees to the next, and DDP and stages 0-1 stop paying the page faults they pay alone. Against drift (large on this
2-core machine), --repeat N runs every job N times, the order of the modes rotating from round to round."""


def report(modes, runs, failures, has_deepspeed: bool, args, wall_s: float) -> None:
    num_params = count_params()
    malloc = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")) or "defaults"
    print(f"model: {DEPTH} x residual MLP block (LayerNorm, Linear({WIDTH}, {4 * WIDTH}), GELU, "
          f"Linear({4 * WIDTH}, {WIDTH})) + Linear({WIDTH}, 1) = {num_params / 1e6:.1f}M fp32 parameters;")
    print(f"AdamW, clip {CLIP}, micro batch {MICRO_BATCH}, {RANKS} CPU ranks (gloo) under `crew run`, "
          f"torch {torch.__version__}, glibc malloc {malloc}; stage 3 builds the model under crew.zero.Init()")
    print()
    print(f"Per-rank memory (MiB = 2^20 bytes): one step tracked by torch.distributed._tools trackers after "
          f"{args.warmup} warm-up and {args.steps} timed steps (first run)")
    memory_table(modes, runs, failures, num_params)
    if not has_deepspeed:
        print(f"{'deepspeed':<11} {'':>4} | not installed")
    print(LEGEND)
    buckets = [r["buckets"] for run in runs["ddp"][:1] for r in run if r["buckets"]]
    if buckets:
        print(f"plain DDP also holds {mib(max(buckets))} MiB of gradient buckets per rank (DDP's logging data), a "
              "second copy of the gradients\n  (gradient_as_bucket_view=False), counted in 'tracked peak' only; "
              "crew's stages 0-1 make the buckets the gradients")
    ratio_lines(runs)
    stage2_line(runs, num_params)
    print()
    print(f"Step time (rank 0): median of {args.steps} steps after {args.warmup} warm-up step(s), in each of "
          f"{args.repeat} run(s) per mode, pooled")
    time_table(modes, runs, failures)
    print(TIMING)
    print(f"benchmark wall time: {wall_s:.0f} s")


if __name__ == "__main__":
    main()
