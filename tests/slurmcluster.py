"""A throwaway one-machine Slurm cluster for the `--launcher slurm` tests: real slurmctld, slurmd and munged.

Everything is private to the cluster: its own slurm.conf, munge key and munged (on its own socket),
controller and node ports picked free, state, logs and pid files under `root`. Clients reach it with
the environment from `SlurmCluster.env()` (SLURM_CONF; the munge socket is named in slurm.conf's
AuthInfo, so clients need nothing else). Nothing of the system's Slurm or munge set-up is used or
touched, and system daemons on the default ports do not get in the way.

Several nodes on one machine: Debian's Slurm (bookworm, 22.05.8) is built with multiple-slurmd
support, so each node is its own slurmd (`slurmd -N nodeK`) with its own port and spool folder, all
with NodeHostname=localhost. A step's tasks really run under different slurmds (SLURMD_NODENAME,
SLURM_NODEID differ), but on the same machine and filesystem, and `hostname` says this machine's name.
Node names are node1, node2, ... (not resolvable) or, with loopback_names, 127.0.0.2, 127.0.0.3, ...

Choices that matter for what a job sees:
- ProctrackType=proctrack/pgid: a step's processes are found by process group. With
  proctrack/linuxproc (parent-child tree) a task's background children that outlive it are reparented
  to init and escape: srun's double Ctrl-C then left them running and the step stuck in COMPLETING.
  There are no cgroups to use in a container (proctrack/cgroup).
- KillWait=5: a cancelled step's tasks get SIGTERM, then SIGKILL 5 s later (Slurm's default is 30 s).
  srun itself does not wait that long: one SIGINT only prints the step's state, a second within a
  second sends the tasks SIGINT and at once SIGKILL, and SIGTERM SIGKILLs them. To give the tasks
  SIGTERM, use `scancel --signal=TERM JOB.STEP`.
- SelectType=select/cons_tres with CR_CPU: a job gets the CPUs it asks for (one per task by default),
  so SLURM_JOB_CPUS_PER_NODE is the request, not the node's size (use --exclusive for whole nodes).
- SlurmdParameters=config_overrides: nodes may claim more CPUs than the machine has.
- GPUs only with gpus_per_node > 0 (fake ones, see fake_gpus); without them --gpus-per-node is an error.

Needs root (slurmd starts tasks as the submitting user). The daemons start in about a second.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from crew.launcher.plan.ports import free_port

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("srun", "salloc", "sinfo", "squeue", "scontrol", "scancel")
# Inherited job variables would make srun/salloc think they run inside another job.
JOB_VARIABLE_PREFIXES = ("SLURM_", "SALLOC_", "SBATCH_", "SRUN_")


def slurm_missing_reason() -> str | None:
    """Why a private Slurm cluster cannot run here, or None when it can."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if not _which(name)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd "
                "slurm-client munge (`make test` does it)")
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd starts tasks as the submitting user)"
    return None


def _which(name: str) -> str | None:
    """Daemons live in /usr/sbin, which a non-root PATH often lacks."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    nodes: list[str]
    cpus_per_node: int
    run_dir: Path  # short path for the unix sockets (108-byte limit): munge's and slurmstepd's
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """A whole environment for a client subprocess: `base` (default os.environ) without inherited
        Slurm job variables, plus SLURM_CONF pointing at this cluster."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith(JOB_VARIABLE_PREFIXES)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *argv: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client (srun, sinfo, ...) against this cluster and wait for it."""
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout, **kwargs)

    def logs_tail(self, lines: int = 15) -> str:
        """The last lines of every daemon's log and output (fatal config errors come before the log opens)."""
        parts = []
        for log in sorted([*self.root.glob("*.log"), *self.root.glob("*.out")]):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons (nodes first, munged last) and wait for them."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self._cancel_jobs()
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc:
                _stop_process(proc)
        _kill_stray_stepds(self.root)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _cancel_jobs(self, timeout: float = 15) -> None:
        """Jobs' slurmstepd processes are not the daemons' children: end them through Slurm, and wait
        until the queue is empty, so that stopping leaves no task behind."""
        deadline = time.monotonic() + timeout
        try:
            jobs = self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
            if jobs:
                self.run("scancel", "--full", *jobs, timeout=10)
            while jobs and time.monotonic() < deadline:
                time.sleep(0.2)
                jobs = self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
        except subprocess.TimeoutExpired:
            pass


