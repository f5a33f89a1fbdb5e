"""Launch overhead of `crew run` against torchrun (and deepspeed, when installed).

What it measures, for a tiny 2-rank CPU job (benchmarks/_tiny_job.py: gloo, DDP Linear(64, 64), a
few SGD steps, one all_reduce):

* wall time: from just before the launcher process is started until it (all of them, for the
  per-node torchrun over ssh) has exited;
* time to the first training step: the job's rank 0 prints time.time() right after its first
  optimizer step; the harness subtracts its own start timestamp (same machine, same clock);
* the thread count rank 0 sees (torch.get_num_threads() and OMP_NUM_THREADS). crew sets
  OMP_NUM_THREADS to cores // local ranks when the user did not; torchrun sets 1 when it starts more
  than one process per node. OMP_NUM_THREADS is removed from the environment the launchers get, so
  their defaults are what is shown.

Cases:

* local: `crew run --num_gpus 2 job.py` vs
  `torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port <free> job.py`
  (vs `deepspeed --num_gpus 2 job.py`).
* ssh: two throwaway sshd "nodes" on 127.0.0.2 and 127.0.0.3 (tests/sshnodes.py), one slot each.
  crew: `crew run -H <hostfile> --ssh_args "-F <ssh_config>" job.py`, and again with
  --skip_preflight, to show what the preflight (ssh, versions, script hash) costs. torchrun has no multi-node
  launcher of its own, so it is started on each node over ssh at the same time
  (`python -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank K ...`), and the wall
  time runs until both ssh sessions have exited. deepspeed (when installed) goes through pdsh.
  Skipped, with the reason, when sshd or the ssh client is missing.

Each launcher first gets --warmup unmeasured runs (default 1; page cache), then each measurement is
repeated --repeat times (interleaved across launchers, so drift hits all of them alike); the table
shows median and min over the successful runs. A failed run (non-zero exit, timeout, no first-step
line) is printed with its stderr, left out of the statistics, counted in the table, and makes the
script exit 1. The target from the issue: crew's median wall time within 1.5 s of torchrun's for
the same job (the last lines print crew - torchrun per case).

Run from the repository root:

    .venv/bin/python benchmarks/launch.py              # 3 repeats
    .venv/bin/python benchmarks/launch.py --quick      # 1 run each, no warm-up
    .venv/bin/python benchmarks/launch.py --repeat 5 --json launch.json
    .venv/bin/python benchmarks/launch.py --runners    # 16 ranks: the ssh, pdsh, openmpi, mpich runners

`--runners` measures something else (benchmarks/_runners_bench.py): how long `crew run` takes to start 16
ranks on 4 loopback sshd nodes and see them exit, per runner, with and without the preflight.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_tiny_job.py"
sys.path.insert(0, str(REPO / "tests"))

import sshnodes  # noqa: E402  (tests/sshnodes.py, importable once tests/ is on sys.path)

BIN = Path(sys.executable).parent  # the venv's bin/, not resolved: keeps the venv's scripts
TARGET_S = 1.5
FIRST_STEP_RE = re.compile(r"BENCH_FIRST_STEP (\d+(?:\.\d+)?)")
THREADS_RE = re.compile(r"BENCH_THREADS (\d+) OMP_NUM_THREADS=(\S+)")
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]


# --------------------------------------------------------------------------------------------------
# one run


@dataclass
class Run:
    ok: bool
    wall_s: float
    first_step_s: float | None = None
    threads: int | None = None
    omp: str | None = None
    error: str = ""


@dataclass
class Case:
    case: str  # local | ssh
    launcher: str  # crew | torchrun | deepspeed
    skipped: str = ""  # why it was not run ("not installed", ...)
    runs: list[Run] = field(default_factory=list)

    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.ok]

    def wall(self) -> list[float]:
        return [r.wall_s for r in self.ok_runs()]

    def first_step(self) -> list[float]:
        return [r.first_step_s for r in self.ok_runs() if r.first_step_s is not None]

    def summary(self) -> dict:
        wall, first = self.wall(), self.first_step()
        threads = sorted({f"{r.threads} (OMP_NUM_THREADS={r.omp})" for r in self.ok_runs()
                          if r.threads is not None})
        return {
            "case": self.case, "launcher": self.launcher, "skipped": self.skipped,
            "runs": len(self.runs), "failed": len(self.runs) - len(self.ok_runs()),
            "wall_median_s": statistics.median(wall) if wall else None,
            "wall_min_s": min(wall) if wall else None,
            "first_step_median_s": statistics.median(first) if first else None,
            "first_step_min_s": min(first) if first else None,
            "threads_rank0": ", ".join(threads) if threads else None,
        }


def clean_env() -> dict[str, str]:
    """This environment without OMP_NUM_THREADS, so each launcher's own default shows."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Launch:
    """What one measured run starts: argvs started together, and how to clean up after a timeout."""

    argvs: list[list[str]]
    env: dict[str, str] | None = None
    cleanup: Callable[[], None] | None = None  # after a timeout: stop what runs out of our reach


