"""Stage 3 across two nodes against stage 3 within each node (HSDP: `mics_shard_size` = ranks per node), with a
simulated slow link between the nodes.

4 CPU ranks on this machine, "nodes" of 2 (ranks 0-1, 2-3), crew's engine at ZeRO stage 3 on an MLP
(benchmarks/_hsdp_job.py). The link between the nodes is simulated in each rank: a collective whose group spans
both nodes first sleeps for the link's latency plus the bytes that cross it at the link's bandwidth (ring
algorithms); collectives inside a node cost what they cost. tc netem on the loopback addresses cannot separate
the "nodes" here, since gloo connects the ranks through this machine's own address whatever node they are on.
The table: median step time over the steady steps, and the bytes one rank sends across the link per step.

    .venv/bin/python benchmarks/hsdp.py                       # links: none, 10 and 1 Gbit/s
    .venv/bin/python benchmarks/hsdp.py --width 2048 --gbit 25,1
    .venv/bin/python benchmarks/hsdp.py --stage 2               # stage 2 over the same links (no HSDP row)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _jobs import run_job  # beside this script: on its sys.path

JOB = Path(__file__).resolve().parent / "_hsdp_job.py"
NO_LINK = 1e9  # Gbit/s: no delay to speak of


def one_run(group: int, gbit: float, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "crew", "run", "--num_gpus", "4", str(JOB), "--stage", str(args.stage),
            "--group", str(group), "--gbit", str(gbit), "--latency_ms", str(0 if gbit >= NO_LINK else args.latency_ms),
            "--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
    done = run_job(argv, None, {**os.environ, "OMP_NUM_THREADS": "1"}, args.timeout)
    line = next((line for line in done.stdout.splitlines() if "BENCH " in line), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line.split("BENCH ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=3, choices=(2, 3), help="ZeRO stage (HSDP rows at 3 only)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gbit", default="none,10,1", help="simulated links, Gbit/s ('none': no delay)")
    parser.add_argument("--latency_ms", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    links = [NO_LINK if g == "none" else float(g) for g in args.gbit.split(",")]
    rows = []
    for gbit in links:
        layouts = ((0, f"stage {args.stage} over 4 ranks"), (2, "HSDP, groups of 2"))[:2 if args.stage == 3 else 1]
        for group, name in layouts:
            result = one_run(group, gbit, args)
            steady = result["step_s"][1:]
            rows.append((gbit, name, statistics.median(steady), result["cross_bytes"], result["params"]))
    params = rows[0][4]
    print(f"ZeRO stage {args.stage}, {params / 1e6:.1f}M params (MLP {args.layers} x {args.width}), 4 CPU ranks as "
          f"2 nodes x 2, fp32 AdamW, micro batch 8; latency {args.latency_ms} ms on a simulated link")
    print(f"{'link':>10}  {'layout':<22}{'step (median)':>15}{'MB across the link per rank per step':>40}")
    for gbit, name, step, cross, _ in rows:
        link = "none" if gbit >= NO_LINK else f"{gbit:g} Gbit/s"
        print(f"{link:>10}  {name:<22}{step:>14.3f}s{cross / 2**20:>40.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
