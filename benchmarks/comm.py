"""Bytes and calls of one optimizer step at every ZeRO stage: crew beside DeepSpeed 0.19.8.

The same DeepSpeed script (benchmarks/_comm_job.py: deepspeed.initialize with a config dict, "Adam" with
torch_adam, bf16 or fp32, an MLP of 3 blocks Linear(w, 4w), GELU, Linear(4w, w): 25.2M parameters at w = 1024,
1.6M with --small; at stage 3 built under deepspeed.zero.Init) runs under `crew run --as_deepspeed` and, where
DeepSpeed's venv exists, under its torchrun (DS_ACCELERATOR=cpu), on 2 and 4 CPU ranks (gloo). Each job
measures several configurations one after the other: it steps --measure_step optimizer steps untouched
(start-up, DeepSpeed's stage-3 trace on the first step) and counts the next one, all its micro steps, with
tests/commcount.py: wrappers on torch.distributed's collectives (payload, group size) cross-checked against
torch.profiler's c10d ops; an op issued from C++ (DDP's reducer at stages 0-1) is counted from the profiler.
A `_coalescing_manager` block, all_reduce_coalesced and all_gather_coalesced count as one call, as the
backend gets one op (the profiler's `*_coalesced_`).

Per rank per optimizer step: bus bytes in units of Ψ (parameter bytes in the training dtype: 2 bytes per
parameter in bf16, 4 in fp32), with nccl-tests' factors for n ranks (all_reduce 2(n-1)/n of the tensor,
all_gather (n-1)/n of the output, reduce_scatter (n-1)/n of the input, broadcast and reduce 1), and calls.
Variants: `no_mrb` = "use_multi_rank_bucket_allreduce": false (stages 1-2), `7b` = a 7B model's stage-3
thresholds as HF's "auto" sets them (h = 4096: stage3_prefetch_bucket_size 0.9 h², stage3_param_persistence_
threshold 10 h). Peak RSS: ru_maxrss of the worst rank after a job's first configuration (bf16, the largest
accumulation, no variant).

    .venv/bin/python benchmarks/comm.py --small --ranks 2        # a first look, ~3 minutes
    .venv/bin/python benchmarks/comm.py                          # everything, 25M parameters, 2 and 4 ranks
    .venv/bin/python benchmarks/comm.py --stages 3 --dtypes bf16 --ranks 4 --libraries crew

Last run (fb9994c, 25.2M, all of it in 683 s with --parallel 2; cd0a0c2 before the issue's changes in brackets),
bf16 on 4 ranks, crew GA=1 | DeepSpeed GA=1 | crew GA=4 | DeepSpeed GA=4:

    stage 0       : 1.50Ψ (1)  [3]          | 1.50Ψ (1)  | 1.50Ψ (1)  [3]           | 1.50Ψ (1)
    stage 1       : 2.33Ψ (5)  [2.50Ψ (12)] | 2.25Ψ (4)  | 2.33Ψ (5)  [2.50Ψ (12)]  | 2.25Ψ (4)
    stage 1 no_mrb: 2.33Ψ (5)               | 1.75Ψ (7)  | 2.33Ψ (5)                | 1.75Ψ (7)
    stage 2       : 2.33Ψ (5)  [2.50Ψ (16)] | 2.25Ψ (4)  | 6.83Ψ (8)  [7.00Ψ (37)]  | 6.75Ψ (7)
    stage 2 no_mrb: 1.83Ψ (8)  [2.50Ψ (16)] | 1.75Ψ (7)  | 4.83Ψ (20) [7.00Ψ (37)]  | 4.75Ψ (19)
    stage 3       : 1.50Ψ (14) [3.00Ψ (19)] | 1.50Ψ (9)  | 6.00Ψ (50) [12.00Ψ (73)] | 6.00Ψ (15)
    stage 3 7b    : 1.50Ψ (14) [3.00Ψ (19)] | 1.50Ψ (10) | 6.00Ψ (50) [12.00Ψ (73)] | 6.00Ψ (19)

Peak RSS at stage 3, bf16, GA 4, 4 ranks: crew 1.76 GB, DeepSpeed 1.16 GB per rank ([1.39 / 1.08]). The 7B
projection (2 nodes x 8 GPUs, 100 Gbit/s): the same seconds for both at every stage but stage 1 with
use_multi_rank_bucket_allreduce false (crew 3.2 s, DeepSpeed 2.2 s: crew's stage 1 does not read the key).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _jobs import run_job  # beside this script: on its sys.path

JOB = Path(__file__).resolve().parent / "_comm_job.py"
DS_TORCHRUN = Path("/opt/dsvenv/bin/torchrun")
H_7B = 4096
VARIANTS = {
    "no_mrb": {"use_multi_rank_bucket_allreduce": False},
    "7b": {"stage3_prefetch_bucket_size": int(0.9 * H_7B * H_7B), "stage3_param_persistence_threshold": 10 * H_7B},
}
SHORT = {"all_reduce": "ar", "reduce": "rd", "broadcast": "bc", "all_gather": "ag", "reduce_scatter": "rs",
         "all_to_all": "a2a", "gather": "ga", "scatter": "sc", "p2p": "p2p"}
# the projection: a 7B model in bf16 on 2 nodes x 8 GPUs, 100 Gbit/s per node
PSI_7B, RANKS_7B, LINK_BYTES_S = 7e9 * 2, 16, 100e9 / 8


def runs_of(stage: int, dtypes: list[str], gas: list[int]) -> list[dict]:
    """A job's configurations; the first (bf16, largest accumulation, no variant) is the RSS one."""
    variants = [None] + (["no_mrb"] if stage in (1, 2) else ["7b"] if stage == 3 else [])
    order = sorted(dtypes, key=lambda d: d != "bf16")
    runs = []
    for dtype in order:
        for ga in sorted(gas, reverse=True):
            for variant in variants:
                run = {"stage": stage, "dtype": dtype, "ga": ga, "variant": variant or ""}
                runs.append({**run, "zero": VARIANTS[variant]} if variant else run)
    return runs


