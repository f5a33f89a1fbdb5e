"""Unchanged Hugging Face scripts under DeepSpeed 0.19.8 and under `crew run --as_deepspeed`: per-step losses,
grad norms and learning rates, resumes from every checkpoint, the saved weights, timing.

    .venv/bin/python benchmarks/hf_compare.py --deepspeed_python /path/to/venv-with-deepspeed/bin/python
        [--scripts trainer,accelerate] [--stages 0,1,2] [--steps 12] [--save_steps 4] [--repeat 3]

Two scripts, each in the shape of its library's DeepSpeed docs, fp32, a tiny GPT-2 built from a config and
synthetic tokens (micro batch 4, accumulation 2, AdamW, WarmupLR with 3 warm-up steps, clipping 1.0):
* trainer (benchmarks/_hf_trainer.py): `TrainingArguments(deepspeed=<dict with "auto" values>)`, Trainer
  saving a checkpoint every `--save_steps`, `save_model`. DeepSpeed starts it as its users do,
  `deepspeed --num_gpus 1 train.py ...`; crew as `crew run --as_deepspeed --num_gpus N train.py ...`.
* accelerate (benchmarks/_hf_accelerate.py): an Accelerator loop with DummyOptim/DummyScheduler, a
  DEEPSPEED launch YAML naming a DeepSpeed JSON ("auto" values), save_state/load_state. DeepSpeed:
  `accelerate launch --config_file accelerate_zS_x1.yaml train.py ...`; crew: `crew run --as_deepspeed
  --config_file accelerate_zS_xN.yaml train.py ...` (the same YAML but for num_processes).

Like with like: on a machine without CUDA, Accelerate (which Trainer runs on) initializes no process
group itself and its state says world size 1, so real DeepSpeed started with 2 processes stops at its
batch-size assertion (train_batch_size 8 != 4 x 2 x 2). DeepSpeed therefore runs one process
(DS_ACCELERATOR=cpu for its runs only) and is compared with crew at 1 rank. crew with 2 ranks
(`--crew_ranks`: a real 2-rank world, each step sees twice the samples) is reported beside them; its
losses are its own and are checked only against its own resumes.

Per script, ZeRO stage and engine:
* the uninterrupted run: loss, grad_norm, learning_rate per optimizer step (Trainer's log history);
* a resume from each checkpoint but the last, into a fresh output folder: the steps it runs must repeat
  the uninterrupted run's (bound RESUME_BOUND relative; "exact" where bit for bit);
* the saved model (OUT/final/model.safetensors): DeepSpeed's against crew's, max |diff|;
* timing, median over `--repeat` uninterrupted runs: wall time (launcher start to exit), time to the
  first step (launcher start to the end of optimizer step 1, time.time() in the script), steps/s from
  the median step time (steps that follow a checkpoint left out) and a checkpoint save's extra time.
DeepSpeed is run once unmeasured first: its first start on a machine builds a C++ op (about 30 s).
Prints, per script, one table per stage, a resume table, a timing table and a summary checking the
issue's bound (losses within 1e-4 relative between DeepSpeed and crew at 1 process); exits 1 when a bound
is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _jobs import run_job  # beside this script: on its sys.path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"trainer": HERE / "_hf_trainer.py", "accelerate": HERE / "_hf_accelerate.py"}
LOSS_BOUND = 1e-4  # the bound between DeepSpeed and crew, fp32
RESUME_BOUND = 1e-6  # a resume against its own uninterrupted run: float32 rounding (a few ulps) at most

# Why DeepSpeed 0.19.8 reports no grad norm (Trainer logs none: Accelerate's clip_grad_norm_ returns
# engine.get_global_grad_norm()). See benchmarks/deepspeed_compare.py for the same finding.
DS_NONE_WHY = {
    0: "at ZeRO stage 0 in fp32 DeepSpeed's engine.optimizer is the bare torch optimizer "
       "(runtime/engine.py:2366), which has no _global_grad_norm, so engine.get_global_grad_norm() "
       "stays None (engine.py:556, 3518); crew reports the norm at every stage (docs/engine.md).",
}


@dataclass
class Run:
    """One launch: what it printed and recorded, and how long it took."""
    record: dict
    wall: float
    launched: float
    out: Path

    def steps(self) -> dict[int, dict]:
        """Optimizer step -> its logged loss, grad_norm, learning_rate (the final summary entry left out)."""
        return {entry["step"]: entry for entry in self.record["log_history"] if "loss" in entry}

    def first_step_s(self) -> float:
        return self.record["step_ends"][0] - self.launched

    def step_and_save_s(self, save_steps: int) -> tuple[float, float]:
        """Median time of an optimizer step, and the mean extra time of the steps that follow a checkpoint
        (Trainer saves after on_step_end, so a save falls in the interval after its step)."""
        ends = self.record["step_ends"]
        gaps = {step: ends[step] - ends[step - 1] for step in range(1, len(ends))}  # step+1's duration
        plain = statistics.median(gap for step, gap in gaps.items() if step % save_steps)
        saves = [gap - plain for step, gap in gaps.items() if step % save_steps == 0]
        return plain, statistics.mean(saves) if saves else float("nan")


@dataclass
class Engine:
    name: str
    command: list[str]  # the launcher and its options, up to the script
    script: Path
    env: dict
    runs: dict[str, Run] = field(default_factory=dict)
    timed: list[Run] = field(default_factory=list)  # the uninterrupted run and its --repeat copies


def launch(engine: Engine, folder: Path, label: str, stage: int, args: argparse.Namespace,
           resume: str | None = None) -> Run:
    name = engine.name.replace(" ", "")
    out, record = folder / f"{name}-{label}", folder / f"{name}-{label}.json"
    command = [*engine.command, str(engine.script), str(out), "--stage", str(stage), "--steps", str(args.steps),
               "--save_steps", str(args.save_steps), "--record", str(record)]
    if resume:
        command += ["--resume", resume]
    launched = time.time()
    proc = run_job(command, cwd=folder, env=engine.env, timeout=900)
    wall = time.time() - launched
    if proc.returncode or not record.exists():
        sys.exit(f"{engine.name} ({label}) failed with code {proc.returncode}: {' '.join(command)}\n"
                 f"{(proc.stdout + proc.stderr)[-4000:]}")
    return Run(json.loads(record.read_text()), wall, launched, out)


def rel_diff(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def fmt(value, spec: str = ".6f", none: str = "None") -> str:
    return none if value is None else format(value, spec)


def weights_diff(a: Path, b: Path) -> float:
    """Max |difference| over every tensor of two saved models (model.safetensors in each folder)."""
    from safetensors.torch import load_file

    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if left.keys() != right.keys():
        return float("inf")
    return max(float((left[k].double() - right[k].double()).abs().max()) for k in left)


def print_stage(stage: int, engines: list[Engine]) -> dict:
    """Per-step table of the uninterrupted runs; returns the stage's DeepSpeed-vs-crew figures."""
    ds, crew1 = engines[0].runs["full"].steps(), engines[1].runs["full"].steps()
    others = engines[2:]
    print(f"\nZeRO stage {stage}: {len(ds)} optimizer steps (loss: the mean over the step's micro batches "
          f"and ranks)")
    head = "| step | deepspeed loss | crew loss | rel diff | deepspeed grad norm | crew grad norm | rel diff " \
           "| deepspeed lr | crew lr |" + "".join(f" {e.name} loss | {e.name} grad norm | {e.name} lr |"
                                                for e in others)
    print(head + "\n" + "|---" * head.count(" |") + "|")
    for step in sorted(ds.keys() | crew1.keys()):
        a, b = ds.get(step, {}), crew1.get(step, {})
        loss_diff = rel_diff(a["loss"], b["loss"]) if a and b else None
        na, nb = a.get("grad_norm"), b.get("grad_norm")
        norm_diff = rel_diff(na, nb) if na is not None and nb is not None else None
        row = (f"| {step} | {fmt(a.get('loss'))} | {fmt(b.get('loss'))} | {fmt(loss_diff, '.2e', '')} "
               f"| {fmt(na, '.6f', 'n/a (None)')} | {fmt(nb)} | {fmt(norm_diff, '.2e', '')} "
               f"| {fmt(a.get('learning_rate'), '.6g')} | {fmt(b.get('learning_rate'), '.6g')} |")
        for other in others:
            c = other.runs["full"].steps().get(step, {})
            row += f" {fmt(c.get('loss'))} | {fmt(c.get('grad_norm'))} | {fmt(c.get('learning_rate'), '.6g')} |"
        print(row)
    common = ds.keys() & crew1.keys()
    norms = [(ds[s]["grad_norm"], crew1[s]["grad_norm"]) for s in common
             if ds[s].get("grad_norm") is not None and crew1[s].get("grad_norm") is not None]
    ds_none = sum(ds[s].get("grad_norm") is None for s in ds)
    if ds_none:
        print(f"DeepSpeed logged no grad norm at {ds_none} of {len(ds)} steps: "
              f"{DS_NONE_WHY.get(stage, 'unexplained (not expected from the 0.19.8 source)')}")
    return {
        "steps": (len(ds), len(crew1)),
        "loss": max(rel_diff(ds[s]["loss"], crew1[s]["loss"]) for s in common),
        "norm": max((rel_diff(a, b) for a, b in norms), default=None), "norms": len(norms),
        "lr": max(abs(ds[s]["learning_rate"] - crew1[s]["learning_rate"]) for s in common),
        "weights": weights_diff(engines[0].runs["full"].out / "final", engines[1].runs["full"].out / "final"),
    }


