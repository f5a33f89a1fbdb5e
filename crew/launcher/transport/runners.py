"""How the node agents get started: local, ssh, pdsh, standalone, slurm or an mpirun (mpi.py). Plan in, argv out.

Each runner turns a JobSpec into `AgentLaunch`es, the processes `crew run` starts on the launching
machine. Whatever goes to a remote shell is built with shlex quoting from validated parts; the job spec
itself (environment values included) travels as JSON on stdin, or base64 for pdsh, never as shell text.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from crew.errors import LaunchError
from crew.launcher.transport import mpi
from crew.launcher.transport.proc import die_with_parent
from crew.launcher.transport.protocol import AGENT_MODULE, MPI_NODE_RANK, SLURM_NODE_RANK, JobSpec

RUNNERS = ("local", "ssh", "pdsh", "standalone", "slurm", *mpi.MPI_RUNNERS)
VENV_MISSING = "crew: --venv_script"  # how the remote shell's message starts when the script is missing
# BatchMode: a missing key fails at once instead of prompting on a terminal nobody watches.
# ServerAlive: a dead network path is noticed in ~30 s, and the remote agents stop their ranks.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
               "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=6")

_SSH_FIXES = (
    (VENV_MISSING, "the --venv_script file is not at that path on {host}. Put it there (the same path on "
     "every node), or pass the path it has there."),
    ("python3: not found", "after sourcing --venv_script there is no python3 on PATH on {host}. Make the "
     "script put its Python on PATH, or pass --python with the interpreter's path there."),
    ("Permission denied", "the key is not authorised there. Run 'ssh-copy-id {port}{host}' "
     "(or add the key to ~/.ssh/authorized_keys on {host}); 'ssh {port}{host} true' must work "
     "without a password."),
    ("Host key verification failed", "{host} is not in ~/.ssh/known_hosts. Connect once by hand "
     "('ssh {port}{host} true') and check the fingerprint, or add it with 'ssh-keyscan {port}{host}"
     " >> ~/.ssh/known_hosts'."),
    ("Connection refused", "nothing listens for ssh there. Start sshd on {host}, or give the "
     "right ssh port in the hostfile ('{host}:<port> slots=N')."),
    ("Could not resolve hostname", "the name does not resolve. Fix the hostfile, or add a 'Host' "
     "entry with a HostName to ~/.ssh/config."),
    ("timed out", "{host} does not answer. Check the address, the port and the firewall."),
    ("No module named", "crew is not installed for that Python on {host}. Install crew there in "
     "the same environment (same path), or pass --python with the interpreter that has it."),
    ("No such file or directory", "the Python interpreter is missing at that path on {host}. "
     "Install the same environment at the same path on every node, or pass --python."),
)


@dataclass(frozen=True)
class AgentLaunch:
    """One process on the launching machine that runs the agent of one node (or of all, for pdsh)."""

    node_ranks: tuple[int, ...]
    argv: tuple[str, ...]
    label: str  # how messages name it: the host, "pdsh" or "srun"
    spec_on_stdin: bool = True
    env: dict[str, str] | None = None  # extra environment for this launching-side process
    # How to end it at once (and what it gets when crew dies): srun must get SIGTERM, on which it kills
    # its tasks; a SIGKILLed srun leaves them running until the allocation ends.
    kill_signal: signal.Signals = signal.SIGKILL
    chatter: tuple[bytes, ...] = ()  # how its own stderr lines start: kept off the console once crew stops
    stop_signal: signal.Signals | None = None  # mpirun: how to ask it alone to stop (it passes it on to the agents)


def start(launch: AgentLaunch) -> subprocess.Popen:
    """Start one launching-side process, with pipes for stdin, stdout and stderr (OSError if it cannot).

    Own session: a Ctrl-C reaches only `crew`, which then stops every node in order. It dies with
    `crew`: pdsh would outlive it (it ignores SIGPIPE), keeping nodes busy.
    """
    env = {**os.environ, **launch.env} if launch.env else None
    return subprocess.Popen(launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True,
                            preexec_fn=lambda: die_with_parent(launch.kill_signal))


def entry(module: str) -> str:
    """Python text that runs `module` as `-m` would, without the working directory first on sys.path: a
    folder named `crew/` there (a user's outputs) would be imported as an empty namespace package in place
    of an editable install. (-P does this from Python 3.11 only, and a node may run 3.10.)"""
    return ("import runpy, sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def agent_argv(python: str, job: JobSpec, node_rank: int | str, *extra: str,
               module: str = AGENT_MODULE) -> list[str]:
    return [python, "-u", "-c", entry(module), "--job", job.job_id, "--node_rank", str(node_rank), *extra]


def remote_command(python: str, job: JobSpec, node_rank: int | str, *extra: str,
                   module: str = AGENT_MODULE, venv: str | None = None) -> str:
    """Shell text for the remote side: go to the launching directory, source --venv_script (`venv`),
    start the agent there.

    A failed `cd` does not stop the agent: it reports the missing directory itself, with the fix.
    PYTHONPATH is set for the agent too, so crew runs from a source checkout on every node.
    """
    command = shlex.join(agent_argv(python, job, node_rank, *extra, module=module))
    if "PYTHONPATH" in job.env:
        command = f"env PYTHONPATH={shlex.quote(job.env['PYTHONPATH'])} {command}"
    host = job.nodes[node_rank].host if isinstance(node_rank, int) else None
    return f"cd {shlex.quote(job.cwd)}; {venv_prelude(venv, host)}exec {command}"


def venv_prelude(venv: str | None, host: str | None = None) -> str:
    """POSIX shell text that sources --venv_script, or stops with a message naming the file and the host
    (`host`, else the node's own name) when it cannot be read there."""
    if not venv:
        return ""
    where = shlex.quote(host) if host else '"$(uname -n)"'
    message = f"{shlex.quote(f'{VENV_MISSING} {venv}: no such readable file on')} {where}"
    return f"[ -r {shlex.quote(venv)} ] || {{ echo {message} >&2; exit 127; }}; . {shlex.quote(venv)}; "


def ssh_argv(host: str, port: int | None, ssh_args: Sequence[str], command: str) -> list[str]:
    """The ssh client command that runs the shell text `command` on `host`."""
    return ["ssh", *SSH_OPTIONS, *ssh_args, *(["-p", str(port)] if port else []), "--", host, command]


def local_launches(job: JobSpec, python: str, node_rank: int = 0, module: str = AGENT_MODULE,
                   extra: Sequence[str] = ()) -> list[AgentLaunch]:
    """`local` (one node, this machine) and `standalone` (this machine's node of a larger world)."""
    argv = agent_argv(python, job, node_rank, *extra, module=module)
    return [AgentLaunch((node_rank,), tuple(argv), job.nodes[node_rank].host)]


def ssh_launches(job: JobSpec, python: str, ports: Sequence[int | None], ssh_args: Sequence[str] = (),
                 module: str = AGENT_MODULE, extra: Sequence[str] = (), venv: str | None = None) -> list[AgentLaunch]:
    launches = []
    for node_rank, (node, port) in enumerate(zip(job.nodes, ports, strict=True)):
        command = remote_command(python, job, node_rank, *extra, module=module, venv=venv)
        launches.append(AgentLaunch((node_rank,), tuple(ssh_argv(node.host, port, ssh_args, command)),
                                    node.host))
    return launches


def pdsh_launches(job: JobSpec, python: str, ports: Sequence[int | None], ssh_args: Sequence[str] = (),
                  module: str = AGENT_MODULE, extra: Sequence[str] = (), venv: str | None = None,
                  launcher_args: Sequence[str] = ()) -> list[AgentLaunch]:
    """One pdsh for all nodes; pdsh puts each node's rank in its list where the command says %n.
    --launcher_args go after pdsh's own options. PDSH_SSH_ARGS_APPEND is crew's ssh options, the user's
    value of it included (resolve put its words first in `ssh_args`)."""
    if not shutil.which("pdsh"):
        raise LaunchError(
            "--launcher pdsh: pdsh is not installed on this machine. Install it "
            "(Debian/Ubuntu: apt-get install pdsh; RHEL: dnf install pdsh pdsh-rcmd-ssh), or use "
            "--launcher ssh, which needs only the ssh client.")
    distinct = set(ports)
    if len(distinct) > 1:
        raise LaunchError(
            "--launcher pdsh: the hostfile gives different ssh ports per host, which pdsh cannot "
            "pass per host. Put 'Port' lines under 'Host' entries in ~/.ssh/config, or use "
            "--launcher ssh, which reads the ports from the hostfile.")
    port = distinct.pop()
    ssh = [*SSH_OPTIONS, *ssh_args, *(["-p", str(port)] if port else [])]
    command = remote_command(python, job, "%n", *extra, "--spec_b64", job.to_b64(), "--watch", "stdout",
                             module=module, venv=venv)
    argv = ["pdsh", "-S", "-N", "-R", "ssh", "-f", str(max(32, len(job.nodes))),
            "-w", ",".join(node.host for node in job.nodes), *launcher_args, command]
    return [AgentLaunch(tuple(range(len(job.nodes))), tuple(argv), "pdsh", spec_on_stdin=False,
                        env={"PDSH_SSH_ARGS_APPEND": shlex.join(ssh)})]


def slurm_launches(job: JobSpec, python: str, options: Sequence[str] = (), module: str = AGENT_MODULE,
                   extra: Sequence[str] = (), venv: str | None = None) -> list[AgentLaunch]:
    """One srun for every node (no ssh, no fan-out): one task per node, each an agent that finds its own
    node by name. The agent's stdin is every task's (`--input=all`): the spec, `go`, `stacks` and EOF
    reach all nodes at once. Other modules (the doctor's probe) get the spec in argv, as under pdsh.
    `--whole` gives each agent its nodes' CPUs (a step otherwise gets one CPU per task). srun must not end
    the step when one agent fails (`--kill-on-bad-exit=0`, whatever slurm.conf's KillOnBadExit says): crew
    stops the other nodes itself, after the failing node's report, which srun's kill could overtake (the
    other agents would then report an outside stop); an agent that ends without a report is judged from
    srun's line on it (job.holds). A crew killed outright takes the step down: srun gets SIGTERM."""
    if not shutil.which("srun"):
        raise LaunchError("--launcher slurm: srun is not installed here (not on PATH). Run crew where srun "
                          "works: in the salloc shell or the sbatch script, on a node of the cluster.")
    on_stdin = module == AGENT_MODULE
    spec = () if on_stdin else ("--spec_b64", job.to_b64())
    count = len(job.nodes)
    srun = ["srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1",
            f"--nodelist={','.join(node.host for node in job.nodes)}", "--kill-on-bad-exit=0",
            "--export=ALL", f"--input={'all' if on_stdin else 'none'}", "--whole", f"--chdir={job.cwd}",
            *options]
    agent = agent_argv(python, job, SLURM_NODE_RANK, *extra, *spec, module=module)
    if venv:  # --venv_script: sourced by a shell, which then becomes the agent
        agent = ["sh", "-c", f"{venv_prelude(venv)}exec {shlex.join(agent)}"]
    argv = [*srun, *agent]  # `options` end with --launcher_args
    return [AgentLaunch(tuple(range(count)), tuple(argv), "srun", spec_on_stdin=on_stdin,
                        kill_signal=signal.SIGTERM, chatter=(b"srun: ", b"slurmstepd"))]


def mpi_launches(job: JobSpec, python: str, ports: Sequence[int | None], launcher: str, binary: str,
                 ssh_args: Sequence[str] = (), extra: Sequence[str] = (), venv: str | None = None,
                 launcher_args: Sequence[str] = ()) -> list[AgentLaunch]:
    """One mpirun for every node (mpi.py): each node's agent is a shell that goes to the launching directory,
    sources --venv_script and becomes the agent, which takes its node from its MPI rank. The spec is in argv
    and the agents watch their stdout, as under pdsh; crew stops them with a signal mpirun passes on
    (`mpi.stop_signal`). A crew killed outright takes mpirun down with SIGTERM, on which it stops its daemons
    and every agent."""
    command = remote_command(python, job, MPI_NODE_RANK, *extra, "--spec_b64", job.to_b64(), "--watch", "stdout",
                             venv=venv)
    ssh = mpi.ssh_words(ports, SSH_OPTIONS, ssh_args, launcher)
    argv, env = mpi.mpi_argv(launcher, binary, job, ["sh", "-c", command], ssh, launcher_args, os.geteuid())
    return [AgentLaunch(tuple(range(len(job.nodes))), tuple(argv), "mpirun", spec_on_stdin=False, env=env,
                        kill_signal=signal.SIGTERM, chatter=(b"[mpiexec@", b"[proxy:"),
                        stop_signal=mpi.stop_signal(launcher))]


def ssh_config(host: str, port: int | None, ssh_args: Sequence[str] = ()) -> dict:
    """What ssh would use for `host` (`ssh -G`: ~/.ssh/config evaluated, no connection opened).

    Keys are lower case; `identityfile` is a list. Empty when ssh cannot say.
    """
    argv = ["ssh", "-G", *ssh_args, *(["-p", str(port)] if port else []), "--", host]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    config: dict = {"identityfile": []}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "identityfile":
            config[key].append(value)
        elif value:
            config.setdefault(key, value)
    return config


def resolve_ssh_host(host: str, port: int | None, ssh_args: Sequence[str] = ()) -> str:
    """The address ssh really connects to for `host` (~/.ssh/config HostName), else `host`.

    Used for the default master address: an ssh alias means nothing to the ranks' TCP store.
    """
    return ssh_config(host, port, ssh_args).get("hostname") or host

def ssh_fix(stderr_lines: Sequence[str], host: str, port: int | None) -> str | None:
    """The fix for the first known ssh (or remote Python) failure in `stderr_lines`, if any."""
    port_flag = f"-p {port} " if port else ""
    for needle, fix in _SSH_FIXES:
        if any(needle in line for line in stderr_lines):
            return fix.format(host=host, port=port_flag)
    return None