def run_commands(launch: Launch, timeout: float) -> Run:
    """Start all argvs at once; wall time until the last exits. Parses the job's BENCH_ lines."""
    env = launch.env if launch.env is not None else clean_env()
    start = time.time()
    t0 = time.perf_counter()
    procs = [subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True) for argv in launch.argvs]
    outputs: list[tuple[str, str]] = []
    killed: set[int] = set()
    for proc in procs:
        remaining = max(0.1, timeout - (time.perf_counter() - t0))
        try:
            out, err = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            if not killed:
                killed = {p.pid for p in procs if p.poll() is None}
                stop_trees([p for p in procs if p.pid in killed])
                if launch.cleanup:
                    launch.cleanup()
            out, err = proc.communicate()
        outputs.append((out.decode(errors="replace"), err.decode(errors="replace")))
    wall = time.perf_counter() - t0

    text = "\n".join(o + "\n" + e for o, e in outputs)
    first = FIRST_STEP_RE.search(text)
    threads = THREADS_RE.search(text)
    failures = []
    for argv, proc, (out, err) in zip(launch.argvs, procs, outputs):
        if proc.pid in killed or proc.returncode != 0:
            why = (f"timed out after {timeout:.0f} s, stopped" if proc.pid in killed
                   else f"exit code {proc.returncode}")
            failures.append(f"$ {shlex.join(argv)}\n  -> {why}\n--- stderr ---\n{err.rstrip()}\n"
                            f"--- stdout (tail) ---\n{_tail(out)}")
    if not failures and not first:
        failures.append(f"no BENCH_FIRST_STEP line in the output:\n{_tail(text)}")
    return Run(ok=not failures, wall_s=wall,
               first_step_s=float(first.group(1)) - start if first else None,
               threads=int(threads.group(1)) if threads else None,
               omp=threads.group(2) if threads else None,
               error="\n".join(failures))


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) for every process /proc shows."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry)] = (int(fields[1]), fields[19])  # ppid, starttime
    return table


def stop_trees(procs: list[subprocess.Popen], grace: float = 10) -> None:
    """Stop launchers that ran out of time, and everything they started on this machine.

    Both launchers start their ranks in new sessions, so the launcher's process group does not
    reach them: the descendants are looked up by parent pid before anything is signalled, asked to
    stop with SIGTERM (the launcher gets it first, to stop its ranks), and SIGKILLed after `grace`
    seconds if still there (same pid and start time, so never a reused pid).
    """
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    tree: list[tuple[int, str]] = []
    todo = [p.pid for p in procs]
    while todo:
        pid = todo.pop()
        if pid in table:
            tree.append((pid, table[pid][1]))
            todo.extend(children.get(pid, []))
    for pid, _ in tree:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    now = _process_table()
    for pid, started in reversed(tree):
        if pid in now and now[pid][1] == started:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# launchers


def tool(name: str, module: str) -> list[str]:
    """The venv's console script when there is one, else `python -m module`."""
    script = BIN / name
    if script.exists():
        return [str(script)]
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


NO_PREFLIGHT = "crew --skip_preflight"


def deepspeed_cmd() -> list[str] | None:
    script = BIN / "deepspeed"
    if script.exists():
        return [str(script)]
    if importlib.util.find_spec("deepspeed") is not None:
        return [sys.executable, "-m", "deepspeed.launcher.runner"]
    found = shutil.which("deepspeed")
    return [found] if found else None


