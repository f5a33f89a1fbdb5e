"""bf16 against fp32 losses at ZeRO stages 2 and 3: crew beside DeepSpeed 0.19.8.

The same DeepSpeed script (benchmarks/_zero_numerics_job.py: deepspeed.initialize with a config dict, "AdamW"
with torch_adam, lr 1e-3, weight decay 0.01; a residual MLP: Linear(32, w), 2 pre-LayerNorm blocks
[LayerNorm, Linear(w, 4w), GELU, Linear(4w, w)], LayerNorm, Linear(w, 8): 1.06M parameters at w = 256, whose
four (w x 4w) matrices are sharded at stage 3 and whose biases, LayerNorms and small matrices stay whole
(stage3_param_persistence_threshold 1e5); at stage 3 built under deepspeed.zero.Init) trains on fixed seeded
data (micro batch 16, accumulation 2, 2 CPU ranks, gloo) towards a fixed random teacher, so the loss falls.
It runs under `crew run --as_deepspeed` and, where DeepSpeed's venv exists, under its torchrun
(DS_ACCELERATOR=cpu). Per stage, each engine runs: fp32; bf16 (the default communication dtype); bf16 with
"communication_data_type": "fp32"; and at stage 3 also bf16 with the model built outside zero.Init
(`bf16 noinit`: DeepSpeed's zero.Init under bf16 creates the parameters in bf16, so their random init is
drawn in bf16 and differs from fp32's; crew's keeps the dtype the model is built in), and that with
"data_types": {"grad_accum_dtype": "fp32"} (`acc fp32`: DeepSpeed's stage 3 then accumulates the gradients of
the micro steps in fp32, by default in bf16; crew reads the key but does not act on it), and bf16 outside
zero.Init from weights rounded to bf16 before deepspeed.initialize (`bf16 init`: DeepSpeed casts the model to
bf16 and makes its fp32 masters from that, at every stage, as crew does at stages 1-2; crew's stage 3 keeps the
model's fp32 weights as its masters, so its bf16 curve starts from unrounded masters; with this run both start
from the same masters). A configuration that fails reads FAILED with its error.

The loss of an optimizer step is the mean over its micro steps and the ranks (fp32). Deviation of a curve a
from a reference b: |a - b| / |b| per optimizer step; `step 0` is the first step's (the forward alone: init
and compute dtype), `mean` and `max` over all steps, `final` the last step's. The claim checked: crew's bf16
deviation from its fp32 curve is within DeepSpeed's own (or of the same order).

    .venv/bin/python benchmarks/zero_numerics.py                  # 40 optimizer steps, both engines, ~2-3 min
    .venv/bin/python benchmarks/zero_numerics.py --steps 10 --libraries crew
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _jobs import run_job  # beside this script: on its sys.path

JOB = Path(__file__).resolve().parent / "_zero_numerics_job.py"
DS_TORCHRUN = Path("/opt/dsvenv/bin/torchrun")
RANKS = 2
LIBRARIES = {"crew": "crew", "deepspeed": "DeepSpeed"}
COLUMNS = ("step 0", "mean", "max", "final")
HEADER = " ".join(f"{c:>9}" for c in COLUMNS)
WIDTH = 21  # the longest run label


def runs_of(stage: int) -> list[dict]:
    runs = [{"stage": stage, "dtype": "fp32"}, {"stage": stage, "dtype": "bf16"},
            {"stage": stage, "dtype": "bf16", "comm": "fp32"}]
    noinit = {"stage": stage, "dtype": "bf16", "zero_init": False}
    return runs + ([noinit, {**noinit, "accum": "fp32"}, {**noinit, "bf16_init": True}] if stage == 3 else [])


def label(run: dict) -> str:
    return run["dtype"] + (f" comm {run['comm']}" if run.get("comm") else "") + \
        (" noinit" if run.get("zero_init") is False else "") + (f" acc {run['accum']}" if run.get("accum") else "") + \
        (" bf16 init" if run.get("bf16_init") else "")


def command(library: str, runs: list[dict], tag: str, out: str, args) -> tuple[list[str], dict]:
    job = [str(JOB), "--runs", json.dumps(runs), "--tag", tag, "--out", out, "--steps", str(args.steps),
           "--width", str(args.width)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if library == "crew":
        return [sys.executable, "-m", "crew", "run", "--num_gpus", str(RANKS), "--as_deepspeed", *job], env
    env.pop("PYTHONPATH", None)  # a crew checkout there must not answer DeepSpeed's venv
    return [str(DS_TORCHRUN), "--standalone", "--nproc_per_node", str(RANKS), *job], {**env, "DS_ACCELERATOR": "cpu"}


def one_job(library: str, stage: int, args, out: str) -> dict[str, dict]:
    """Runs one engine's configurations at one stage: {label: result (losses, or error)}."""
    runs, tag = runs_of(stage), f"{library}-{stage}"
    argv, env = command(library, runs, tag, out, args)
    started = time.perf_counter()
    try:
        done = run_job(argv, None, env, args.timeout)
        error = None if done.returncode == 0 else f"job exit {done.returncode}: " + last_error(done)
    except Exception as exc:  # a timeout: its cells say so, the other jobs still run
        error = f"job failed: {exc}"
    print(f"  {LIBRARIES[library]} stage {stage}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    file = Path(out) / f"{tag}.json"
    results = {label(r): r for r in json.loads(file.read_text())} if file.exists() else {}
    return {label(run): results.get(label(run)) or {"error": error or "no result"} for run in runs}


def last_error(done) -> str:
    lines = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if "Error" in line]
    return (lines or ["no output"])[-1][-200:]


