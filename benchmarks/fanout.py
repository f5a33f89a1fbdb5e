"""Fan-out: how long `crew run` takes to start and stop one rank on each of N nodes.

N throwaway sshd "nodes" on 127.0.0.2, 127.0.0.3, ... (tests/sshnodes.py), one slot each, and a
script that imports nothing (no torch): what is left is the launcher's own cost. Each run is timed
from just before the launcher process starts until it exits; crew's phases come from the line that
CREW_TIMING=1 makes it print at the end (seconds since crew started, which the harness turns into
seconds since it started crew):

* preflight: every node's quick check has been judged. Over ssh the agents do it: one ssh connection
  and one Python start per node, for the check and the job. Under pdsh the check is a probe of its own
  (one more connection per node), before pdsh starts the agents;
* agents up: every node's agent has reported its rank started (after "go": spawning the rank);
* ranks done: every agent has exited after its rank;
* exit: crew has said its last line (the rest of the wall time is the interpreter's exit).

launcher CPU: the CPU seconds (user + system) of the launcher process and of every descendant it
reaped (its ssh or pdsh clients), from os.wait4. Here every node's side (sshd, the agents, the ranks)
shares this machine's cores too, so the wall times add up costs that real nodes pay in parallel; the
launcher's CPU is what stays on the one machine that launches, on a real cluster as well.

The row "floor: ssh + python" is the least any ssh launcher can do: one ssh login per node running
the nodes' Python (the venv's, in the repository root) that only imports crew.launcher.node.agent, at most
32 at a time (crew's fan-out window), timed from the first start to the last exit; its launcher CPU
is the sum over the ssh clients.

Every ssh login costs the client's key exchange, and the login shell sources the user's ~/.bashrc
(bash does for every command run over ssh), which on a machine set up for development can cost more
than the rest. --clean_login gives the nodes' logins an empty HOME (sshd's SetEnv), so no ~/.bashrc
runs: closer to a cluster node. The table's title line says which it was.

Side by side, on the same nodes: `crew run --launcher pdsh` (pdsh launching the same agents), when
pdsh is installed, and DeepSpeed's pdsh runner (its per-node launcher imports torch), when
--deepspeed_python names a Python where deepspeed imports; each is skipped with the reason otherwise.
DeepSpeed's own ssh check cannot take the nodes' ssh config (-F), so it runs with --no_ssh_check.
Each case gets one unmeasured warm-up run, then --repeat runs (cases interleaved); the table shows
median and min. A failed run is printed, left out of the statistics, and makes the script exit 1.
After each run the harness waits (up to 60 s) until nothing a login to the nodes started is left: a
failed run can leave node-side processes running (orphans) that would slow the next one.

Run from the repository root (all nodes and their agents share this machine's cores):

    .venv/bin/python benchmarks/fanout.py                       # 8, 32, 64 nodes, 3 repeats
    .venv/bin/python benchmarks/fanout.py --nodes 8,32 --repeat 5 --clean_login
    .venv/bin/python benchmarks/fanout.py --deepspeed_python /work/dsvenv/bin/python --json fanout.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import sshnodes  # noqa: E402  (tests/sshnodes.py)
from launch import _process_table, stop_trees, tool  # noqa: E402  (benchmarks/launch.py)

from crew.launcher.job.run import FANOUT  # noqa: E402

PHASES = ("preflight", "agents up", "ranks done", "exit")
TIMING_RE = re.compile(r"timing \(s since crew started\): (.*)")
NOOP = "import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']} up\\n\")\n"
FLOOR = "floor: ssh + python"


@dataclass
class Run:
    ok: bool
    wall_s: float
    cpu_s: float | None = None  # user + system of the launcher and the descendants it reaped
    phases: dict[str, float] = field(default_factory=dict)  # seconds since the harness started it
    longest_line: int = 0  # characters in crew's longest `crew: ` line
    error: str = ""


@dataclass
class Case:
    nodes: int
    launcher: str  # crew | crew pdsh | deepspeed pdsh | FLOOR
    skipped: str = ""
    runs: list[Run] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [r for r in self.runs if r.ok]
        out = {"nodes": self.nodes, "launcher": self.launcher, "skipped": self.skipped,
               "runs": len(self.runs), "failed": len(self.runs) - len(ok),
               "longest_line": max((r.longest_line for r in ok), default=None)}
        for name, values in [("wall", [r.wall_s for r in ok]),
                             ("cpu", [r.cpu_s for r in ok if r.cpu_s is not None])] + [
                (phase, [r.phases[phase] for r in ok if phase in r.phases]) for phase in PHASES]:
            out[f"{name} median"] = statistics.median(values) if values else None
            out[f"{name} min"] = min(values) if values else None
        return out


def run_once(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Run:
    """Start the launcher, read its stderr as it comes (each line stamped), and time it until it exits."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    err: list[tuple[float, str]] = []

    def read_err() -> None:
        for raw in proc.stderr:
            err.append((time.monotonic() - t0, raw.decode(errors="replace").rstrip("\n")))

    readers = [threading.Thread(target=read_err, daemon=True),
               threading.Thread(target=proc.stdout.read, daemon=True)]
    for reader in readers:
        reader.start()
    code, cpu, timed_out = reap(proc, timeout, lambda p: stop_trees([p]))
    wall = time.monotonic() - t0
    for reader in readers:
        reader.join(timeout=10)
    lines = [line for _, line in err]
    run = Run(ok=code == 0 and not timed_out, wall_s=wall, cpu_s=cpu, phases=phases(err),
              longest_line=max((len(line) for line in lines if line.startswith("crew: ")), default=0))
    if not run.ok:
        run.error = f"{'timed out, ' if timed_out else ''}exit code {code}\n" + "\n".join(lines[-30:])
    return run


