"""`crew doctor` and `crew run`'s preflight: probe every node, compare, and say what to fix.

The probe (crew.launcher.preflight.probe) runs on each node over the runner `crew run` would use. Versions are
compared across the nodes (a node that differs from the most common value fails); code is compared
with the launching machine's copy, which is the one the user edits. The preflight runs the quick
checks only (ssh, versions without importing torch, the script's hash): a second or two.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from crew.errors import CrewError
from crew.launcher.preflight import probe
from crew.launcher.transport import runners
from crew.launcher.transport.mpi import MPI_RUNNERS
from crew.launcher.preflight.gate import Judge
from crew.launcher.job.run import FANOUT, LINE_MAX, STOP_WAIT_S, fit_list
from crew.launcher.plan.launch import NO_SCRIPT, Launch, agent_launches, job_spec
from crew.launcher.transport.proc import signal_tree
from crew.launcher.transport.protocol import JobSpec, decode_event, whole_lines
from crew.launcher.console.ranges import spans
from crew.units import parse_bytes

PROBE_MODULE = "crew.launcher.preflight.probe"
QUICK_TIMEOUT_S = 60.0  # as the ssh preflight's (gate.TIMEOUT_S); pdsh's one launch covers every node
FULL_TIMEOUT_S = 90.0
VERSIONS = ("python", "torch", "crew", "cuda")
SAVE_DIR_FLAGS = ("--save_dir", "--output_dir", "--checkpoint_dir")
SHOWN_FILES = 8
SHOWN_ROWS = 8  # the doctor's table groups alike nodes past this many, unless --verbose


@dataclass
class Check:
    name: str
    status: str  # "ok", "fail" or "skip"
    value: str = ""  # what the table shows
    detail: str = ""
    fix: str = ""


@dataclass
class NodeReport:
    node: int
    host: str
    ssh_port: int | None
    checks: dict[str, Check] = field(default_factory=dict)

    def add(self, check: Check) -> None:
        self.checks[check.name] = check

    @property
    def ok(self) -> bool:
        return all(check.status != "fail" for check in self.checks.values())


# -- running the probes -------------------------------------------------------------------------------

@dataclass
class ProbeRun:
    facts: dict[int, dict]
    errors: dict[int, tuple[int, list[str]]]  # node -> (exit code, stderr lines) when no facts came
    seconds: float


def run_probes(launch: Launch, args: argparse.Namespace, job: JobSpec, full: bool,
               save_dir: str | None) -> ProbeRun:
    extra = ("--full",) if full else ()
    if save_dir:
        extra += ("--save_dir", save_dir)
    launches = agent_launches(launch, job, args, module=PROBE_MODULE, extra=extra)
    started = time.monotonic()
    timeout = FULL_TIMEOUT_S if full else QUICK_TIMEOUT_S
    others_done = threading.Event()  # node 0's probe listens on the master port until then
    # At most the fan-out window of probes at once; node 0's is first and waits for the others (its
    # master port must listen while they connect), so it takes one worker of at least two.
    window = getattr(args, "fanout", FANOUT)
    with ThreadPoolExecutor(max(2, min(len(launches), window))) as pool:
        futures = [pool.submit(_run_one, a, job, timeout, others_done if 0 in a.node_ranks else None)
                   for a in launches]
        wait([f for f, a in zip(futures, launches, strict=True) if 0 not in a.node_ranks])
        others_done.set()
        results = [future.result() for future in futures]
    facts, errors = {}, {}
    for launch_, (code, out, err) in zip(launches, results, strict=True):
        for line in whole_lines(out.splitlines(keepends=True)):
            event = decode_event(line)
            if event and event.get("event") == "probe":
                facts[event["node"]] = event
        lines = err.decode(errors="replace").splitlines()
        for node_rank in launch_.node_ranks:
            if node_rank not in facts:
                errors[node_rank] = (code, _lines_of(lines, job.nodes[node_rank].host, launch_))
    return ProbeRun(facts, errors, time.monotonic() - started)


def _run_one(launch, job: JobSpec, timeout: float,
             hold: threading.Event | None) -> tuple[int, bytes, bytes]:
    """Run one probe launch; `hold` keeps its stdin open (node 0 listening) until it is set."""
    try:
        proc = runners.start(launch)
    except OSError as exc:
        return 127, b"", f"cannot start '{launch.argv[0]}': {exc.strerror}".encode()
    if launch.spec_on_stdin:
        try:
            proc.stdin.write(job.to_line())
            proc.stdin.flush()
        except OSError:
            pass  # it died at once; its stderr says why
        if hold is not None:
            hold.wait(timeout)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_tree(proc.pid, launch.kill_signal)
        try:
            out, err = proc.communicate(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:  # srun takes SIGTERM first; one that still hangs gets SIGKILL
            signal_tree(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        err += f"no answer within {timeout:.0f} s (timed out)".encode()
    return proc.returncode, out, err


def _lines_of(lines: list[str], host: str, launch) -> list[str]:
    """Under pdsh -N (runners.pdsh_launches) the nodes' stderr lines come unprefixed, so they cannot be told
    apart: each failed node gets them all (a message that names its node, as --venv_script's does, says
    whose it is); failing any, pdsh's own line on the node ('pdsh@here: host: ssh exited with ...')."""
    if launch.label != "pdsh":
        return lines
    said = [line for line in lines if not line.startswith("pdsh@")]
    return said or [line.split(f": {host}: ", 1)[1] for line in lines if f": {host}: " in line]


