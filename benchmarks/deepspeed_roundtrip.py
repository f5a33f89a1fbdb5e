"""DeepSpeed -> crew -> DeepSpeed: checkpoints cross between the engines both ways at ZeRO stages 0-3 (fp32, and
bf16, which DeepSpeed runs on a CPU), and the tools that read checkpoint folders read crew's. Needs a Python with
DeepSpeed 0.19.8 (and Lightning for its converter); crew never imports it.

    .venv/bin/python benchmarks/deepspeed_roundtrip.py [--deepspeed_python /opt/dsvenv/bin/python] [--out DIR]

One job, benchmarks/_deepspeed_roundtrip_job.py, runs under both engines (2 CPU ranks, gloo), each phase one pair
of processes for all cases: DeepSpeed trains and saves, then resumes itself (its own next losses); crew resumes
the same checkpoint (DS->crew: crew's losses against DeepSpeed's own resume), saves, and trains on; DeepSpeed
loads crew's checkpoint (crew->DS: its losses against crew's own next ones). Then DeepSpeed's zero_to_fp32 and
ds_to_universal, and Lightning's convert_zero_checkpoint_to_fp32_state_dict (with DeepSpeed, and on crew's shim),
read crew's checkpoint; their weights are compared with crew's fp32 masters at the save ("ok": bitwise equal).
Prints one table; a phase or case that fails is a cell saying why, not a traceback.

Last run (2 CPU ranks, DeepSpeed 0.19.8 with its CPU Adam for "Adam", torch 2.13, crew at 5bebd8f..aefcbe4, 2m20s):

    stage | precision | DS->crew | crew->DS | tools on crew's checkpoint
    0     | fp32      | 1.2e-06  | 5.7e-07  | all n/a: they fail on DeepSpeed's own stage-0 checkpoint too
    0     | bf16      | 0.0e+00  | 0.0e+00  | all n/a, likewise
    1     | fp32      | 1.3e-06  | 5.7e-07  | zero_to_fp32 ok, lightning ok, ds_to_universal ok, lightning_on_crew ok
    1     | bf16      | 0.0e+00  | 0.0e+00  | all ok
    2     | fp32      | 1.4e-06  | 5.7e-07  | all ok
    2     | bf16      | 0.0e+00  | 0.0e+00  | all ok
    3     | fp32      | 1.4e-06  | 5.7e-07  | all ok
    3     | bf16      | 5.3e-05  | 1.3e-04  | all ok
("ok": the tool's weights equal crew's fp32 masters bitwise; the fp32 differences are DeepSpeed's CPU Adam against
torch's AdamW arithmetic, the stage-3 bf16 ones the order of bf16 reductions.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "benchmarks" / "_deepspeed_roundtrip_job.py"
CASES = [f"stage{stage}_{precision}" for stage in range(4) for precision in ("fp32", "bf16")]
DEFAULT_DEEPSPEED = "/opt/dsvenv/bin/python"


def run(argv: list[str], env: dict, timeout: float) -> str | None:
    """None, or why the phase failed (its last stderr line)."""
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode:
        lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith(" ")]
        return f"exit {proc.returncode}: {(lines or ['no output'])[-1][:200]}"
    return None


def phases(deepspeed_python: Path, out: Path, cases: list[str], timeout: float) -> dict[str, str | None]:
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    deepspeed_env = {**base, "DS_ACCELERATOR": "cpu"}
    torchrun = [str(deepspeed_python.parent / "torchrun"), "--standalone", "--nproc_per_node", "2", str(JOB)]
    crew = [str(Path(sys.executable).parent / "crew"), "run", "--num_gpus", "2", "--as_deepspeed", str(JOB)]
    from crew.launcher.node.agent import DEEPSPEED_SHIM
    shim_env = {**base, "PYTHONPATH": os.pathsep.join([DEEPSPEED_SHIM, base.get("PYTHONPATH", "")])}
    selected = ["--cases", ",".join(cases)]
    steps = {
        "ds_save": (torchrun + ["ds_save", str(out)] + selected, deepspeed_env),
        "crew": (crew + ["crew", str(out)] + selected, base),
        "ds_load": (torchrun + ["ds_load", str(out)] + selected, deepspeed_env),
        "tools_deepspeed": ([str(deepspeed_python), str(JOB), "tools", str(out), "--which", "deepspeed"] + selected,
                            deepspeed_env),
        "tools_crew": ([sys.executable, str(JOB), "tools", str(out), "--which", "crew"] + selected, shim_env),
    }
    failed = {}
    for name, (argv, env) in steps.items():
        print(f"[roundtrip] {name} ...", flush=True)
        failed[name] = run(argv, env, timeout)
    return failed


def relative_difference(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs, strict=True))


def cell(results: dict, failed: dict, case: str, phase: str, key: str, against: tuple[str, str]) -> str:
    """The max relative loss difference of `phase`'s `key` against `against`, or why there is none."""
    for name in (against[0], phase):
        if failed.get(name):
            return f"failed: {name} {failed[name]}"
        entry = results.get(name, {}).get(case)
        if entry is None:
            return f"failed: {name} wrote nothing for this case"
        if "error" in entry:
            return f"failed: {entry['error']}"
    return f"{relative_difference(results[phase][case][key], results[against[0]][case][against[1]]):.1e}"


def tools_cell(results: dict, failed: dict, case: str) -> str:
    found = {**results.get("tools_deepspeed", {}).get(case, {}), **results.get("tools_crew", {}).get(case, {})}
    if not found:
        problems = [f"{name}: {failed[name]}" for name in ("tools_deepspeed", "tools_crew") if failed.get(name)]
        return "failed: " + ("; ".join(problems) or "no crew checkpoint to read")
    return ", ".join(f"{tool} {verdict}" for tool, verdict in found.items())


def table(out: Path, failed: dict, cases: list[str]) -> str:
    results = {}
    for name in ("ds_save", "crew", "ds_load", "tools_deepspeed", "tools_crew"):
        path = out / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.is_file() else {}
    rows = [("stage", "precision", "DS->crew max rel loss diff", "crew->DS max rel loss diff",
             "tools on crew's checkpoint")]
    for case in cases:
        stage, precision = case[5], case.split("_")[1]
        rows.append((stage, precision, cell(results, failed, case, "crew", "resume", ("ds_save", "resume")),
                     cell(results, failed, case, "ds_load", "next", ("crew", "next")),
                     tools_cell(results, failed, case)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(" | ".join(value.ljust(width) for value, width in zip(row, widths + [0])).rstrip()
                     for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed_python", type=Path,
                        default=Path(DEFAULT_DEEPSPEED) if Path(DEFAULT_DEEPSPEED).is_file() else None,
                        help=f"a Python with deepspeed 0.19.8 installed (default {DEFAULT_DEEPSPEED} if present)")
    parser.add_argument("--out", type=Path, default=None, help="keep the checkpoints and results here")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, default all: " + ",".join(CASES))
    parser.add_argument("--timeout", type=float, default=900, help="seconds a phase may take")
    args = parser.parse_args()
    if args.deepspeed_python is None or not args.deepspeed_python.is_file():
        print("deepspeed_roundtrip: no DeepSpeed Python (pass --deepspeed_python PATH to one with deepspeed 0.19.8 "
              "installed): nothing to compare against", file=sys.stderr)
        sys.exit(2)
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="roundtrip-") as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        failed = phases(args.deepspeed_python, out, cases, args.timeout)
        print(table(out, failed, cases))


if __name__ == "__main__":
    main()
