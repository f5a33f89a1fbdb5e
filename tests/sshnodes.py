"""Throwaway "nodes" for multi-node tests: real sshd instances on 127.0.0.2, 127.0.0.3, ...

Each node is an sshd listening on one loopback address only, on a port picked free on all of them,
with its own host key, a throwaway client key, and an ssh_config file that pins the key and a
known_hosts file holding exactly these host keys. Host-key checking stays on. Tests reach the nodes
through crew's real ssh runner with `--ssh_args "-F <config>"` (or CREW_SSH_ARGS).
Used by the tests and by benchmarks/launch.py.

A node can get its own view of the filesystem: its sshd starts in a mount namespace of its own
(`unshare --mount`) with bind mounts, so a file or folder at one path differs on that node only, as
on a real second machine. Every command run over ssh on that node inherits the view.

`clean_login=True` gives every login HOME=<root>/home, an empty folder (sshd's `SetEnv`, OpenSSH
>= 8.7), so the login shell sources no ~/.bashrc of this machine's user; authorized_keys is looked up
by path (AuthorizedKeysFile), not under HOME, so logins still work.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from crew.launcher.plan.ports import can_bind, free_port

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def mount_namespace_missing_reason() -> str | None:
    """Why a node cannot get its own filesystem view here, or None when it can."""
    if not shutil.which("unshare"):
        return "unshare is not installed (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a mount namespace here: {probe.stderr.strip()} (needs root)"
    return None


def sshd_missing_reason() -> str | None:
    """Why loopback sshd nodes cannot run here, or None when they can."""
    if not os.path.exists(SSHD):
        return "sshd is not installed (apt-get install openssh-server; `make test` does it)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "the OpenSSH client is not installed (apt-get install openssh-client)"
    return None


def free_port_on(addresses: list[str]) -> int:
    """A port free on every address, so all nodes share one ssh port (pdsh needs that)."""
    for _ in range(50):
        port = free_port(addresses[0])
        if all(can_bind(address, port) for address in addresses):
            return port
    raise RuntimeError(f"no port free on all of {addresses}")


@dataclass
class Cluster:
    root: Path
    addresses: list[str]
    port: int
    config: Path  # ssh client config to pass with -F
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def ssh_args(self) -> str:
        return f"-F {self.config}"

    def hostfile(self, slots: int = 2, with_port: bool = True, extra: str = "") -> Path:
        lines = [f"{a}:{self.port} slots={slots}{extra}" if with_port else f"{a} slots={slots}{extra}"
                 for a in self.addresses]
        path = self.root / "hostfile"
        path.write_text("\n".join(lines) + "\n")
        return path

    def stop_node(self, address: str) -> None:
        proc = self.procs.pop(address, None)
        if proc and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)

    def stop(self) -> None:
        for address in list(self.procs):
            self.stop_node(address)

    def lose_node(self, address: str) -> list[int]:
        """The node is gone, as if its power failed: SIGKILL its sshd and everything running under it (the
        logins, crew's agent, the ranks) at once. The pids killed."""
        proc = self.procs.pop(address)
        doomed = [proc.pid, *descendants(proc.pid)]
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)
        return doomed


def descendants(root: int) -> list[int]:
    """Every process below `root` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


Binds = dict[str, list[tuple[Path, Path]]]  # address -> [(source, mount point)] seen by that node only


def start_cluster(root: Path, count: int = 2, binds: Binds | None = None,
                  clean_login: bool = False) -> Cluster:
    root.mkdir(parents=True, exist_ok=True)
    addresses = [f"127.0.0.{i + 2}" for i in range(count)]
    port = free_port_on(addresses)
    _keygen(root / "client_key")
    _keygen(root / "host_key")
    host_pub = (root / "host_key.pub").read_text().split()
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    (root / "known_hosts").write_text("".join(
        f"[{a}]:{port} {host_pub[0]} {host_pub[1]}\n" for a in addresses))
    config = root / "ssh_config"
    config.write_text(
        "Host *\n"
        f"  IdentityFile {root / 'client_key'}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {root / 'known_hosts'}\n"
        "  StrictHostKeyChecking yes\n"
        f"  Port {port}\n"
        "  LogLevel ERROR\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    home = None
    if clean_login:
        home = root / "home"
        home.mkdir(exist_ok=True)
    cluster = Cluster(root, addresses, port, config)
    try:
        for address in addresses:
            cluster.procs[address] = _start_sshd(root, address, port, (binds or {}).get(address, []),
                                                 home)
        for address in addresses:
            _wait_listening(address, port, cluster.procs[address])
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _keygen(path: Path) -> None:
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def _start_sshd(root: Path, address: str, port: int,
                binds: list[tuple[Path, Path]], home: Path | None = None) -> subprocess.Popen:
    config = root / f"sshd_{address}.conf"
    config.write_text(
        f"ListenAddress {address}:{port}\n"
        f"HostKey {root / 'host_key'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\n"
        f"PidFile {root / f'sshd_{address}.pid'}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "MaxStartups 100\n"
        "MaxSessions 100\n"
        + (f'SetEnv "HOME={home}"\n' if home else ""))
    argv = [SSHD, "-D", "-e", "-f", str(config)]
    if binds:  # sh mounts, then becomes sshd: the pid stays the one to stop
        mounts = "".join(f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))} && "
                         for src, dst in binds)
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f"{mounts}exec {shlex.join(argv)}"]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(root / f"sshd_{address}.log", "ab"),
                            start_new_session=True)


def _wait_listening(address: str, port: int, proc: subprocess.Popen, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd on {address}:{port} exited with {proc.returncode}")
        try:
            socket.create_connection((address, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    raise RuntimeError(f"sshd on {address}:{port} did not start listening in {timeout}s")