# -- comparing ----------------------------------------------------------------------------------------

def evaluate(launch: Launch, job: JobSpec, run: ProbeRun, reference: dict, full: bool,
             ssh_args: tuple[str, ...], min_free: int | None) -> list[NodeReport]:
    reports = []
    for node in launch.plan.nodes:
        report = NodeReport(node.node_rank, node.host, node.ssh_port)
        reports.append(report)
        remote = launch.launcher in ("ssh", "pdsh", *MPI_RUNNERS)
        facts = run.facts.get(node.node_rank)
        if facts is None:
            code, lines = run.errors[node.node_rank]
            _unreachable(report, code, lines, ssh_args, remote)
            continue
        if remote:
            report.add(Check("ssh", "ok", "ok", f"{facts['hostname']}, {run.seconds:.2f} s"))
        else:
            report.add(Check("ssh", "skip", "-", "this machine: no ssh"))
    reached = [r for r in reports if r.node in run.facts]
    _versions(reached, run.facts, full)
    for report in reached:
        facts = run.facts[report.node]
        report.add(_script(job, facts, reference))
        if full:
            report.add(_files(facts, reference))
            report.add(_devices(launch.plan.nodes[report.node], facts, run.facts))
            report.add(_master(job, report, facts))
            report.add(_interfaces(facts))
            report.add(_disk(facts, min_free))
    return reports


def _unreachable(report: NodeReport, code: int, lines: list[str], ssh_args: tuple[str, ...],
                 remote: bool) -> None:
    said = [line for line in lines if line.strip()] or [f"exit code {code}, no message"]
    last = said[-1].strip()
    host, port = report.host, report.ssh_port
    if remote and (code == 255 or "timed out" in last):
        if any("Permission denied" in line for line in said):
            fix = key_fix(host, port, ssh_args)
        else:
            fix = runners.ssh_fix(said, host, port) or f"'ssh {host} true' must work without a prompt."
        report.add(Check("ssh", "fail", "FAIL", last, fix))
    else:  # ssh worked (or none was needed); Python or crew did not start there
        report.add(Check("ssh", "ok", "ok") if remote else Check("ssh", "skip", "-", "this machine: no ssh"))
        fix = runners.ssh_fix(said, host, port) or "see the message; the same Python and crew must be there."
        report.add(Check("python", "fail", "FAIL", last, fix))