def resume_figures(engine: Engine) -> list[tuple[str, int, float, float, float]]:
    """Per resume: (label, steps compared, max rel loss diff, max rel grad-norm diff, max abs lr diff) of the
    steps it ran (after its checkpoint; the log history before it comes from the checkpoint) against the
    uninterrupted run's; steps compared is -1 when the resume did not reach the last step."""
    full_run = engine.runs["full"]
    full = full_run.steps()
    rows = []
    for label, run in engine.runs.items():
        if label == "full":
            continue
        start = int(label.rsplit("-", 1)[1])
        resumed = {step: entry for step, entry in run.steps().items() if step > start}
        losses = [rel_diff(resumed[s]["loss"], full[s]["loss"]) for s in resumed]
        norms = [rel_diff(resumed[s]["grad_norm"], full[s]["grad_norm"]) for s in resumed
                 if resumed[s].get("grad_norm") is not None and full[s].get("grad_norm") is not None]
        lrs = [abs(resumed[s]["learning_rate"] - full[s]["learning_rate"]) for s in resumed]
        complete = run.record["global_step"] == full_run.record["global_step"] and resumed
        rows.append((label, len(resumed) if complete else -1, max(losses, default=float("nan")),
                     max(norms, default=0.0), max(lrs, default=0.0)))
    return rows


