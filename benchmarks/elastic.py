"""Time to resume after a lost node: `crew run --min_nodes 1 --max_restarts 1` against torchrun's elastic agent
(`--nnodes 1:2`, c10d rendezvous). DeepSpeed 0.19 has no elastic training: its job just ends.

Two throwaway sshd "nodes" on 127.0.0.2 and 127.0.0.3 (tests/sshnodes.py), one rank each, run
benchmarks/_elastic_job.py (plain DDP, gloo, a checkpoint after every step, loaded at every start). After
step --lose_at the harness loses node 2 as if its power failed: SIGKILL to its sshd and everything under it
(the login, the agent or torchrun, the rank). The clock starts then. Columns, seconds after the loss:

* noticed: crew says which node it lost (crew only; torchrun says nothing this plain);
* re-checked: crew has checked every node again and chosen the new world (crew only);
* resumed: rank 0 of the new world has joined the process group and loaded the checkpoint;
* first step: rank 0 of the new world has finished its first step — the figure the issue asks for.

torchrun is started on each node over ssh (it has no multi-node launcher), node 2 once node 1 hosts the
rendezvous, so that the store lives on node 1, which survives (torchrun cannot survive losing its
rendezvous host). Its agent notices the failed worker, re-forms the rendezvous and, with fewer than
--nnodes' maximum present, waits out its last call before it continues.

    .venv/bin/python benchmarks/elastic.py               # 3 runs each
    .venv/bin/python benchmarks/elastic.py --repeat 1 --width 2048
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_elastic_job.py"
sys.path.insert(0, str(REPO / "tests"))

import sshnodes  # noqa: E402  (tests/sshnodes.py, importable once tests/ is on sys.path)

STEP_RE = re.compile(r"BENCH_STEP ([1-9]\d*) (\d+) (\d+) (\d+\.\d+)")  # a restarted attempt's steps
RESUMED_RE = re.compile(r"BENCH_RESUMED ([1-9]\d*) (\d+\.\d+)")
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
COLUMNS = ("noticed", "re-checked", "resumed", "first step")


class Lines:
    """Every line a process writes, with the time.time() it arrived."""

    def __init__(self, *streams):
        self.lines: list[tuple[float, str]] = []
        self.threads = [threading.Thread(target=self._read, args=(s,), daemon=True) for s in streams]
        for thread in self.threads:
            thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, pattern: str | re.Pattern, after: float = 0.0) -> tuple[float, re.Match] | None:
        for at, line in list(self.lines):
            match = re.search(pattern, line)
            if match and at >= after:
                return at, match
        return None


def crew_argv(cluster: sshnodes.Cluster, job_args: list[str]) -> list[list[str]]:
    return [[sys.executable, "-m", "crew", "run", "-H", str(cluster.hostfile(slots=1)), "--ssh_args",
             cluster.ssh_args, "--min_nodes", "1", "--max_restarts", "1", str(JOB), *job_args]]


def torchrun_argv(cluster: sshnodes.Cluster, job_args: list[str], workdir: Path,
                  rendezvous: tuple[str, int]) -> list[list[str]]:
    endpoint = f"{rendezvous[0]}:{rendezvous[1]}"
    argvs = []
    for address in cluster.addresses:
        remote = (f"cd {shlex.quote(str(workdir))} && exec {shlex.quote(sys.executable)} -m torch.distributed.run "
                  f"--nnodes 1:{len(cluster.addresses)} --nproc_per_node 1 --rdzv_backend c10d "
                  f"--rdzv_endpoint {endpoint} --rdzv_id elastic-bench --max_restarts 1 "
                  f"{shlex.quote(str(JOB))} {shlex.join(job_args)}")
        argvs.append(["ssh", *SSH_OPTIONS, "-F", str(cluster.config), address, remote])
    return argvs


def one_run(launcher: str, job_args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="crew-elastic-") as tmp:
        root = Path(tmp)
        workdir = root / "job"
        workdir.mkdir()
        cluster = sshnodes.start_cluster(root / "nodes", 2)
        try:
            if launcher == "crew":
                argvs, endpoint = crew_argv(cluster, job_args), None
            else:
                endpoint = (cluster.addresses[0], sshnodes.free_port_on([cluster.addresses[0]]))
                argvs = torchrun_argv(cluster, job_args, workdir, endpoint)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            procs = []
            for argv in argvs:
                procs.append(subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              start_new_session=True))
                if endpoint and len(procs) == 1:
                    _wait_listening(*endpoint, timeout)
            lines = Lines(*(p.stdout for p in procs), *(p.stderr for p in procs))
            return _measure(launcher, cluster, workdir, procs, lines, timeout)
        finally:
            _kill_everything_in(workdir)
            cluster.stop()


def _wait_listening(address: str, port: int, timeout: float) -> None:
    """Until node 1's torchrun hosts the rendezvous store. Every loopback "node" is this machine, so node 2's
    torchrun would host it too if it came first (on real machines only node 1 can), and take it down with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex((address, port)) == 0:
                return
        time.sleep(0.05)