def key_fix(host: str, port: int | None, ssh_args: tuple[str, ...]) -> str:
    """The exact commands that authorise this machine's key on `host`."""
    config = runners.ssh_config(host, port, ssh_args)
    user, hostname = config.get("user", "root"), config.get("hostname", host)
    key = next((path for path in config.get("identityfile", [])
                if Path(os.path.expanduser(path) + ".pub").is_file()), None)
    port_flag = ["-p", str(port)] if port else []
    copy = ["ssh-copy-id", *ssh_args, *(["-i", os.path.expanduser(key) + ".pub"] if key else []),
            *port_flag, f"{user}@{host}"]
    lines = [f"the key is not authorised on {host}. Copy this machine's public key there (it asks "
             "for the password once):", f"    {shlex.join(copy)}"]
    if not key:
        lines[1:1] = ["    ssh-keygen -t ed25519   # first: this machine has no key pair yet"]
    lines += [f"or, if {host} takes another user or key, say so in ~/.ssh/config:", f"    Host {host}",
              f"        HostName {hostname}", *([f"        Port {port}"] if port else []),
              f"        User {user}", f"        IdentityFile {key or '~/.ssh/id_ed25519'}",
              f"Then 'ssh {shlex.join([*port_flag, f'{user}@{host}'])} true' must work without a password."]
    return "\n".join(lines)


def _versions(reports: list[NodeReport], facts: dict[int, dict], full: bool) -> None:
    for key in (*VERSIONS, "nccl") if full else VERSIONS:
        values = {r.node: str(facts[r.node].get(key) or "none") for r in reports}
        common = collections.Counter(values.values()).most_common(1)[0][0] if values else None
        holders = fit_list("", [r.host for r in reports if values[r.node] == common], 80)
        for report in reports:
            value = values[report.node]
            if value == common:
                report.add(Check(key, "ok", value))
                continue
            where = facts[report.node].get(f"{key}_path") or facts[report.node]["python_path"]
            report.add(Check(key, "fail", value, f"{key} {value} here ({where}), {common} on {holders}",
                             _version_fix(key, common, report.host, facts[report.node])))


def _version_fix(key: str, wanted: str, host: str, facts: dict) -> str:
    python = facts["python_path"]
    if key == "python":
        return (f"use the same Python on every node: install Python {wanted} on {host} at the path "
                "the other nodes use, or pass --python with an interpreter of that version.")
    if key == "torch":
        return f"on {host}: {python} -m pip install torch=={wanted}"
    if key == "crew":
        return (f"on {host}: install crew {wanted} for {python} (the same release, or the same source "
                "checkout: crew sync, then pip install -e .).")
    return f"install the same torch build on {host} as on the other nodes ({key} {wanted})."


def _script(job: JobSpec, facts: dict, reference: dict) -> Check:
    if not facts["cwd"]:
        return Check("script", "fail", "FAIL", f"working directory {job.cwd} does not exist",
                     "crew sync copies it there (or crew run --sync), or mount the same shared filesystem.")
    if job.mode == "module":
        return Check("script", "skip", "-", "a module: checked with the files")
    if job.program[0] == NO_SCRIPT:
        return Check("script", "skip", "-", "no script named")
    wanted, found = reference.get("script"), facts["script"]
    name = job.program[0]
    if found is None:
        return Check("script", "fail", "FAIL", f"{name} not found in {job.cwd}", _SYNC_FIX)
    if wanted and found != wanted:
        return Check("script", "fail", "FAIL", f"{name} differs from this machine's copy (sha256 "
                     f"{found[:12]} there, {wanted[:12]} here)", _SYNC_FIX)
    return Check("script", "ok", "ok", f"sha256 {found[:12]}")


_SYNC_FIX = "copy the code to every node: crew sync (or crew run --sync), or use a shared filesystem."


