"""`benchmarks/launch.py --runners`: the time `crew run` takes to start 16 ranks and see them exit, per runner.

Four loopback sshd nodes (tests/sshnodes.py: 127.0.0.2-5), 4 slots each, a script that imports nothing and
prints its rank (benchmarks/_noop_job.py), so the figure is the launcher's: from just before `crew run` starts
until it has exited, with the preflight (the default) and with --skip_preflight. Runners: ssh (one ssh login per
node), pdsh, openmpi and mpich (one mpirun starting every node's agent); one that is not installed is listed as
skipped. A run counts only when it exits 0 and all 16 ranks printed their line.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_noop_job.py"
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import sshnodes  # noqa: E402

from crew.errors import LaunchError  # noqa: E402
from crew.launcher.transport import mpi  # noqa: E402

RUNNERS = ("ssh", "pdsh", "openmpi", "mpich")
NODES, SLOTS = 4, 4


def why_not(runner: str) -> str:
    if runner == "pdsh":
        return "" if subprocess.run(["which", "pdsh"], capture_output=True).returncode == 0 else "pdsh not installed"
    if runner in mpi.MPI_RUNNERS:
        try:
            mpi.check(runner)
        except LaunchError as exc:
            return str(exc).split(". ")[0]
    return ""


def one_run(cluster: sshnodes.Cluster, runner: str, preflight: bool, timeout: float) -> float | str:
    """Seconds from start to exit, or why the run does not count."""
    argv = [sys.executable, "-m", "crew", "run", "-H", str(cluster.hostfile(slots=SLOTS)), "--ssh_args",
            cluster.ssh_args, "--launcher", runner, *([] if preflight else ["--skip_preflight"]), str(JOB)]
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - started
    ranks = sorted(int(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if " BENCH_RANK " in line)
    if done.returncode or ranks != list(range(NODES * SLOTS)):
        return f"exit code {done.returncode}, ranks {ranks}:\n{done.stderr[-2000:]}"
    return seconds


def main(repeat: int, timeout: float) -> int:
    reason = sshnodes.sshd_missing_reason()
    if reason:
        print(f"runners: skipped: {reason}")
        return 0
    print(f"start to exit of {NODES * SLOTS} ranks ({NODES} loopback sshd nodes x {SLOTS}, {JOB.name}: no torch), "
          f"{repeat} measured run(s) per cell after one warm-up, {len(os.sched_getaffinity(0))} CPU core(s)",
          flush=True)
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="crew-bench-runners-") as tmp:
        cluster = sshnodes.start_cluster(Path(tmp), NODES)
        try:
            for runner in RUNNERS:
                if skipped := why_not(runner):
                    rows.append([runner, f"skipped: {skipped}", "", "", ""])
                    continue
                cells = []
                for preflight in (True, False):
                    one_run(cluster, runner, preflight, timeout)  # warm-up, not counted
                    runs = [one_run(cluster, runner, preflight, timeout) for _ in range(repeat)]
                    for run in runs:
                        if isinstance(run, str):
                            failed = True
                            print(f"  [{runner}{'' if preflight else ' --skip_preflight'}] FAILED: {run}")
                    good = [run for run in runs if not isinstance(run, str)]
                    cells += [f"{statistics.median(good):.2f}" if good else "-", f"{min(good):.2f}" if good else "-"]
                    print(f"  [{runner}{'' if preflight else ' --skip_preflight'}] "
                          + ", ".join(f"{run:.2f} s" for run in good), flush=True)
                rows.append([runner, *cells])
        finally:
            cluster.stop()
    header = ["runner", "median s", "min s", "median s (--skip_preflight)", "min s (--skip_preflight)"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 1 if failed else 0
