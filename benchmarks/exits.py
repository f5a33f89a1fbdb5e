"""Exit reliability: how many finished 2-rank jobs fail at interpreter exit, under crew and under torchrun.

A script that leaves its DDP model and process group alive at exit, as most scripts do, can abort after
it trained fine ("terminate called without an active exception", SIGABRT, exit 134): gloo's worker
thread destroys the last all-reduce while Python is already finalizing (see
crew/launcher/node/site/sitecustomize.py). This runs N short jobs of such a script under each launcher,
interleaved, and counts clean exits, aborts and other failures.

Scripts (--script, repeatable):

* plain: torch.distributed + DDP(Linear(64, 64)), three SGD steps, nothing torn down at exit;
* buckets: the same with eight layers and tiny DDP buckets, ending in the backward (the worst case);
* accelerate: an `accelerate.Accelerator` script (prepare, backward, step), model alive at exit
  (skipped when accelerate is not installed; ACCELERATE_USE_CPU=true under both launchers).

Run from the repository root:

    .venv/bin/python benchmarks/exits.py                      # 30 jobs of each script per launcher
    .venv/bin/python benchmarks/exits.py --jobs 100 --script buckets
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "plain": """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(64, 64))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        print("trained", dist.get_rank())
    """,
    "buckets": """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]), bucket_cap_mb=0.01)
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
    """,
    "accelerate": """
        import torch
        from accelerate import Accelerator
        accelerator = Accelerator()
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        for _ in range(3):
            accelerator.backward(model(torch.randn(8, 64)).sum())
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print("trained", accelerator.num_processes)
    """,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def argv(launcher: str, script: Path) -> list[str]:
    if launcher == "crew":
        return [sys.executable, "-m", "crew", "run", "--num_gpus", "2", str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script)]


def outcome(code: int, stderr: str) -> str:
    """clean, abort (the exit abort: SIGABRT after 'terminate called'), or failed."""
    if code == 0:
        return "clean"
    aborted = "terminate called without an active exception" in stderr
    return "abort" if aborted or code in (128 + signal.SIGABRT, -signal.SIGABRT) else "failed"


def run_one(launcher: str, script: Path, env: dict) -> tuple[str, float]:
    started = time.monotonic()
    proc = subprocess.run(argv(launcher, script), cwd=script.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    result = outcome(proc.returncode, proc.stderr)
    if result == "failed":
        tail = "\n    ".join(proc.stderr.strip().splitlines()[-5:])
        print(f"{launcher} {script.name}: exit code {proc.returncode}:\n    {tail}")
    return result, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=30, help="jobs per script and launcher (default 30)")
    parser.add_argument("--script", action="append", choices=sorted(SCRIPTS), help="default: all")
    args = parser.parse_args()
    names = args.script or sorted(SCRIPTS)
    if "accelerate" in names and importlib.util.find_spec("accelerate") is None:
        print("accelerate is not installed: its script is skipped")
        names.remove("accelerate")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            script = Path(folder, f"job_{name}.py")  # not accelerate.py: it would shadow the package
            script.write_text(textwrap.dedent(SCRIPTS[name]))
            counts = {launcher: Counter() for launcher in ("crew", "torchrun")}
            seconds = {launcher: 0.0 for launcher in counts}
            for _ in range(args.jobs):
                for launcher in counts:  # interleaved: load on the machine hits both alike
                    result, took = run_one(launcher, script, env)
                    counts[launcher][result] += 1
                    seconds[launcher] += took
            rows += [(name, launcher, counts[launcher], seconds[launcher] / args.jobs) for launcher in counts]
    print(f"\n{'script':<11} {'launcher':<9} {'jobs':>5} {'clean':>6} {'aborted':>8} {'failed':>7} {'abort rate':>11}"
          f" {'s/job':>6}")
    for name, launcher, count, per_job in rows:
        total = sum(count.values())
        print(f"{name:<11} {launcher:<9} {total:>5} {count['clean']:>6} {count['abort']:>8} {count['failed']:>7} "
              f"{count['abort'] / total:>10.0%} {per_job:>6.2f}")
    return 1 if any(count["abort"] or count["failed"] for _, launcher, count, _ in rows if launcher == "crew") else 0


if __name__ == "__main__":
    sys.exit(main())