def _files(facts: dict, reference: dict) -> Check:
    mine, theirs = reference["manifest"]["files"], facts.get("manifest", {}).get("files", {})
    differ = sorted(name for name in mine if name in theirs and theirs[name] != mine[name])
    missing = sorted(name for name in mine if name not in theirs)
    if not differ and not missing:
        return Check("files", "ok", "ok", f"{len(mine)} file(s) the same")
    parts = [f"{label}: {_some(names)}" for label, names in (("differ", differ), ("missing", missing))
             if names]
    return Check("files", "fail", f"{len(differ) + len(missing)} differ", "; ".join(parts),
                 _SYNC_FIX + " Files that should differ per node belong in .crewignore.")


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_FILES])
    return shown + (f" (+{len(names) - SHOWN_FILES} more)" if len(names) > SHOWN_FILES else "")


def _devices(node, facts: dict, every: dict[int, dict]) -> Check:
    count = facts.get("devices")
    if count is None:
        return Check("devices", "skip", "-", "torch is not installed")
    if count == 0:
        if any(other.get("devices") for other in every.values()):
            return Check("devices", "fail", "no GPU", "no GPU visible here, but other nodes have GPUs",
                         "check the driver (nvidia-smi) and the torch build on this node.")
        return Check("devices", "ok", "cpu", "no GPU: CPU ranks with gloo")
    if max(node.slots) >= count:
        return Check("devices", "fail", f"{count} < {len(node.slots)}",
                     f"slots use device ids {','.join(map(str, node.slots))}, {count} GPU(s) visible",
                     f"give {node.host} at most slots={count} in the hostfile (or gpu= ids below {count}), "
                     "or check the driver (nvidia-smi).")
    return Check("devices", "ok", f"{count} GPU", f"{count} GPU(s) for {len(node.slots)} slot(s)")


def _master(job: JobSpec, report: NodeReport, facts: dict) -> Check:
    where = f"{job.master_addr}:{job.master_port}"
    master = facts.get("master", {})
    if master.get("listen_error"):
        return Check("master_port", "fail", "FAIL", f"port {job.master_port} is already in use on "
                     f"{report.host} ({master['listen_error']})",
                     f"pass a free --master_port, or leave it out and crew picks a free one (see who holds "
                     f"it: ss -ltnp 'sport = :{job.master_port}').")
    error = master.get("connect_error")
    if error:
        return Check("master_port", "fail", "FAIL", f"{where} cannot be reached from {report.host} "
                     f"({error})", f"open TCP port {job.master_port} on {job.nodes[0].host} to the other "
                     "nodes (firewall), or pass a --master_addr every node can reach.")
    return Check("master_port", "ok", "ok", f"{where} reached")


def _interfaces(facts: dict) -> Check:
    problems = facts.get("interfaces", [])
    if problems:
        return Check("interfaces", "fail", "FAIL", "; ".join(problems),
                     "set the variable to an interface of that node (.deepspeed_env or --env "
                     "NCCL_SOCKET_IFNAME=<name>), or unset it.")
    return Check("interfaces", "ok", "ok")


def _disk(facts: dict, min_free: int | None) -> Check:
    disk = facts.get("disk")
    if disk is None:
        return Check("disk", "skip", "-", "no save dir named (--save_dir)")
    free = f"{disk['free'] / 2**30:.1f} GiB free at {disk['path']}"
    if not disk["writable"]:
        return Check("disk", "fail", "FAIL", f"{disk['path']} is not writable",
                     "fix the permissions there, or save elsewhere.")
    if min_free and disk["free"] < min_free:
        return Check("disk", "fail", f"{disk['free'] / 2**30:.1f} GiB", f"only {free}",
                     f"free space there, or save elsewhere (wanted: {min_free / 2**30:.1f} GiB, --min_free_disk).")
    return Check("disk", "ok", f"{disk['free'] / 2**30:.0f} GiB", free)