def local_launch(launcher: str) -> Launch:
    job = str(JOB)
    if launcher == "crew":
        return Launch([[*tool("crew", "crew"), "run", "--num_gpus", "2", job]])
    if launcher == "torchrun":
        return Launch([[*tool("torchrun", "torch.distributed.run"), "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), job]])
    if launcher == "deepspeed":
        return Launch([[*deepspeed_cmd(), "--num_gpus", "2", "--master_port", str(free_port()),
                        job]])
    raise ValueError(launcher)


def ssh_launch(launcher: str, cluster: sshnodes.Cluster) -> Launch:
    job = str(JOB)
    ssh = ["ssh", *SSH_OPTIONS, "-F", str(cluster.config)]
    if launcher in ("crew", NO_PREFLIGHT):
        hostfile = cluster.hostfile(slots=1)
        skip = ["--skip_preflight"] if launcher == NO_PREFLIGHT else []
        return Launch([[*tool("crew", "crew"), "run", "-H", str(hostfile),
                        "--ssh_args", cluster.ssh_args, *skip, job]])
    if launcher == "torchrun":
        # One torchrun per node, all started at once. Each writes its pid (the shell's, which exec
        # hands to torchrun) so that a timed-out run can be stopped on the node: killing the local
        # ssh client does not stop a command without a terminal on the remote side.
        master = cluster.addresses[0]
        port = sshnodes.free_port_on([master])
        argvs, pidfiles = [], []
        for node_rank, address in enumerate(cluster.addresses):
            pidfile = cluster.root / f"torchrun_{address}.pid"
            pidfile.unlink(missing_ok=True)
            pidfiles.append(pidfile)
            remote = (f"cd {shlex.quote(str(REPO))} && echo $$ > {shlex.quote(str(pidfile))} && "
                      f"exec {shlex.quote(sys.executable)} -m torch.distributed.run "
                      f"--nnodes {len(cluster.addresses)} --nproc_per_node 1 "
                      f"--node_rank {node_rank} "
                      f"--master_addr {master} --master_port {port} {shlex.quote(job)}")
            argvs.append([*ssh, address, remote])

        def cleanup() -> None:
            for address, pidfile in zip(cluster.addresses, pidfiles):
                pid = shlex.quote(str(pidfile))
                # TERM torchrun (it stops its ranks), then KILL it and its children by parent pid.
                remote = (f"test -s {pid} || exit 0; p=$(cat {pid}); kill -TERM $p 2>/dev/null; "
                          f"for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 $p 2>/dev/null || exit 0; "
                          f"sleep 0.5; done; pkill -KILL -P $p; kill -KILL $p 2>/dev/null; true")
                subprocess.run([*ssh, address, remote], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=60, check=False)
        return Launch(argvs, cleanup=cleanup)
    if launcher == "deepspeed":
        # deepspeed's multi-node runner is pdsh by default; its hostfile takes no ssh port.
        hostfile = cluster.root / "hostfile.deepspeed"
        hostfile.write_text("".join(f"{a} slots=1\n" for a in cluster.addresses))
        env = clean_env()
        env["PDSH_SSH_ARGS_APPEND"] = f"{cluster.ssh_args} {' '.join(SSH_OPTIONS)}"
        env["PDSH_RCMD_TYPE"] = "ssh"
        return Launch([[*deepspeed_cmd(), "-H", str(hostfile), "--ssh_port", str(cluster.port),
                        "--master_addr", cluster.addresses[0], "--master_port",
                        str(sshnodes.free_port_on([cluster.addresses[0]])), job]], env)
    raise ValueError(launcher)


# --------------------------------------------------------------------------------------------------
# the benchmark


def measure(cases: list[Case], launch: Callable[[str], Launch], repeat: int, timeout: float,
            warmup: int) -> None:
    for _ in range(warmup):  # unmeasured: loads each launcher's modules into the page cache
        for case in cases:
            if case.skipped:
                continue
            run = run_commands(launch(case.launcher), timeout)
            print(f"  [{case.case} {case.launcher} warm-up] "
                  + (f"wall {run.wall_s:6.2f} s (not counted)" if run.ok else
                     f"FAILED after {run.wall_s:.2f} s (not counted)"), flush=True)
            if not run.ok:
                print(_indent(run.error), flush=True)
    for i in range(repeat):
        for case in cases:
            if case.skipped:
                continue
            run = run_commands(launch(case.launcher), timeout)
            case.runs.append(run)
            status = (f"wall {run.wall_s:6.2f} s, first step {run.first_step_s:6.2f} s, "
                      f"threads {run.threads} (OMP_NUM_THREADS={run.omp})" if run.ok
                      else f"FAILED after {run.wall_s:.2f} s")
            print(f"  [{case.case} {case.launcher} {i + 1}/{repeat}] {status}", flush=True)
            if not run.ok:
                print(_indent(run.error), flush=True)


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


def new_cases(case: str) -> list[Case]:
    cases = [Case(case, "crew"), Case(case, "torchrun"), Case(case, "deepspeed")]
    if deepspeed_cmd() is None:
        cases[2].skipped = "not installed"
    elif case == "ssh" and not shutil.which("pdsh"):
        cases[2].skipped = "pdsh not installed"
    if case == "ssh":  # what the preflight (one more ssh round trip per node) costs
        cases.insert(1, Case(case, NO_PREFLIGHT))
    return cases


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summaries: list[dict]) -> str:
    header = ["case", "launcher", "wall median s", "wall min s", "first step median s",
              "threads (rank 0)"]
    rows = []
    for s in summaries:
        if s["skipped"]:
            rows.append([s["case"], s["launcher"], s["skipped"], "", "", ""])
            continue
        threads = s["threads_rank0"] or "-"
        if s["failed"]:
            threads += f"  [{s['failed']}/{s['runs']} runs failed]"
        rows.append([s["case"], s["launcher"], fmt(s["wall_median_s"]), fmt(s["wall_min_s"]),
                     fmt(s["first_step_median_s"]), threads])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def deltas(summaries: list[dict], ssh_skip: str | None) -> tuple[list[str], dict]:
    lines, result = [], {}
    for case in ("local", "ssh"):
        by = {s["launcher"]: s for s in summaries if s["case"] == case}
        crew = by.get("crew", {}).get("wall_median_s")
        torch_ = by.get("torchrun", {}).get("wall_median_s")
        label = f"crew - torchrun wall ({case}):"
        if case == "ssh" and ssh_skip:
            lines.append(f"{label} skipped ({ssh_skip})")
            result[case] = None
        elif crew is None or torch_ is None:
            lines.append(f"{label} n/a (a launcher had no successful run)")
            result[case] = None
        else:
            delta = crew - torch_
            verdict = "met" if delta <= TARGET_S else "NOT met"
            lines.append(f"{label} {delta:+.2f} s (target <= {TARGET_S} s): {verdict}")
            result[case] = {"delta_s": delta, "target_s": TARGET_S, "met": delta <= TARGET_S}
    return lines, result


def warm_up(timeout: float) -> None:
    """Load torch once, so that not even the first (warm-up) launch pays for a cold page cache."""
    subprocess.run([sys.executable, "-c", "import torch.distributed, torch.nn.parallel"],
                   cwd=REPO, env=clean_env(), timeout=timeout, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (default 3)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="unmeasured runs per launcher before the measured ones (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="one run per measurement, no warm-up run")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds before one launch is stopped and counted as failed "
                             "(default 120)")
    parser.add_argument("--runners", action="store_true",
                        help="only the runner comparison: 16 ranks on 4 loopback nodes with ssh, pdsh, openmpi, mpich")
    args = parser.parse_args(argv)
    repeat = 1 if args.quick else max(1, args.repeat)
    if args.runners:
        import _runners_bench  # benchmarks/ is on sys.path: this script's folder

        return _runners_bench.main(repeat, args.timeout)
    warmup = 0 if args.quick else max(0, args.warmup)

    import torch  # only for the version line; the job itself runs in the launched processes

    print(f"launch benchmark: tiny 2-rank gloo job ({JOB.relative_to(REPO)}), {repeat} measured "
          f"run(s) each after {warmup} warm-up run(s), timeout {args.timeout:.0f} s per launch")
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{len(os.sched_getaffinity(0))} CPU core(s), OMP_NUM_THREADS in caller's env: "
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')} (removed for the launches)")
    warm_up(args.timeout)

    print("local:", flush=True)
    local = new_cases("local")
    measure(local, local_launch, repeat, args.timeout, warmup)

    ssh = new_cases("ssh")
    ssh_skip = sshnodes.sshd_missing_reason()
    if ssh_skip:
        print(f"ssh: skipped: {ssh_skip}")
        ssh = []
    else:
        print("ssh (sshd nodes on 127.0.0.2, 127.0.0.3, 1 slot each):", flush=True)
        with tempfile.TemporaryDirectory(prefix="crew-bench-ssh-") as tmp:
            try:
                cluster = sshnodes.start_cluster(Path(tmp), 2)
            except Exception as exc:  # noqa: BLE001  (report and go on without the ssh rows)
                ssh_skip = f"could not start the sshd nodes: {exc}"
                print(f"ssh: skipped: {ssh_skip}")
                ssh = []
            else:
                try:
                    measure(ssh, lambda launcher: ssh_launch(launcher, cluster), repeat,
                            args.timeout, warmup)
                finally:
                    cluster.stop()

    summaries = [c.summary() for c in local + ssh]
    delta_lines, delta_result = deltas(summaries, ssh_skip)
    print()
    print(table(summaries))
    print()
    for line in delta_lines:
        print(line)

    if args.json:
        out = {
            "repeat": repeat, "warmup": warmup, "timeout_s": args.timeout, "target_s": TARGET_S,
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu_cores": len(os.sched_getaffinity(0)), "ssh_skipped": ssh_skip,
            "results": [{**c.summary(), "samples": [asdict(r) for r in c.runs]}
                        for c in local + ssh],
            "crew_minus_torchrun_wall": delta_result,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.json}")

    failed = any(not r.ok for c in local + ssh for r in c.runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