def print_resumes(results: dict[int, list[Engine]]) -> bool:
    """The resume table; True when every resume (DeepSpeed's too) reached the last step with losses within
    RESUME_BOUND of its uninterrupted run's and the same learning rates."""
    print("\nResumes: each checkpoint but the last, resumed into a fresh output folder; the steps it ran against "
          "the uninterrupted run's\n| ZeRO stage | engine | resumed from | steps compared | max rel loss diff "
          "| max rel grad-norm diff | max abs lr diff |\n|---|---|---|---|---|---|---|")
    within, exact, total = True, 0, 0
    for stage, engines in results.items():
        for engine in engines:
            for label, steps, loss, norm, lr in resume_figures(engine):
                within = within and steps > 0 and loss <= RESUME_BOUND and lr == 0.0
                exact, total = exact + (steps > 0 and loss == norm == lr == 0.0), total + 1
                print(f"| {stage} | {engine.name} | {label} | {steps if steps >= 0 else 'INCOMPLETE'} "
                      f"| {'exact' if loss == 0 else f'{loss:.2e}'} | {'exact' if norm == 0 else f'{norm:.2e}'} "
                      f"| {'exact' if lr == 0 else f'{lr:.2e}'} |")
    print(f"resumes within {RESUME_BOUND:g} relative of their run's losses, same lr: {'yes' if within else 'NO'}; "
          f"bit for bit (losses, grad norms, lr): {exact} of {total}")
    return within


def print_timings(results: dict[int, list[Engine]], save_steps: int) -> None:
    print("\nTiming, median over the uninterrupted runs (wall: launcher start to exit; first step: launcher start "
          "to the end of optimizer step 1; steps/s: from the median step, checkpoint saves left out; save: the "
          "extra time of a step that follows a checkpoint)\n"
          "| ZeRO stage | engine | world size | runs | wall s | first step s | steps/s | save s |\n"
          "|---|---|---|---|---|---|---|---|")
    for stage, engines in results.items():
        for engine in engines:
            runs = engine.timed
            step_save = [run.step_and_save_s(save_steps) for run in runs]
            print(f"| {stage} | {engine.name} | {runs[0].record['world_size']} | {len(runs)} "
                  f"| {statistics.median(r.wall for r in runs):.2f} "
                  f"| {statistics.median(r.first_step_s() for r in runs):.2f} "
                  f"| {1 / statistics.median(s for s, _ in step_save):.1f} "
                  f"| {statistics.median(save for _, save in step_save):.3f} |")


def print_summary(figures: dict[int, dict], resumed: bool) -> bool:
    print(f"\nDeepSpeed (1 process) against crew (1 rank)\n| ZeRO stage | optimizer steps | max rel loss diff "
          f"(bound {LOSS_BOUND:g}) | max rel grad-norm diff | max abs lr diff | saved weights max abs diff |"
          "\n|---|---|---|---|---|---|")
    ok = resumed
    for stage, f in figures.items():
        within = f["loss"] <= LOSS_BOUND and f["steps"][0] == f["steps"][1]
        ok = ok and within
        norm = f"{f['norm']:.2e} ({f['norms']} steps)" if f["norm"] is not None else "n/a (DeepSpeed: None)"
        print(f"| {stage} | {f['steps'][0]} / {f['steps'][1]} | {f['loss']:.2e} {'ok' if within else 'OVER'} "
              f"| {norm} | {f['lr']:.2e} | {f['weights']:.2e} |")
    return ok