# -- the commands -------------------------------------------------------------------------------------

def reference_facts(job: JobSpec, full: bool) -> dict:
    """The launching machine's copy of the code: what every node must match."""
    found = {"script": probe.script_hash(job)}
    if full:
        found["manifest"] = probe.manifest(Path(job.cwd))
    return found


def save_dir_of(args: argparse.Namespace) -> str | None:
    if args.save_dir:
        return args.save_dir
    words = list(args.script_args or [])
    for index, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag in SAVE_DIR_FLAGS:
            return value if eq else (words[index + 1] if index + 1 < len(words) else None)
    return None


def run_doctor(launch: Launch, args: argparse.Namespace) -> int:
    job = job_spec(launch, args)
    save_dir = save_dir_of(args)
    try:
        min_free = parse_bytes(args.min_free_disk)
    except CrewError:
        raise CrewError(f"--min_free_disk {args.min_free_disk}: expected a size such as 10GB, 500MB "
                        "or 1.5T (binary units).") from None
    run = run_probes(launch, args, job, full=True, save_dir=save_dir)
    reports = evaluate(launch, job, run, reference_facts(job, full=True), True, launch.ssh_args, min_free)
    ok = all(report.ok for report in reports)
    if args.json:
        print(json.dumps({"ok": ok, "launcher": launch.launcher, "master_addr": job.master_addr,
                          "master_port": job.master_port,
                          "nodes": [_report_json(r) for r in reports]}, indent=2))
    else:
        print(f"crew doctor: {len(reports)} node(s), launcher {launch.launcher}, master "
              f"{job.master_addr}:{job.master_port}, checked in {run.seconds:.1f} s\n")
        print(format_table(reports, args.verbose))
        print("\n" + format_problems(reports, args.verbose) if not ok else "\nevery check passed.")
    return 0 if ok else 1


def preflight(launch: Launch, args: argparse.Namespace, say, verbose: bool = False) -> int:
    """The quick checks as probes of their own, before `crew run` starts any agent (pdsh, which gives the
    agents no stdin to wait on); 1 (and the problems said) to refuse. Over ssh the agents do this
    themselves (`preflight_judge`)."""
    job = job_spec(launch, args)
    run = run_probes(launch, args, job, full=False, save_dir=None)
    passed, text = _verdict(launch, job, run, reference_facts(job, full=False), verbose)
    say(text)
    return 0 if passed else 1


def recheck(launch: Launch, args: argparse.Namespace) -> tuple[list[NodeReport], float]:
    """The preflight's quick checks of every node of `launch`, each node judged on its own (an elastic
    restart continues on those that pass): the reports, and the seconds they took."""
    job = job_spec(launch, args)
    run = run_probes(launch, args, job, full=False, save_dir=None)
    reports = evaluate(launch, job, run, reference_facts(job, full=False), False, launch.ssh_args, None)
    return reports, run.seconds


def preflight_judge(launch: Launch, job: JobSpec, verbose: bool = False) -> Judge:
    """How `crew run` over ssh judges the facts its agents sent (crew.launcher.preflight.gate)."""
    reference = reference_facts(job, full=False)

    def judge(facts: dict, errors: dict, seconds: float) -> tuple[bool, str]:
        return _verdict(launch, job, ProbeRun(facts, errors, seconds), reference, verbose)
    return judge


def _verdict(launch: Launch, job: JobSpec, run: ProbeRun, reference: dict, verbose: bool) -> tuple[bool, str]:
    reports = evaluate(launch, job, run, reference, False, launch.ssh_args, None)
    if all(report.ok for report in reports):
        first = run.facts[0]
        return True, (f"preflight: {len(reports)} node(s) agree (python {first['python']}, torch "
                      f"{first['torch']}, crew {first['crew']}, same script) in {run.seconds:.2f} s")
    return False, ("preflight found problems; no rank was started:\n" + format_problems(reports, verbose)
                   + "\n(`crew doctor` with the same options checks everything; --skip_preflight starts anyway.)")


