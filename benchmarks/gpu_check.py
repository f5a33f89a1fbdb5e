"""`make gpu-check`: what crew does on CUDA, in one command, as one report (22 short jobs; 336 s on one H200).

A GPU is lent to this project only now and then; this is what to run first when one is. Without CUDA it says
so in one line and exits 0 (CI never runs it). On a CUDA machine, every job through `crew run --as_deepspeed`
(benchmarks/_gpu_job.py, written against DeepSpeed's API), on 2 ranks when there are 2 GPUs or more, else 1:

1. the machine: torch, CUDA, NCCL, the GPUs;
2. NCCL all-reduce bus bandwidth at 1, 16 and 256 MB (2 GPUs or more);
3. training steps at fp32/bf16/fp16 x ZeRO 0-3: step time, peak memory per rank, and the losses against
   the same job on the CPU (gloo, fp32) within the dtype's tolerance;
4. activation checkpointing with cpu_checkpointing, optimizer offload (stage 2), parameter offload (stage 3),
   the pinned-memory loader;
5. `crew doctor` on this machine (its devices check);
6. the same training jobs under DeepSpeed, side by side, when `--deepspeed_python` names a Python that has it;
7. the suite's CUDA-only tests (`pytest -m cuda`), which skip with a reason everywhere else.

Exit code 1 when a check failed. `--cpu` rehearses the whole run on the CPU (gloo), to check this script itself.

    make gpu-check                      # .venv/bin/python benchmarks/gpu_check.py
    .venv/bin/python benchmarks/gpu_check.py --deepspeed_python /opt/ds/bin/python --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from _jobs import run_job  # beside this script: on its sys.path

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_gpu_job.py"
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2, "fp16": 1e-2}  # relative, per step, against the CPU's fp32 losses
FEATURES = (("cpu_checkpointing", 0), ("offload_optimizer", 2), ("offload_param", 3), ("pinned_loader", 0))
TIMEOUT_S = 240  # one job's; --job_timeout sets it (a lent GPU's minutes are few: a hang must not eat them)


def one_job(launcher: list[str], job_args: list[str], env: dict) -> dict:
    """One job; its GPUCHECK line, or {"error": ...}. A progress line on stderr as each ends: a run cut off
    by its caller's limit still shows how far it got."""
    argv = [*launcher, str(JOB), *job_args]
    started = time.monotonic()
    result = _job_result(argv, env)
    seconds = time.monotonic() - started
    outcome = "FAILED" if "error" in result else "ok"
    print(f"gpu-check: {' '.join(job_args)} ({'cpu' if env.get('CUDA_VISIBLE_DEVICES') == '' else 'default'}"
          f" devices): {outcome} in {seconds:.1f} s", file=sys.stderr, flush=True)
    return result


def _job_result(argv: list[str], env: dict) -> dict:
    try:
        done = run_job(argv, REPO, env, TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {TIMEOUT_S} s: {' '.join(argv)}"}
    line = next((line for line in done.stdout.splitlines() if "GPUCHECK " in line), None)
    if done.returncode != 0 or line is None:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        return {"error": f"exit {done.returncode}: {' '.join(argv)}\n{tail}"}
    return json.loads(line.split("GPUCHECK ", 1)[1])


def crew_launcher(ranks: int) -> list[str]:
    return [sys.executable, "-m", "crew", "run", "--num_gpus", str(ranks), "--as_deepspeed"]


def deepspeed_launcher(python: str, ranks: int, cpu: bool) -> list[str]:
    """DeepSpeed's own launcher; on the CPU (--cpu) torchrun, as DeepSpeed's launcher wants GPUs."""
    if cpu:
        return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    return [python, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks)]


def machine_line(cpu: bool) -> str:
    if cpu:
        return f"rehearsal on the CPU (--cpu): torch {torch.__version__}, gloo"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {len(names)} GPU(s): {', '.join(names)}"


def within(losses: list[float], reference: list[float], precision: str) -> bool:
    return len(losses) == len(reference) and all(
        abs(a - b) <= TOLERANCE[precision] * max(abs(b), 1e-3) for a, b in zip(losses, reference))


def training_rows(launcher, ranks: int, env: dict, cpu_env: dict, quick: bool) -> list[dict]:
    stages = (0, 3) if quick else (0, 1, 2, 3)
    reference = {stage: one_job(crew_launcher(ranks), ["--stage", str(stage)], cpu_env) for stage in stages}
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        for stage in stages:
            result = one_job(launcher, ["--precision", precision, "--stage", str(stage)], env)
            ref = reference[stage]
            if "error" not in result and "error" not in ref:
                result["matches_cpu"] = within(result["losses"], ref["losses"], precision)
            rows.append({"precision": precision, "stage": stage, **result})
    return rows


def feature_rows(launcher, env: dict) -> list[dict]:
    return [{"feature": feature, "stage": stage,
             **one_job(launcher, ["--feature", feature, "--stage", str(stage)], env)} for feature, stage in FEATURES]


def doctor_row(env: dict) -> dict:
    done = run_job([sys.executable, "-m", "crew", "doctor", "--json"], REPO, env, 120)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"error": f"crew doctor exited {done.returncode}: {done.stderr[-500:]}"}
    checks = report["nodes"][0]["checks"]
    return {"ok": report["ok"], **{name: f"{c['status']}: {c['value']} {c.get('detail', '')}".strip()
                                   for name, c in checks.items()}}


