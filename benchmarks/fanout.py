"""Fan-out: how long `crew run` takes to start and stop one rank on each of N nodes.

N throwaway sshd "nodes" on 127.0.0.2, 127.0.0.3, ... (tests/sshnodes.py), one slot each, and a
script that imports nothing (no torch): what is left is the launcher's own cost. Each run is timed
from just before the launcher process starts until it exits; crew's phases come from the line that
CREW_TIMING=1 makes it print at the end (seconds since crew started, which the harness turns into
seconds since it started crew):

* preflight: the quick check of every node (one ssh connection and one Python start per node);
* agents up: every node's agent has reported its rank started (a second ssh connection and Python
  start per node, then the rank's own start);
* ranks done: every agent has exited after its rank;
* exit: crew has said its last line (the rest of the wall time is the interpreter's exit).

Side by side, on the same nodes: `crew run --launcher pdsh` (pdsh launching the same agents), when
pdsh is installed, and DeepSpeed's pdsh runner (its per-node launcher imports torch), when
--deepspeed_python names a Python where deepspeed imports; each is skipped with the reason otherwise.
DeepSpeed's own ssh check cannot take the nodes' ssh config (-F), so it runs with --no_ssh_check.
Each case gets one unmeasured warm-up run, then --repeat runs (cases interleaved); the table shows
median and min. A failed run is printed, left out of the statistics, and makes the script exit 1.

Run from the repository root (all nodes and their agents share this machine's cores):

    .venv/bin/python benchmarks/fanout.py                       # 8, 32, 64 nodes, 3 repeats
    .venv/bin/python benchmarks/fanout.py --nodes 8,32 --repeat 5
    .venv/bin/python benchmarks/fanout.py --deepspeed_python /work/dsvenv/bin/python --json fanout.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import sshnodes  # noqa: E402  (tests/sshnodes.py)
from launch import stop_trees, tool  # noqa: E402  (benchmarks/launch.py)

PHASES = ("preflight", "agents up", "ranks done", "exit")
TIMING_RE = re.compile(r"timing \(s since crew started\): (.*)")
NOOP = "import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']} up\\n\")\n"


@dataclass
class Run:
    ok: bool
    wall_s: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds since the harness started it
    longest_line: int = 0  # characters in crew's longest `crew: ` line
    error: str = ""


@dataclass
class Case:
    nodes: int
    launcher: str  # crew | crew pdsh | deepspeed pdsh
    skipped: str = ""
    runs: list[Run] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [r for r in self.runs if r.ok]
        out = {"nodes": self.nodes, "launcher": self.launcher, "skipped": self.skipped,
               "runs": len(self.runs), "failed": len(self.runs) - len(ok),
               "longest_line": max((r.longest_line for r in ok), default=None)}
        for name, values in [("wall", [r.wall_s for r in ok])] + [
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
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_trees([proc])
        proc.wait()
    wall = time.monotonic() - t0
    for reader in readers:
        reader.join(timeout=10)
    lines = [line for _, line in err]
    run = Run(ok=proc.returncode == 0, wall_s=wall, phases=phases(err),
              longest_line=max((len(line) for line in lines if line.startswith("crew: ")), default=0))
    if not run.ok:
        run.error = f"exit code {proc.returncode}\n" + "\n".join(lines[-30:])
    return run


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
    cases = [Case(count, "crew"), Case(count, "crew pdsh"), Case(count, "deepspeed pdsh")]
    if not shutil.which("pdsh"):
        cases[1].skipped = "pdsh not installed"
    cases[2].skipped = deepspeed_missing(args.deepspeed_python)
    script = root / "noop.py"
    script.write_text(NOOP)
    cluster = sshnodes.start_cluster(root / f"nodes{count}", count)
    try:
        env = environment(cluster)
        argvs = {"crew": crew_argv(cluster, script, False), "crew pdsh": crew_argv(cluster, script, True),
                 "deepspeed pdsh": deepspeed_argv(cluster, script, args.deepspeed_python or "")}
        for i in range(args.repeat + 1):  # the first: warm-up, not counted
            for case in (c for c in cases if not c.skipped):
                run = run_once(argvs[case.launcher], env, root, args.timeout)
                label = "warm-up" if i == 0 else f"{i}/{args.repeat}"
                print(f"  [{count} nodes, {case.launcher} {label}] {describe(run)}", flush=True)
                if i:
                    case.runs.append(run)
    finally:
        cluster.stop()
    return cases


def describe(run: Run) -> str:
    if not run.ok:
        return f"FAILED after {run.wall_s:.2f} s\n" + "\n".join(f"      {l}" for l in run.error.splitlines())
    phases = ", ".join(f"{p} {run.phases[p]:.2f}" for p in PHASES if p in run.phases)
    return f"wall {run.wall_s:.2f} s" + (f" ({phases})" if phases else "")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summaries: list[dict]) -> str:
    header = ["nodes", "launcher", "wall median", "wall min", *(f"{p} median" for p in PHASES),
              "longest crew line"]
    rows = []
    for s in summaries:
        if s["skipped"]:
            rows.append([str(s["nodes"]), s["launcher"], f"skipped: {s['skipped']}"] + [""] * 6)
            continue
        failed = f"  [{s['failed']}/{s['runs']} failed]" if s["failed"] else ""
        rows.append([str(s["nodes"]), s["launcher"], fmt(s["wall median"]), fmt(s["wall min"]),
                     *(fmt(s[f"{p} median"]) for p in PHASES), f"{s['longest_line'] or '-'}{failed}"])
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
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    args = parser.parse_args(argv)
    missing = sshnodes.sshd_missing_reason()
    if missing:
        print(f"fanout: skipped: {missing}")
        return 0
    counts = [int(n) for n in args.nodes.split(",")]
    print(f"fanout benchmark: {counts} loopback sshd nodes, 1 slot each, no-torch script; "
          f"{args.repeat} run(s) after 1 warm-up; {len(os.sched_getaffinity(0))} CPU core(s)", flush=True)
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="crew-bench-fanout-") as tmp:
        for count in counts:
            cases += measure(count, args, Path(tmp))
    summaries = [c.summary() for c in cases]
    print("\nseconds since the launcher was started (phases: crew's CREW_TIMING line)\n")
    print(table(summaries))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cores": len(os.sched_getaffinity(0)),
             "results": [{**c.summary(), "samples": [asdict(r) for r in c.runs]} for c in cases]},
            indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if any(not r.ok for c in cases for r in c.runs) else 0


if __name__ == "__main__":
    sys.exit(main())