def reap(proc: subprocess.Popen, timeout: float, stop) -> tuple[int | None, float | None, bool]:
    """Wait for `proc` with os.wait4, which also gives the CPU seconds of it and of every descendant
    it reaped; past `timeout`, stop(proc) first. (exit code, CPU seconds, timed out); the CPU is None
    when stop()'s proc.poll() reaped it."""
    got: dict = {}

    def wait() -> None:
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except ChildProcessError:  # reaped by proc.poll() in stop(): proc.returncode has the code
            return
        got["code"] = proc.returncode = os.waitstatus_to_exitcode(status)
        got["cpu"] = usage.ru_utime + usage.ru_stime

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout)
    timed_out = waiter.is_alive()
    if timed_out:
        stop(proc)
        waiter.join()
    return got.get("code", proc.returncode), got.get("cpu"), timed_out


def floor_once(cluster: sshnodes.Cluster, timeout: float) -> Run:
    """One ssh login per node running the nodes' Python that only imports the agent, FANOUT at a time."""
    command = f"cd {shlex.quote(str(REPO))} && exec {shlex.quote(sys.executable)} -c 'import crew.launcher.node.agent'"

    def login(address: str) -> tuple[int | None, float | None, bool, str]:
        proc = subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                                 *shlex.split(cluster.ssh_args), "--", address, command],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        code, cpu, timed_out = reap(proc, timeout, subprocess.Popen.kill)
        return code, cpu, timed_out, proc.stderr.read().decode(errors="replace")

    t0 = time.monotonic()
    with ThreadPoolExecutor(FANOUT) as pool:
        results = list(pool.map(login, cluster.addresses))
    wall = time.monotonic() - t0
    failed = [f"{a}: {'timed out, ' if t else ''}exit code {c}: {e.strip()}"
              for a, (c, _, t, e) in zip(cluster.addresses, results) if c != 0 or t]
    cpus = [cpu for _, cpu, _, _ in results]
    return Run(ok=not failed, wall_s=wall, cpu_s=None if None in cpus else sum(cpus),
               error="\n".join(failed[:10]))


