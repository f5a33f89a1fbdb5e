"""The MPI runners (DeepSpeed's `--launcher openmpi|mpich|impi|mvapich`): one mpirun starts crew's node agent
once per node, as one srun does under Slurm, and each agent takes its node from the MPI rank mpirun gave it
(`--node_rank mpi`, protocol.mpi_node). The agents then start the ranks as on every other runner.

- One process per node, in the plan's order: OpenMPI `-n N --host h1,h2,...` (each host once: one slot
  each); Hydra (MPICH, Intel MPI, MVAPICH2) `-n N -ppn 1 -hosts h1,h2,...`. Unequal slot counts and the
  --include/--exclude/--num_nodes/--num_gpus filters, which DeepSpeed refuses for these launchers, are fine:
  mpirun places agents, not ranks.
- The spec travels in argv (base64, as for pdsh) and the agents watch their stdout for the launcher going
  away. mpirun forwards stdin to one process only; Open MPI 4.1's `--stdin all` gives the processes on
  mpirun's own node an EOF at once and then never exits, so crew does not use it.
- crew stops the agents with a signal to mpirun alone, which passes it on to every agent and waits for them:
  Open MPI SIGUSR2 (its SIGTERM gives the processes one second before SIGKILL, odls_base_sigkill_timeout),
  Hydra SIGTERM. The agents stop their ranks with the usual grace and exit 0 (their codes travel in `done`),
  so that mpirun never aborts the job itself. A preemption notice goes to mpirun as SIGUSR1, which both pass on.
- One node on this machine runs without mpirun, as under DeepSpeed (launch.resolve).
- Open MPI gets `--bind-to none` (unless --launcher_args say --bind-to): by default it binds a job of one or two
  processes per node to one core, and every rank inherits its agent's cores.
- No MPI data-transport options (DeepSpeed's `--mca btl ^openib --mca btl_tcp_if_include eth0`, UCX_TLS,
  MV2_*): the agents never call MPI_Init, and the ranks talk over torch.distributed, not MPI. Intel MPI gets
  `-genv I_MPI_PIN 0` as under DeepSpeed: its pinning would bind the agent, and every rank with it, to a
  few cores.
- ssh: crew's ssh options (BatchMode..., PDSH_SSH_ARGS_APPEND, --ssh_args, the hostfile's one ssh port) go
  to mpirun's own ssh calls: OpenMPI `--mca plm_rsh_args`, Hydra HYDRA_LAUNCHER_EXTRA_ARGS, Intel MPI
  I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS. Both split that text at spaces, without quoting, so a word with a
  space in it is refused, as are different ssh ports per host (one option string serves every host).
  Not for Open MPI when plm_rsh_agent (OMPI_MCA_plm_rsh_agent, or --mca in --launcher_args) is not ssh.
- Root: OpenMPI's mpirun refuses to run as root; crew passes `--allow-run-as-root` when it runs as root,
  since mpirun starts only crew's agents (containers often run as root).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from crew.errors import LaunchError, PlanError
from crew.launcher.plan.hostfile import is_ipv6
from crew.launcher.transport.protocol import JobSpec


@dataclass(frozen=True)
class Flavour:
    name: str  # the --launcher value
    title: str  # the MPI's name in messages
    binaries: tuple[str, ...]  # mpirun names to try, the implementation's own first
    signatures: tuple[str, ...]  # what `mpirun --version` (mvapich: `mpiname`) says for this MPI (one of them)
    install: str  # how to get it
    ssh_env: str | None  # the variable that takes ssh's extra arguments (Hydra); None: OpenMPI's --mca


FLAVOURS = {f.name: f for f in (
    Flavour("openmpi", "Open MPI", ("mpirun.openmpi", "mpirun", "mpiexec", "orterun"),
            ("Open MPI", "OpenRTE", "open-mpi.org"),
            "apt-get install openmpi-bin (Debian/Ubuntu), dnf install openmpi (RHEL; then module load mpi), or put "
            "Open MPI's bin/ first on PATH", None),
    Flavour("mpich", "MPICH", ("mpirun.mpich", "mpiexec.mpich", "mpiexec.hydra", "mpirun", "mpiexec"), ("HYDRA",),
            "apt-get install mpich (Debian/Ubuntu), dnf install mpich (RHEL; then module load mpi), or put MPICH's "
            "bin/ first on PATH", "HYDRA_LAUNCHER_EXTRA_ARGS"),
    Flavour("impi", "Intel MPI", ("mpirun", "mpiexec.hydra"), ("Intel(R) MPI",),
            "install Intel MPI (oneAPI) and source its setvars.sh (or vars.sh), so that its mpirun is first on PATH",
            "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS"),
    Flavour("mvapich", "MVAPICH2", ("mpirun", "mpiexec.hydra"), ("MVAPICH2",),
            "install MVAPICH2 (or MVAPICH2-GDR) and put its bin/ first on PATH (mpiname must say MVAPICH2)",
            "HYDRA_LAUNCHER_EXTRA_ARGS"),
)}
MPI_RUNNERS = tuple(FLAVOURS)
VERSION_TIMEOUT_S = 10.0
# How the ssh client says it could not log in (group 1: the host, when it names one). Hydra then waits for
# that node forever, so crew ends the job on the line itself.
_SSH_FAILURES = tuple(re.compile(pattern) for pattern in (
    r"ssh: connect to host (\S+) port \d+: ", r"ssh: Could not resolve hostname (\S+?):",
    r"(?:\S+@)?(\S+): Permission denied \(", r"()Host key verification failed"))


def mpirun_for(launcher: str) -> str:
    """The mpirun this launcher runs: the first of its names on PATH (the bare first name when none is, for
    `crew plan`; `check` says what is wrong before anything starts)."""
    flavour = FLAVOURS[launcher]
    return next((name for name in flavour.binaries if shutil.which(name)), flavour.binaries[0])


def check(launcher: str) -> str:
    """The mpirun to use, once its `--version` (mvapich: `mpiname`, as DeepSpeed) says it is the MPI asked
    for; else a LaunchError naming what was found and the fix."""
    flavour, binary = FLAVOURS[launcher], mpirun_for(launcher)
    if not shutil.which(binary):
        raise LaunchError(f"--launcher {launcher}: no mpirun here ({', '.join(flavour.binaries)}: none on PATH). "
                          f"Install {flavour.title}: {flavour.install}.")
    probe = ["mpiname"] if launcher == "mvapich" else [binary, "--version"]
    said = _output(probe)
    if not _says(said, flavour):
        found = said.strip().splitlines()[0] if said.strip() else "no answer"
        raise LaunchError(f"--launcher {launcher}: {shlex.join(probe)} says {found!r}, which is not "
                          f"{flavour.title}{_other_mpi(launcher, said)}. Install {flavour.title}: {flavour.install}.")
    return binary


def _output(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({exc})"
    return done.stdout + done.stderr


def _says(text: str, flavour: Flavour) -> bool:
    return any(signature.lower() in text.lower() for signature in flavour.signatures)


def _other_mpi(launcher: str, said: str) -> str:
    """` (it is X: --launcher Y runs it)` when the text is another MPI crew knows."""
    for other in FLAVOURS.values():
        if other.name not in (launcher, "mvapich") and _says(said, other):
            return f" (it is {other.title}: --launcher {other.name} runs it)"
    return ""


def ssh_words(ports: Sequence[int | None], ssh_options: Sequence[str], ssh_args: Sequence[str],
              launcher: str) -> list[str]:
    """The ssh client's extra words for mpirun's own ssh calls: one set for every host."""
    distinct = set(ports)
    if len(distinct) > 1:
        raise PlanError(f"--launcher {launcher}: the hostfile gives different ssh ports per host, and mpirun passes "
                        "one set of ssh options to every host. Put 'Port' lines under 'Host' entries in "
                        "~/.ssh/config, or use --launcher ssh, which reads the ports from the hostfile.")
    port = distinct.pop() if distinct else None
    words = [*ssh_options, *ssh_args, *(["-p", str(port)] if port else [])]
    spaced = [word for word in words if not word or any(char.isspace() for char in word)]
    if spaced:
        raise PlanError(f"--launcher {launcher}: the ssh argument {spaced[0]!r} (--ssh_args, PDSH_SSH_ARGS_APPEND) "
                        "has a space in it, and mpirun splits its ssh options at spaces. Use a path without "
                        "spaces, or put the option in ~/.ssh/config.")
    return words


def validate(launcher: str, hosts: Sequence[str], ports: Sequence[int | None], ssh_options: Sequence[str],
             ssh_args: Sequence[str]) -> None:
    """What mpirun could not take, said before anything starts (the preflight included)."""
    check_hosts(hosts, launcher)
    ssh_words(ports, ssh_options, ssh_args, launcher)


def check_hosts(hosts: Sequence[str], launcher: str) -> list[str]:
    for host in hosts:
        if is_ipv6(host) or "," in host:
            raise PlanError(f"--launcher {launcher}: host {host!r}: mpirun's host lists take names and IPv4 "
                            "addresses only. Give the node a name (/etc/hosts), or use --launcher ssh.")
    return list(hosts)


def stop_signal(launcher: str) -> signal.Signals:
    """What crew sends mpirun (alone) to stop every agent gracefully: mpirun passes it on to each."""
    return signal.SIGUSR2 if launcher == "openmpi" else signal.SIGTERM


def has_option(words: Sequence[str], *names: str) -> bool:
    """Whether --launcher_args give one of these mpirun options (or, for `--mca NAME`, that MCA name)."""
    for index, word in enumerate(words):
        if word in names or word.split("=", 1)[0] in names:
            return True
        if word in ("--mca", "-mca") and index + 1 < len(words) and words[index + 1] in names:
            return True
    return False


def _rsh_is_ssh(launcher_args: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether Open MPI reaches the nodes with ssh: not when plm_rsh_agent names another program (the MPI
    Operator's kubexec.sh, rsh), which crew's ssh options would break."""
    agent = environ.get("OMPI_MCA_plm_rsh_agent", "")
    for index, word in enumerate(launcher_args[:-1]):
        if word in ("--mca", "-mca") and launcher_args[index + 1] in ("plm_rsh_agent", "orte_rsh_agent") \
                and index + 2 < len(launcher_args):
            agent = launcher_args[index + 2]
    program = agent.split()[0] if agent.split() else "ssh"
    return os.path.basename(program) == "ssh"