def _measure(launcher, cluster, workdir: Path, procs, lines: Lines, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not (workdir / "ready").exists():
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            return {"error": "the job never reached the step at which a node is lost:\n" + _tail(lines)}
        time.sleep(0.02)
    lost_at = time.time()
    cluster.lose_node(cluster.addresses[1])
    (workdir / "killed").touch()
    for proc in procs[:1]:  # crew, or node 1's torchrun: node 2's ssh ended with its node
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"{launcher} did not finish within {timeout:.0f} s:\n" + _tail(lines)}
    for thread in lines.threads:
        thread.join(timeout=5)
    first = lines.first(STEP_RE, lost_at)
    if procs[0].returncode != 0 or first is None:
        return {"error": f"{launcher} exited with {procs[0].returncode}, no step after the loss:\n" + _tail(lines)}
    resumed = lines.first(RESUMED_RE, lost_at)
    noticed = lines.first("lost: ", lost_at)
    rechecked = lines.first("continuing on ", lost_at)
    return {"noticed": noticed and noticed[0] - lost_at, "re-checked": rechecked and rechecked[0] - lost_at,
            "resumed": resumed and float(resumed[1].group(2)) - lost_at,
            "first step": float(first[1].group(4)) - lost_at, "world": int(first[1].group(3))}


def _kill_everything_in(folder: Path) -> None:
    """Whatever still runs with `folder` as its working directory (a run that timed out)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "cwd") == str(folder):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue


def _tail(lines: Lines, count: int = 30) -> str:
    return "\n".join(f"    {line}" for _, line in lines.lines[-count:])


def table(results: dict[str, list[dict]]) -> str:
    rows = [f"{'launcher':<10}" + "".join(f"{c:>14}" for c in COLUMNS) + f"{'new world':>11}{'ok runs':>9}"]
    for launcher, runs in results.items():
        good = [r for r in runs if "error" not in r]
        cells = []
        for column in COLUMNS:
            values = [r[column] for r in good if r.get(column) is not None]
            cells.append(f"{statistics.median(values):>13.2f}s" if values else f"{'-':>14}")
        world = ", ".join(sorted({str(r["world"]) for r in good})) or "-"
        rows.append(f"{launcher:<10}" + "".join(cells) + f"{world:>11}{len(good):>6}/{len(runs)}")
    rows.append(f"{'deepspeed':<10}  no restart: elastic training was removed in 0.19; the job ends with the node")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--width", type=int, default=512, help="the MLP's width (its checkpoint grows as width²)")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--launchers", default="crew,torchrun")
    args = parser.parse_args(argv)
    reason = sshnodes.sshd_missing_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    job_args = ["--width", str(args.width)]
    launchers = args.launchers.split(",")
    results: dict[str, list[dict]] = {name: [] for name in launchers}
    for _ in range(args.repeat):
        for launcher in launchers:  # interleaved: drift hits both alike
            result = one_run(launcher, job_args, args.timeout)
            if "error" in result:
                print(f"{launcher}: failed run\n{result['error']}", file=sys.stderr)
            results[launcher].append(result)
    print(f"time to resume after losing node 2 of 2 (1 rank each, MLP width {args.width}, median of "
          f"{args.repeat}; seconds after the loss)")
    print(table(results))
    return 0 if all("error" not in r for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