def phases(err: list[tuple[float, str]]) -> dict[str, float]:
    """From crew's timing line (its clock starts at its exec, a few ms after Popen); without one (an
    older crew), when the preflight's and the `node(s) started` lines arrived."""
    for _, line in err:
        if match := TIMING_RE.search(line):
            return {name: float(value) for name, _, value in
                    (part.rpartition(" ") for part in match.group(1).split(", "))}
    found = {}
    for at, line in err:
        if line.startswith("crew: preflight:"):
            found["preflight"] = at
        elif line.startswith("crew: all ") and "node(s) started" in line:
            found["agents up"] = at
    return found


def crew_argv(cluster: sshnodes.Cluster, script: Path, pdsh: bool) -> list[str]:
    hostfile = cluster.hostfile(slots=1)
    return [*tool("crew", "crew"), "run", "-H", str(hostfile), "--ssh_args", cluster.ssh_args,
            *(["--launcher", "pdsh"] if pdsh else []), str(script)]


def deepspeed_argv(cluster: sshnodes.Cluster, script: Path, python: str) -> list[str]:
    hostfile = cluster.root / "hostfile.deepspeed"
    hostfile.write_text("".join(f"{a} slots=1\n" for a in cluster.addresses))
    master = cluster.addresses[0]
    return [python, "-m", "deepspeed.launcher.runner", "-H", str(hostfile), "--ssh_port",
            str(cluster.port), "--no_ssh_check", "--master_addr", master, "--master_port",
            str(sshnodes.free_port_on([master])), str(script)]


def environment(cluster: sshnodes.Cluster) -> dict[str, str]:
    env = {**os.environ, "CREW_TIMING": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)
    env["PDSH_SSH_ARGS_APPEND"] = f"{cluster.ssh_args} -o BatchMode=yes -o ConnectTimeout=10"
    env["PDSH_RCMD_TYPE"] = "ssh"
    return env


def deepspeed_missing(python: str | None) -> str:
    if not python:
        return "no --deepspeed_python given"
    if not shutil.which("pdsh"):
        return "pdsh not installed"
    probe = subprocess.run([python, "-c", "import deepspeed.launcher.runner"], capture_output=True,
                           text=True)
    return "" if probe.returncode == 0 else f"deepspeed does not import in {python}"


def measure(count: int, args: argparse.Namespace, root: Path) -> list[Case]:
    cases = [Case(count, FLOOR), Case(count, "crew"), Case(count, "crew pdsh"), Case(count, "deepspeed pdsh")]
    if not shutil.which("pdsh"):
        cases[2].skipped = "pdsh not installed"
    cases[3].skipped = deepspeed_missing(args.deepspeed_python)
    script = root / "noop.py"
    script.write_text(NOOP)
    cluster = sshnodes.start_cluster(root / f"nodes{count}", count, clean_login=args.clean_login)
    try:
        env = environment(cluster)
        argvs = {"crew": crew_argv(cluster, script, False), "crew pdsh": crew_argv(cluster, script, True),
                 "deepspeed pdsh": deepspeed_argv(cluster, script, args.deepspeed_python or "")}
        for i in range(args.repeat + 1):  # the first: warm-up, not counted
            for case in (c for c in cases if not c.skipped):
                run = (floor_once(cluster, args.timeout) if case.launcher == FLOOR
                       else run_once(argvs[case.launcher], env, root, args.timeout))
                label = "warm-up" if i == 0 else f"{i}/{args.repeat}"
                print(f"  [{count} nodes, {case.launcher} {label}] {describe(run)}", flush=True)
                settle(cluster)
                if i:
                    case.runs.append(run)
    finally:
        cluster.stop()
    return cases