def _kill_stray_stepds(root: Path) -> None:
    """A slurmstepd can outlive its job (seen after srun was SIGKILLed) and ignores SIGTERM. This cluster's
    are those working in `root`, where their slurmd started: SIGKILL their tasks' process groups, then them."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    stepds = [pid for pid in pids if _is_stepd_in(pid, root)]
    for pid in pids:
        if _parent(pid) in stepds:
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
    for pid in stepds:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _is_stepd_in(pid: int, root: Path) -> bool:
    try:
        command, cwd = Path(f"/proc/{pid}/cmdline").read_bytes(), os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return command.startswith(b"slurmstepd") and cwd in (str(root), f"{root} (deleted)")


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM the daemon's process group (slurmctld has a slurmscriptd child), SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            continue


def start_cluster(root: Path, nodes: int = 2, cpus_per_node: int = 2, gpus_per_node: int = 0,
                  loopback_names: bool = False, timeout: float = 30, requeue_wait: int | None = None) -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per node; return once every node is idle.

    Nodes are node1, node2, ... (names that resolve nowhere), or with `loopback_names` 127.0.0.2,
    127.0.0.3, ... as in tests/sshnodes.py, so that SLURM_JOB_NODELIST (127.0.0.[2-3]) names hosts a job
    can connect to (MASTER_ADDR). `gpus_per_node` > 0 gives each node that many fake GPUs (gres/gpu), so
    steps see CUDA_VISIBLE_DEVICES. `requeue_wait`: seconds a requeued job waits before it starts again (Slurm's
    default: 120, its step credentials' lifetime, cred_expire; and then until the main scheduler's next pass,
    up to a minute, which runs every second with it)."""
    root = root.resolve()
    (root / "state").mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="crew-slurm-"))
    run_dir.chmod(0o755)  # munged wants its socket's folder searchable by all
    names = [f"127.0.0.{i + 2}" if loopback_names else f"node{i + 1}" for i in range(nodes)]
    cluster = SlurmCluster(root, root / "slurm.conf", names, cpus_per_node, run_dir)
    try:
        ports = free_ports(2 + nodes)
        cluster.conf.write_text(slurm_conf(root, run_dir, names, cpus_per_node, ports, gpus_per_node, requeue_wait))
        if gpus_per_node:
            (root / "gres.conf").write_text(fake_gpus(root, gpus_per_node))
        for name in names:
            (run_dir / "spool" / name).mkdir(parents=True)
        cluster.procs["munged"] = _start_munged(root, run_dir)
        cluster.procs["slurmctld"] = _daemon(root, "slurmctld", ["-D", "-f", str(cluster.conf)])
        for name in names:
            cluster.procs[f"slurmd-{name}"] = _daemon(root, f"slurmd-{name}",
                                                      ["-D", "-N", name, "-f", str(cluster.conf)], "slurmd")
        _wait_idle(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free right now."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def slurm_conf(root: Path, run_dir: Path, names: list[str], cpus: int, ports: list[int], gpus: int = 0,
               requeue_wait: int | None = None) -> str:
    """slurm.conf for a private cluster: ports[0] controller, ports[1] default slurmd, then one per node."""
    host = socket.gethostname().split(".")[0]  # slurmctld only runs where SlurmctldHost names it
    lines = [
        "ClusterName=crewtest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={run_dir / 'munge.socket'}" + (f",cred_expire={requeue_wait}" if requeue_wait else ""),
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={run_dir / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "ReturnToService=2",
        "KillWait=5",
        "MailProg=/bin/true",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
    ]
    lines += ["SchedulerParameters=sched_interval=1"] if requeue_wait else []
    gres = f" Gres=gpu:{gpus}" if gpus else ""
    lines += ["GresTypes=gpu"] if gpus else []
    lines += [f"NodeName={name} NodeHostname=localhost NodeAddr={_address(name)} Port={port} CPUs={cpus}{gres}"
              " State=UNKNOWN" for name, port in zip(names, ports[2:])]
    lines.append(f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _address(name: str) -> str:
    """Where slurmctld reaches a node's slurmd: its own name when that is a loopback address."""
    return name if name.startswith("127.") else "127.0.0.1"


def fake_gpus(root: Path, count: int) -> str:
    """gres.conf for `count` fake GPUs per node: links nvidiaK -> /dev/null, since slurmd wants a device
    file (a plain file is refused) and task/none constrains no device; CUDA_VISIBLE_DEVICES numbers them."""
    (root / "dev").mkdir(exist_ok=True)
    for index in range(count):
        (root / "dev" / f"nvidia{index}").symlink_to("/dev/null")
    return f"AutoDetect=off\nName=gpu File={root / 'dev'}/nvidia[0-{count - 1}]\n"


def _start_munged(root: Path, run_dir: Path) -> subprocess.Popen:
    """munged with a fresh key of this cluster's own. --force: it refuses sockets under a folder (such as
    pytest's 0700 tmp folders) that not everyone can search, which is no concern for a test cluster."""
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    proc = _daemon(root, "munged", [
        "--foreground", "--force", f"--socket={run_dir / 'munge.socket'}", f"--key-file={key}",
        f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
        f"--seed-file={root / 'munged.seed'}"])
    deadline = time.monotonic() + 10
    while not (run_dir / "munge.socket").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_process(proc)
            log = (root / "munged.log").read_text(errors="replace") if (root / "munged.log").exists() else ""
            raise RuntimeError(f"munged did not start (exit {proc.returncode}):\n{log[-2000:]}")
        time.sleep(0.02)
    return proc


def _daemon(root: Path, name: str, args: list[str], program: str | None = None) -> subprocess.Popen:
    """Start a daemon in the foreground, as its own process group, its output in `name`.out."""
    binary = _which(program or name)
    if binary is None:
        raise RuntimeError(f"{program or name} is not installed: {slurm_missing_reason()}")
    with open(root / f"{name}.out", "ab") as out:
        return subprocess.Popen([binary, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=root)


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    """Until `sinfo` shows every node idle; a daemon that exits or a timeout fails with the logs' tails."""
    deadline = time.monotonic() + timeout
    states: list[str] = []
    while time.monotonic() < deadline:
        dead = [name for name, proc in cluster.procs.items() if proc.poll() is not None]
        if dead:
            raise RuntimeError(f"Slurm daemon(s) {', '.join(dead)} exited while starting\n{cluster.logs_tail()}")
        probe = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", timeout=10)
        states = probe.stdout.split("\n")
        if probe.returncode == 0 and sum(line.endswith(" idle") for line in states) == len(cluster.nodes):
            return
        time.sleep(0.1)
    raise RuntimeError(f"Slurm nodes not idle after {timeout}s (sinfo: {' / '.join(filter(None, states))})\n"
                       f"{cluster.logs_tail()}")