def cuda_test_files() -> list[str]:
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                  if "mark.cuda" in path.read_text())


def cuda_tests(env: dict) -> dict:
    """`pytest -m cuda` over the test files that mark a test so: the GPU machines' own Python may lack what
    the rest of the suite imports (trl, datasets), and a collection error there would hide these results."""
    done = run_job([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                    *cuda_test_files()], REPO, env, 300)
    lines = done.stdout.strip().splitlines() or ["(no output)"]
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {"exit": done.returncode, "summary": lines[-1], "failures": failures,
            **({"tail": "\n".join(lines[-40:])} if done.returncode not in (0, 5) else {})}


def format_report(report: dict) -> str:
    lines = [f"crew gpu-check · {report['machine']} · {report['ranks']} rank(s) · {report['seconds']:.0f} s"]
    if report.get("allreduce"):
        lines.append(f"\nall-reduce bus bandwidth ({'gloo' if 'rehearsal' in report['machine'] else 'NCCL'}):")
        lines += [f"  {row['mb']:>6g} MB  {row['ms']:8.3f} ms  {row['busbw_gbs']:7.1f} GB/s"
                  for row in report["allreduce"].get("rows", [])] or [f"  {report['allreduce']}"]
    for name, rows in (("crew", report["training"]), ("deepspeed", report.get("deepspeed") or [])):
        if rows:
            lines.append(f"\ntraining, {name} (losses against the CPU's fp32 run, tolerance {TOLERANCE}):")
            lines += [_train_line(row) for row in rows]
    lines.append("\nfeatures:")
    for row in report["features"]:
        extra = f", pinned batches {row['pinned']}" if row["feature"] == "pinned_loader" and "pinned" in row else ""
        lines.append(f"  {row['feature']:<18} stage {row['stage']}: " + (_failed(row) if "error" in row else
                     f"ok, {row['step_ms']:.1f} ms/step, peak {_peaks(row)}{extra}"))
    lines.append(f"\ncrew doctor: {json.dumps(report['doctor'])}")
    tests = report["cuda_tests"]
    lines.append(f"CUDA-only tests (pytest -m cuda): {tests['summary']}")
    lines += [f"  {line}" for line in tests.get("failures", [])]
    if "tail" in tests:
        lines.append("  " + tests["tail"].replace("\n", "\n  "))
    return "\n".join(lines)


def _train_line(row: dict) -> str:
    head = f"  {row['precision']:<5} ZeRO {row['stage']}: "
    if "error" in row:
        return head + _failed(row)
    match = {True: "losses match", False: "LOSSES DIFFER", None: "no reference"}[row.get("matches_cpu")]
    return head + f"{row['step_ms']:8.1f} ms/step, peak {_peaks(row)}, {match} (last {row['losses'][-1]:.5f})"


def _peaks(row: dict) -> str:
    return "/".join(f"{p:.0f}" for p in row["peak_mib"]) + " MiB"


def _failed(row: dict) -> str:
    return "FAILED: " + row["error"].replace("\n", "\n      ")


def passed(report: dict) -> bool:
    rows = [*report["training"], *report["features"], *(report.get("deepspeed") or [])]
    bad_rows = [row for row in rows if "error" in row or row.get("matches_cpu") is False]
    return not bad_rows and report["cuda_tests"]["exit"] in (0, 5)  # 5: no CUDA-only test collected


def main(argv: list[str] | None = None) -> int:
    global TIMEOUT_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="rehearse every check on the CPU (gloo)")
    parser.add_argument("--quick", action="store_true", help="ZeRO 0 and 3 only")
    parser.add_argument("--deepspeed_python", help="a Python with deepspeed installed, for the side-by-side rows")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--job_timeout", type=float, default=TIMEOUT_S, help=f"seconds per job [{TIMEOUT_S}]")
    args = parser.parse_args(argv)
    TIMEOUT_S = args.job_timeout
    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check. Run it "
              "on a machine with a GPU (`make gpu-check`); `--cpu` rehearses it on the CPU.")
        return 0
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    cpu_env = {**env, "CUDA_VISIBLE_DEVICES": ""}
    if args.cpu:
        env = cpu_env
    ranks = 2 if args.cpu or torch.cuda.device_count() >= 2 else 1
    launcher = crew_launcher(ranks)
    report = {"machine": machine_line(args.cpu), "ranks": ranks,
              "allreduce": one_job(launcher, ["--mode", "allreduce"], env) if ranks > 1 else None,
              "training": training_rows(launcher, ranks, env, cpu_env, args.quick),
              "features": feature_rows(launcher, env), "doctor": doctor_row(env), "cuda_tests": cuda_tests(env)}
    if args.deepspeed_python:
        ds_env = {**env, "DS_ACCELERATOR": "cpu"} if args.cpu else env
        report["deepspeed"] = training_rows(deepspeed_launcher(args.deepspeed_python, ranks, args.cpu), ranks,
                                            ds_env, cpu_env, quick=True)
    report["seconds"] = time.monotonic() - started
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