def deviations(curve: list[float], reference: list[float]) -> tuple[float, float, float, float]:
    """(step 0, mean, max, final) relative deviation of `curve` from `reference`."""
    devs = [abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True)]
    return devs[0], sum(devs) / len(devs), max(devs), devs[-1]


def dev_cells(a: dict | None, b: dict | None) -> str:
    if a is None or b is None:
        return " ".join(f"{'-':>9}" for _ in COLUMNS)
    why = a.get("error") or b.get("error")
    if why:
        return f"FAILED: {why}"
    return " ".join(f"{d:9.2e}" for d in deviations(a["losses"], b["losses"]))


def own_table(results: dict) -> None:
    print("bf16 against the same engine's fp32 curve (relative loss deviation):")
    print(f"{'engine':<9} {'stage':>5} {'run':<{WIDTH}} | {HEADER} | {'loss 0 -> final':>17}")
    for (library, stage), by_label in results.items():
        reference = by_label["fp32"]
        for name, result in by_label.items():
            cells = dev_cells(result, reference) if name != "fp32" else " ".join(f"{'':>9}" for _ in COLUMNS)
            losses = result.get("losses")
            span = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else result.get("error", "")[:60]
            print(f"{LIBRARIES[library]:<9} {stage:>5} {name:<{WIDTH}} | {cells} | {span:>17}")


def cross_table(results: dict) -> None:
    print("crew against DeepSpeed, same configuration (relative loss deviation of crew's curve):")
    print(f"{'stage':>5} {'run':<{WIDTH}} | {HEADER}")
    for (library, stage), by_label in results.items():
        if library != "crew" or ("deepspeed", stage) not in results:
            continue
        for name, result in by_label.items():
            print(f"{stage:>5} {name:<{WIDTH}} | {dev_cells(result, results['deepspeed', stage].get(name))}")


def verdict(results: dict) -> None:
    """Per stage and bf16 run: crew's mean and max deviation from its fp32 curve against DeepSpeed's own."""
    for (library, stage), by_label in results.items():
        ds = results.get(("deepspeed", stage))
        if library != "crew" or ds is None:
            continue
        for name in by_label:
            if name == "fp32":
                continue
            mine, theirs = own_devs(by_label, name), own_devs(ds, name)
            if mine is None or theirs is None:
                print(f"stage {stage} {name:<{WIDTH}}: no comparison (a run failed)")
                continue
            ratios = [m / t if t else float("inf") for m, t in zip(mine, theirs)]
            print(f"stage {stage} {name:<{WIDTH}}: crew mean {mine[0]:.2e} max {mine[1]:.2e} | DeepSpeed mean "
                  f"{theirs[0]:.2e} max {theirs[1]:.2e} | crew/DeepSpeed x{ratios[0]:.2f} x{ratios[1]:.2f}: "
                  f"{judged(max(ratios))}")


def judged(ratio: float) -> str:
    if ratio <= 1:
        return "within DeepSpeed's"
    if ratio <= 1.1:
        return "equal to DeepSpeed's within 10%"
    return "larger, same order" if ratio < 10 else "LARGER by an order of magnitude or more"


def own_devs(by_label: dict, name: str) -> tuple[float, float] | None:
    """(mean, max) deviation of run `name` from the same engine's fp32 curve; None where either failed."""
    result, reference = by_label.get(name), by_label.get("fp32")
    if not result or not reference or "losses" not in result or "losses" not in reference:
        return None
    return deviations(result["losses"], reference["losses"])[1:3]


def report(results: dict, args, wall_s: float) -> None:
    params = next((r["params"] for by in results.values() for r in by.values() if "params" in r), 0)
    deepspeed = "DeepSpeed 0.19.8 (/opt/dsvenv)" if DS_TORCHRUN.exists() else "DeepSpeed: not installed"
    print(f"Residual MLP, width {args.width}: {params / 1e6:.2f}M parameters; AdamW lr 1e-3; {args.steps} optimizer "
          f"steps x accumulation 2 x micro batch 16 x {RANKS} CPU ranks (gloo); crew vs {deepspeed}.")
    own_table(results)
    print()
    cross_table(results)
    print()
    verdict(results)
    print(f"\nbenchmark wall time: {wall_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--libraries", default="crew,deepspeed")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--json", help="also write every run's losses here")
    args = parser.parse_args(argv)
    libraries = [lib for lib in args.libraries.split(",") if lib == "crew" or DS_TORCHRUN.exists()]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        results = {(lib, stage): one_job(lib, stage, args, out)
                   for stage in map(int, args.stages.split(",")) for lib in libraries}
    if args.json:
        Path(args.json).write_text(json.dumps({f"{lib}-{stage}": v for (lib, stage), v in results.items()}))
    report(results, args, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
