"""Shared fixtures: run `crew` as a user would, loopback ssh nodes, and a leftover-process check."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# The helpers beside this file (dist, sshnodes, conftest itself) import by name from tests/launcher and
# tests/runtime too.
sys.path.insert(0, str(Path(__file__).parent))
import sshnodes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

RUN_TIMEOUT_S = 120

# Sleeps in small steps so a test can signal it mid-run; fails with code 7 where FAIL_RANK says.
STEPPER = """
    import os, sys, time
    rank = int(os.environ["RANK"])
    open(f"started{rank}", "w").close()
    for step in range(600):
        if rank == int(os.environ.get("FAIL_RANK", -1)) and step == 3:
            print("fatal: rank", rank, "gives up at step", step, file=sys.stderr)
            sys.exit(7)
        time.sleep(0.05)
"""


@dataclass
class Result:
    code: int
    out: str
    err: str
    seconds: float


def crew_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "crew", *args]


def crew(*args: str, cwd: Path, env: dict | None = None, timeout: float = RUN_TIMEOUT_S) -> Result:
    """Run `crew ARGS` in `cwd` and wait for it (the test fails on a hang instead of hanging)."""
    started = time.monotonic()
    proc = subprocess.run(crew_command(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def start_crew(*args: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """Start `crew ARGS` in the background, as its own process group (so the test can signal it)."""
    return subprocess.Popen(crew_command(*args), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                            start_new_session=True)


def write_script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def ranks_saying(output: str, text: str) -> list[int]:
    """Which ranks printed the line `text`, in crew's output, where the same line from several ranks is
    one line `[host:R] text (and on ranks 1-3, 5)`: sorted, a rank once per time it said it."""
    pattern = re.compile(rf"\[[^\]]*:(\d+)\] {re.escape(text)}(?: \(and on ranks? ([\d, -]+)\))?")
    ranks = []
    for line in output.splitlines():
        if match := pattern.fullmatch(line):
            ranks.append(int(match.group(1)))
            for part in match.group(2).split(", ") if match.group(2) else []:
                first, _, last = part.partition("-")
                ranks += range(int(first), int(last or first) + 1)
    return sorted(ranks)


def processes_in(folder: Path) -> list[str]:
    """Processes (pid and command line) whose working directory is `folder`: ranks, agents, ssh."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "cwd") == str(folder):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{entry.name}: {cmdline}")
        except OSError:
            continue
    return found


def wait_until_gone(folder: Path, timeout: float = 10.0) -> list[str]:
    """What is still running in `folder` once `timeout` has passed (empty: all gone in time)."""
    deadline = time.monotonic() + timeout
    while (left := processes_in(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


# A test run inside a Slurm allocation must not turn every local launch into a Slurm one: the Slurm tests
# start their own cluster and pass its environment explicitly.
for _name in [n for n in os.environ if n.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
    del os.environ[_name]


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A clean directory, HOME and environment: no CREW_* defaults, no ~/.deepspeed_env."""
    for name in list(os.environ):
        if name.startswith("CREW_") or name == "DS_ENV_FILE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _isolated_process_state():
    """Each test starts and ends with the same environment and no process group."""
    saved = dict(os.environ)
    yield
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def job_dir(tmp_path: Path):
    """A working directory for one job; the test fails if anything is left running in it."""
    folder = tmp_path / "job"
    folder.mkdir()
    yield folder
    left = wait_until_gone(folder, timeout=15)
    for line in left:
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert not left, f"processes left running after the test: {left}"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two ssh 'nodes': sshd on 127.0.0.2 and 127.0.0.3, one port, a throwaway key."""
    reason = sshnodes.sshd_missing_reason()
    if reason:
        pytest.skip(reason)
    nodes = sshnodes.start_cluster(tmp_path_factory.mktemp("nodes"), 2)
    yield nodes
    nodes.stop()


@pytest.fixture
def make_cluster(tmp_path):
    """Start loopback ssh nodes for one test; `binds` gives a node its own view of some paths."""
    reason = sshnodes.sshd_missing_reason()
    if reason:
        pytest.skip(reason)
    started = []

    def start(count: int = 2, binds: sshnodes.Binds | None = None) -> sshnodes.Cluster:
        if binds and (why := sshnodes.mount_namespace_missing_reason()):
            pytest.skip(why)
        nodes = sshnodes.start_cluster(tmp_path / f"nodes{len(started)}", count, binds)
        started.append(nodes)
        return nodes

    yield start
    for nodes in started:
        nodes.stop()