def _report_json(report: NodeReport) -> dict:
    return {"node": report.node, "host": report.host, "ssh_port": report.ssh_port, "ok": report.ok,
            "checks": {name: {k: v for k, v in asdict(c).items() if k != "name"}
                       for name, c in report.checks.items()}}


def format_table(reports: list[NodeReport], verbose: bool = True) -> str:
    """One row per node; past SHOWN_ROWS nodes (unless `verbose`), one row per group of nodes whose
    checks all read the same, with a line that counts them first."""
    names = list(dict.fromkeys(name for r in reports for name in r.checks))
    groups = group_reports(reports, names)
    grouped = not verbose and len(reports) > SHOWN_ROWS
    rows = [["nodes" if grouped else "node", "host", *names]]
    for members in groups.values() if grouped else [[r] for r in reports]:
        first = members[0]
        rows.append([node_spans(r.node for r in members), _hosts(members),
                     *(_cell(first.checks.get(name)) for name in names)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                      for row in rows)
    return (summary_line(reports, names) + "\n" + table) if grouped else table


def group_reports(reports: list[NodeReport], names: list[str]) -> dict[tuple, list[NodeReport]]:
    """Nodes whose checks show the same cells, in node order of each group's first node."""
    groups: dict[tuple, list[NodeReport]] = {}
    for report in reports:
        groups.setdefault(tuple(_cell(report.checks.get(name)) for name in names), []).append(report)
    return groups


def summary_line(reports: list[NodeReport], names: list[str]) -> str:
    """`62 node(s) ok; 2 differ: a (node 3), b (node 9)`, within LINE_MAX characters."""
    bad = [r for r in reports if not r.ok]
    head = f"{len(reports) - len(bad)} node(s) ok"
    if not bad:
        return head + (", all alike" if len(group_reports(reports, names)) == 1 else "")
    return fit_list(f"{head}; {len(bad)} fail: ", [f"{r.host} (node {r.node})" for r in bad])


def node_spans(numbers) -> str:
    """`0-61,63`: node numbers as ranges, or `0..63 (62)` when that would be long."""
    numbers = sorted(numbers)
    text = spans(numbers, ",")
    return text if len(text) <= 24 else f"{numbers[0]}..{numbers[-1]} ({len(numbers)})"


def _hosts(members: list[NodeReport]) -> str:
    if len(members) == 1:
        return members[0].host
    return f"{members[0].host} +{len(members) - 1}"


def _cell(check: Check | None) -> str:
    if check is None or check.status == "skip":
        return "-"
    return check.value if check.status == "ok" else f"✗ {check.value}"


def format_problems(reports: list[NodeReport], verbose: bool = True) -> str:
    """Each failed check with its fix. Past SHOWN_ROWS nodes (unless `verbose`), the same problem on several
    nodes (the same text but for the host name) is said once, naming the first few nodes."""
    grouped = not verbose and len(reports) > SHOWN_ROWS
    groups: dict[tuple, list[tuple[NodeReport, Check]]] = {}
    for report in reports:
        for check in report.checks.values():
            if check.status == "fail":
                key = (check.name, check.detail.replace(report.host, "{host}"),
                       check.fix.replace(report.host, "{host}")) if grouped else (report.node, check.name)
                groups.setdefault(key, []).append((report, check))
    lines = []
    for members in groups.values():
        report, check = members[0]
        where = [f"{r.host} (node {r.node})" for r, _ in members]
        head = where[0] if len(members) == 1 else fit_list(f"{len(members)} nodes: ", where, LINE_MAX // 2)
        lines.append(f"✗ {head} {check.name}: {check.detail}")
        lines += [f"    {line}" for line in f"fix: {check.fix}".splitlines()]
    return "\n".join(lines)