def repeats_agree(results: dict[int, list[Engine]]) -> bool:
    """Every repeat of an uninterrupted run logged the same losses as the first (each engine is deterministic)."""
    differ = [f"stage {stage} {engine.name}" for stage, engines in results.items() for engine in engines
              if any(run.steps() != engine.timed[0].steps() for run in engine.timed[1:])]
    if differ:
        print(f"repeated runs logged other losses: {', '.join(differ)}")
    return not differ


def accelerate_config(folder: Path, stage: int, processes: int) -> str:
    """The launch YAML `accelerate config` writes for DeepSpeed with a config file, and that file (HF-docs
    shape: "auto" where Accelerate fills the value in); returns the YAML's name."""
    ds = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupLR",
                        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
          "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
          "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 2000}
    (folder / f"ds_z{stage}.json").write_text(json.dumps(ds, indent=2))
    name = f"accelerate_z{stage}_x{processes}.yaml"
    (folder / name).write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: ds_z{stage}.json\n  zero3_init_flag: false\nmachine_rank: 0\n"
        f"num_machines: 1\nnum_processes: {processes}\nuse_cpu: false\n")
    return name


def engines_for(args: argparse.Namespace, script: str, stage: int, folder: Path) -> list[Engine]:
    """DeepSpeed (1 process, as its users start it), crew with 1 rank and with --crew_ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    crew = [str(Path(sys.executable).parent / "crew"), "run", "--as_deepspeed"]
    ds_bin = Path(args.deepspeed_python).parent
    ranks = [1] + ([args.crew_ranks] if args.crew_ranks > 1 else [])
    if script == "trainer":
        deepspeed = [str(ds_bin / "deepspeed"), "--num_gpus", "1"]
        crews = [[*crew, "--num_gpus", str(n)] for n in ranks]
    else:
        deepspeed = [str(ds_bin / "accelerate"), "launch", "--config_file", accelerate_config(folder, stage, 1)]
        crews = [[*crew, "--config_file", accelerate_config(folder, stage, n)] for n in ranks]
    engines = [Engine("deepspeed", deepspeed, SCRIPTS[script], {**env, "DS_ACCELERATOR": "cpu"})]
    engines += [Engine("crew" if n == 1 else f"crew x{n}", command, SCRIPTS[script], env)
                for n, command in zip(ranks, crews)]
    return engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_python", required=True, help="a Python with deepspeed 0.19.8 and the HF stack")
    parser.add_argument("--stages", default="0,1,2")
    parser.add_argument("--scripts", default="trainer,accelerate", help="which of: trainer, accelerate")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--save_steps", type=int, default=4, help="a checkpoint every N steps")
    parser.add_argument("--crew_ranks", type=int, default=2, help="also crew with this many ranks (1: not)")
    parser.add_argument("--repeat", type=int, default=1, help="uninterrupted runs per stage and engine, for timing")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="crew-hf-compare-"))
    print(f"working in {folder}")
    warmup = engines_for(args, "trainer", 0, folder)[0]
    launch(warmup, folder, "warmup", 0, argparse.Namespace(steps=1, save_steps=100))
    ok = True
    for script in args.scripts.split(","):
        print(f"\n## {script}: {SCRIPTS[script].name}")
        results, figures = {}, {}
        for stage in map(int, args.stages.split(",")):
            results[stage] = run_stage(args, script, stage, folder)
            figures[stage] = print_stage(stage, results[stage])
        resumed = print_resumes(results)
        print_timings(results, args.save_steps)
        ok = print_summary(figures, resumed) and repeats_agree(results) and ok
    sys.exit(0 if ok else 1)


def run_stage(args: argparse.Namespace, script: str, stage: int, folder: Path) -> list[Engine]:
    """Every engine's uninterrupted run, its resumes from each checkpoint but the last, its repeats."""
    engines = engines_for(args, script, stage, folder)
    for engine in engines:
        engine.runs["full"] = launch(engine, folder, f"{script}-z{stage}", stage, args)
        engine.timed.append(engine.runs["full"])
        for step in range(args.save_steps, args.steps, args.save_steps):
            checkpoint = engine.runs["full"].out / f"checkpoint-{step}"
            engine.runs[f"checkpoint-{step}"] = launch(engine, folder, f"{script}-z{stage}-from{step}", stage, args,
                                                       resume=str(checkpoint))
    for repeat in range(1, args.repeat):  # interleaved, so that drift in the machine's load hits all alike
        for engine in engines:
            engine.timed.append(launch(engine, folder, f"{script}-z{stage}-repeat{repeat}", stage, args))
    return engines

if __name__ == "__main__":
    main()