def settle(cluster: sshnodes.Cluster, limit: float = 60) -> None:
    """Wait, at most `limit` seconds, until nothing a login to the nodes started is left, orphans too:
    a killed ssh client does not stop its remote command (no tty, so no SIGHUP)."""
    t0 = time.monotonic()
    while (left := len(node_processes(cluster))) and time.monotonic() - t0 < limit:
        time.sleep(0.2)
    if time.monotonic() - t0 > 1:
        print(f"    (waited {time.monotonic() - t0:.1f} s for the nodes' leftover processes; {left} left)",
              flush=True)


def node_processes(cluster: sshnodes.Cluster) -> list[int]:
    """The nodes' sshd sessions, and every process whose SSH_CONNECTION names the nodes' port."""
    sshds = {proc.pid for proc in cluster.procs.values()}
    found = [pid for pid, (ppid, _) in _process_table().items() if ppid in sshds]
    port = str(cluster.port).encode()
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(b"SSH_CONNECTION=") and v.split()[-1] == port for v in environ):
            found.append(pid)
    return found


def describe(run: Run) -> str:
    if not run.ok:
        return f"FAILED after {run.wall_s:.2f} s\n" + "\n".join(f"      {l}" for l in run.error.splitlines())
    phases = ", ".join(f"{p} {run.phases[p]:.2f}" for p in PHASES if p in run.phases)
    cpu = "" if run.cpu_s is None else f", launcher CPU {run.cpu_s:.2f} s"
    return f"wall {run.wall_s:.2f} s{cpu}" + (f" ({phases})" if phases else "")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summaries: list[dict]) -> str:
    header = ["nodes", "launcher", "wall median", "wall min", "launcher CPU median",
              *(f"{p} median" for p in PHASES), "longest crew line"]
    rows = []
    for s in summaries:
        if s["skipped"]:
            rows.append([str(s["nodes"]), s["launcher"], f"skipped: {s['skipped']}"] + [""] * 7)
            continue
        failed = f"  [{s['failed']}/{s['runs']} failed]" if s["failed"] else ""
        floor = s["launcher"] == FLOOR
        rows.append([str(s["nodes"]), s["launcher"], fmt(s["wall median"]), fmt(s["wall min"]),
                     fmt(s["cpu median"]), *("" if floor else fmt(s[f"{p} median"]) for p in PHASES),
                     f"{'' if floor else s['longest_line'] or '-'}{failed}"])
    widths = [max(len(r[i]) for r in [header, *rows] if len(r) > i) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="8,32,64", help="node counts, comma-separated (default 8,32,64)")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per case (default 3)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    parser.add_argument("--deepspeed_python", help="a Python where deepspeed imports: adds its pdsh runner")
    parser.add_argument("--clean_login", action="store_true",
                        help="nodes' logins get an empty HOME, so no ~/.bashrc runs (default: this machine's)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    args = parser.parse_args(argv)
    missing = sshnodes.sshd_missing_reason()
    if missing:
        print(f"fanout: skipped: {missing}")
        return 0
    counts = [int(n) for n in args.nodes.split(",")]
    logins = ("clean logins (empty HOME, no ~/.bashrc)" if args.clean_login
              else f"logins source {Path.home() / '.bashrc'} if any")
    print(f"fanout benchmark: {counts} loopback sshd nodes, 1 slot each, no-torch script; {logins}; "
          f"{args.repeat} run(s) after 1 warm-up; {len(os.sched_getaffinity(0))} CPU core(s)", flush=True)
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="crew-bench-fanout-") as tmp:
        for count in counts:
            cases += measure(count, args, Path(tmp))
    summaries = [c.summary() for c in cases]
    print(f"\nseconds since the launcher was started (phases: crew's CREW_TIMING line); launcher CPU: "
          f"user + system seconds of the launcher and the processes it reaped; {logins}\n")
    print(table(summaries))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cores": len(os.sched_getaffinity(0)), "clean_login": args.clean_login,
             "results": [{**c.summary(), "samples": [asdict(r) for r in c.runs]} for c in cases]},
            indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if any(not r.ok for c in cases for r in c.runs) else 0


if __name__ == "__main__":
    sys.exit(main())