def command(library: str, ranks: int, runs: list[dict], tag: str, out: str, args) -> tuple[list[str], dict]:
    job = [str(JOB), "--runs", json.dumps(runs), "--tag", tag, "--out", out, "--width", str(args.width),
           "--measure_step", str(args.measure_step)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if library == "crew":
        return [sys.executable, "-m", "crew", "run", "--num_gpus", str(ranks), "--as_deepspeed", *job], env
    env.pop("PYTHONPATH", None)  # a crew checkout there must not answer DeepSpeed's venv
    return [str(DS_TORCHRUN), "--standalone", "--nproc_per_node", str(ranks), *job], {**env, "DS_ACCELERATOR": "cpu"}


def one_job(library: str, ranks: int, stage: int, args, out: str) -> tuple[tuple, list | str]:
    """Runs one job; returns its key and [per-rank results of each run] or why it failed."""
    key = (library, ranks, stage)
    tag = f"{library}-{ranks}-{stage}"
    argv, env = command(library, ranks, runs_of(stage, args.dtypes, args.ga), tag, out, args)
    try:
        done = run_job(argv, None, env, args.timeout)
    except Exception as error:  # a timeout: the row says so, the others still run
        return key, f"failed: {error}"
    files = [Path(out) / f"{tag}.rank{r}.json" for r in range(ranks)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        lines = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if "Error" in line]
        return key, f"failed ({done.returncode}): {(lines or ['no output'])[-1][-200:]}"
    per_rank = [json.loads(f.read_text()) for f in files]
    return key, [list(runs) for runs in zip(*per_rank)]  # [run][rank]


def run_all(args) -> dict:
    libraries = [lib for lib in args.libraries if lib == "crew" or DS_TORCHRUN.exists()]
    keys = [(lib, ranks, stage) for ranks in args.ranks for stage in args.stages for lib in libraries]
    with tempfile.TemporaryDirectory() as out, ThreadPoolExecutor(args.parallel) as pool:
        results = dict(pool.map(lambda key: one_job(*key, args, out), keys))
    return results


# --------------------------------------------------------------------------------------------------
# the tables


def psi(result: dict) -> int:
    return result["params"] * result["dtype_bytes"]


def kinds(result: dict) -> dict[str, dict]:
    return {k: v for k, v in result["counts"].items() if k in SHORT}


def totals(result: dict) -> tuple[float, int]:
    by_kind = kinds(result)
    return sum(v["bus_bytes"] for v in by_kind.values()) / psi(result), sum(v["calls"] for v in by_kind.values())


def same_on_all_ranks(per_rank: list[dict]) -> bool:
    first = kinds(per_rank[0])
    return all({k: (v["calls"], round(v["bus_bytes"])) for k, v in kinds(r).items()} ==
               {k: (v["calls"], round(v["bus_bytes"])) for k, v in first.items()} for r in per_rank)


def cell(per_rank: list[dict] | None) -> tuple[str, str]:
    """(total, breakdown) of rank 0; '*' where the ranks differ (the breakdown is then the worst rank's)."""
    if per_rank is None:
        return "-", ""
    worst = max(per_rank, key=lambda r: totals(r)[0])
    mark = "" if same_on_all_ranks(per_rank) else "*"
    bus, calls = totals(worst)
    breakdown = " ".join(f"{SHORT[k]} {v['bus_bytes'] / psi(worst):.2f}({v['calls']})" for k, v in kinds(worst).items())
    barriers = worst["counts"].get("barrier", {}).get("calls", 0)
    return f"{bus:.2f}Ψ ({calls}){mark}", breakdown + (f" +{barriers} barrier" if barriers else "")


def rows(results: dict, args) -> dict[tuple, dict[str, list[dict]]]:
    """{(ranks, stage, dtype, ga, variant): {library: per-rank results}}."""
    table: dict[tuple, dict[str, list[dict]]] = {}
    for (library, ranks, stage), job in results.items():
        if isinstance(job, str):
            continue
        for per_rank in job:
            first = per_rank[0]
            key = (ranks, stage, first["dtype"], first["ga"], first["variant"])
            table.setdefault(key, {})[library] = per_rank
    return dict(sorted(table.items(), key=lambda item: (item[0][0], item[0][1], item[0][2] != "bf16",
                                                          item[0][3], item[0][4])))


def count_table(table: dict, results: dict) -> None:
    header = (f"{'ranks':>5} {'stage':>5} {'dtype':<5} {'GA':>2} {'variant':<7} | {'crew':>13} | {'DeepSpeed':>13} | "
              "crew by kind | DeepSpeed by kind")
    print(header)
    print("-" * len(header))
    for (ranks, stage, dtype, ga, variant), by_library in table.items():
        crew, ds = cell(by_library.get("crew")), cell(by_library.get("deepspeed"))
        print(f"{ranks:>5} {stage:>5} {dtype:<5} {ga:>2} {variant:<7} | {crew[0]:>13} | {ds[0]:>13} | "
              f"{crew[1]} | {ds[1]}")
    for key, job in results.items():
        if isinstance(job, str):
            print(f"{key[0]} on {key[1]} ranks, stage {key[2]}: {job}")


def issue_table(table: dict) -> None:
    """The issue's layout: per stage and variant, bf16 at the largest rank count, crew | DeepSpeed per GA."""
    ranks = max((key[0] for key in table), default=None)
    picked = {key[1:]: by_library for key, by_library in table.items() if key[0] == ranks and key[2] == "bf16"}
    gas = sorted({key[2] for key in picked})
    if not picked:
        return
    print(f"bf16, {ranks} ranks: " + " | ".join(f"{lib} GA={ga}" for ga in gas for lib in ("crew", "DeepSpeed")))
    for stage, variant in dict.fromkeys((key[0], key[3]) for key in picked):
        cells = [cell(picked.get((stage, "bf16", ga, variant), {}).get(lib))[0]
                 for ga in gas for lib in ("crew", "deepspeed")]
        print(f"stage {stage}{f' {variant}' if variant else '':<7}: " + " | ".join(cells))


def check_lines(results: dict) -> None:
    """The profiler's cross-check: which jobs had ops issued from C++, and any disagreement."""
    from_cpp, disagree = set(), []
    for (library, ranks, stage), job in results.items():
        for per_rank in job if not isinstance(job, str) else []:
            for r, result in enumerate(per_rank):
                check = result["counts"]["check"]
                if check.get("issued_from_cpp"):
                    from_cpp.add(f"{library} stage {stage}: {check['issued_from_cpp']}")
                if not check.get("agree", True):
                    disagree.append(f"{library} {ranks} ranks stage {stage} {result['dtype']} GA {result['ga']} "
                                    f"rank {r}: wrapped {check['wrapped_calls']}, profiler {check['profiler_ops']}")
    print("profiler cross-check: every wrapped call matched one c10d op" if not disagree else
          "profiler cross-check DISAGREES:\n  " + "\n  ".join(disagree))
    for line in sorted(from_cpp):
        print(f"  ops issued from C++ (counted from the profiler, payload from gloo's event): {line}")


def rss_table(table: dict) -> None:
    print(f"{'ranks':>5} {'stage':>5} {'config':<12} | {'crew GB':>8} | {'DeepSpeed GB':>12}")
    for (ranks, stage, dtype, ga, _), by_library in table.items():
        firsts = {lib: per_rank for lib, per_rank in by_library.items() if per_rank[0].get("rss_first")}
        if not firsts:
            continue
        gb = {lib: f"{max(r['rss'] for r in per_rank) / 1e9:.2f}" for lib, per_rank in firsts.items()}
        print(f"{ranks:>5} {stage:>5} {f'{dtype} GA {ga}':<12} | {gb.get('crew', '-'):>8} | "
              f"{gb.get('deepspeed', '-'):>12}")


def projected_seconds(per_rank: list[dict]) -> float:
    """One step's communication seconds for the 7B job: the measured payload per kind in Ψ, times the bus
    factor at 16 ranks, times Ψ_7B, over the link."""
    from commcount import bus_factor

    worst = max(per_rank, key=lambda r: totals(r)[0])
    multiple = sum(v["payload_bytes"] / psi(worst) * bus_factor(k, RANKS_7B) for k, v in kinds(worst).items())
    return multiple * PSI_7B / LINK_BYTES_S


def projection(table: dict) -> None:
    measured = max((key[0] for key in table), default=None)
    picks = [(key, by_library) for key, by_library in table.items() if key[0] == measured and key[2] == "bf16"]
    if not picks:
        return
    print(f"Projection: communication seconds per optimizer step, 7B parameters in bf16 (Ψ = 14 GB), 2 nodes x 8 GPUs,"
          f"\n100 Gbit/s per node; from the {measured}-rank payloads per kind, with nccl-tests' bus factors at 16 ranks"
          "\n(all_reduce 1.875, all_gather/reduce_scatter 0.9375, broadcast 1); assumptions: one ring over the 16 ranks"
          "\ncrossing the nodes twice, each crossing at the node's full line rate (12.5 GB/s), intra-node hops free,"
          "\nno overlap with compute, no latency term; seconds = bus bytes / 12.5 GB/s.")
    print(f"{'stage':>5} {'GA':>2} {'variant':<7} | {'crew s':>7} | {'DeepSpeed s':>11}")
    for (_, stage, _, ga, variant), by_library in picks:
        secs = {lib: f"{projected_seconds(per_rank):.1f}" for lib, per_rank in by_library.items()}
        print(f"{stage:>5} {ga:>2} {variant:<7} | {secs.get('crew', '-'):>7} | {secs.get('deepspeed', '-'):>11}")


def report(results: dict, args, wall_s: float) -> None:
    for job in results.values():  # a job's first run is the one whose RSS is its own
        if not isinstance(job, str):
            for r in job[0]:
                r["rss_first"] = True
    table = rows(results, args)
    params = next((per_rank[0]["params"] for by_lib in table.values() for per_rank in by_lib.values()), 0)
    deepspeed = "DeepSpeed 0.19.8 (/opt/dsvenv)" if DS_TORCHRUN.exists() else "DeepSpeed: not installed"
    print(f"MLP 3 x [Linear({args.width}, {4 * args.width}), GELU, Linear({4 * args.width}, {args.width})] = "
          f"{params / 1e6:.1f}M parameters, Adam (torch_adam), micro batch 8, CPU ranks (gloo); crew vs {deepspeed}.")
    print(f"Per rank, one optimizer step (all its micro steps) after {args.measure_step} untouched steps: bus bytes "
          "in Ψ (parameter bytes in the training dtype)\nand calls; by kind: ar all_reduce, ag all_gather, rs "
          "reduce_scatter, bc broadcast, rd reduce; * = ranks differ (worst rank shown).")
    count_table(table, results)
    check_lines(results)
    print()
    issue_table(table)
    print()
    print("Peak RSS of the worst rank after the job's first configuration (ru_maxrss):")
    rss_table(table)
    print()
    projection(table)
    print(f"\nbenchmark wall time: {wall_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="width 256 (1.6M parameters) instead of 1024 (25.2M)")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--ga", default="1,4", help="gradient accumulation steps")
    parser.add_argument("--libraries", default="crew,deepspeed")
    parser.add_argument("--measure_step", type=int, default=3, help="untouched optimizer steps before the counted one")
    parser.add_argument("--parallel", type=int, default=1, help="jobs at a time")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    parser.add_argument("--json", help="also write every rank's raw counts here")
    args = parser.parse_args(argv)
    args.width = 256 if args.small else 1024
    args.ranks, args.stages, args.ga = ([int(x) for x in v.split(",")] for v in (args.ranks, args.stages, args.ga))
    args.dtypes, args.libraries = args.dtypes.split(","), args.libraries.split(",")
    started = time.perf_counter()
    results = run_all(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"-".join(map(str, k)): v for k, v in results.items()}))
    report(results, args, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # commcount's bus_factor
    sys.exit(main())