def mpi_argv(launcher: str, binary: str, job: JobSpec, agent: Sequence[str], ssh: Sequence[str],
             launcher_args: Sequence[str] = (), euid: int | None = None,
             environ: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """mpirun's command line (one `agent` per node) and the variables it needs, after DeepSpeed's order:
    mpirun's placement, crew's options, --launcher_args, then the program."""
    environ = os.environ if environ is None else environ
    hosts, count = check_hosts([node.host for node in job.nodes], launcher), str(len(job.nodes))
    ssh_text = " ".join(ssh)
    if launcher == "openmpi":
        root = euid == 0 and not has_option(launcher_args, "--allow-run-as-root", "-allow-run-as-root") \
            and environ.get("OMPI_ALLOW_RUN_AS_ROOT") != "1"
        ssh_given = ssh_text and _rsh_is_ssh(launcher_args, environ) and not has_option(launcher_args, "plm_rsh_args")
        rsh = ["--mca", "plm_rsh_args", ssh_text] if ssh_given else []
        bind = [] if has_option(launcher_args, "--bind-to", "-bind-to") else ["--bind-to", "none"]
        argv = [binary, "-n", count, "--host", ",".join(hosts), *(["--allow-run-as-root"] if root else []), *bind,
                *rsh]
        return [*argv, *launcher_args, *agent], {}
    flavour = FLAVOURS[launcher]
    pin = ["-genv", "I_MPI_PIN", "0"] if launcher == "impi" else []
    argv = [binary, "-n", count, "-ppn", "1", "-hosts", ",".join(hosts), *pin, *launcher_args, *agent]
    theirs = environ.get(flavour.ssh_env, "")
    return argv, {flavour.ssh_env: " ".join(filter(None, [theirs, ssh_text]))} if ssh_text else {}


def ssh_failure(line: str) -> str | None:
    """The host an ssh client's failure line (on mpirun's stderr) names, "" when it names none; None for
    any other line."""
    for pattern in _SSH_FAILURES:
        if found := pattern.match(line.strip()):
            return found.group(1)
    return None
