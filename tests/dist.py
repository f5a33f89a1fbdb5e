"""run_ranks(fn, world_size): call fn(rank, *args) in `world_size` real processes joined by gloo.

Each process gets the caller's environment plus the launcher's (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a
free MASTER_PORT, LOCAL_RANK), one CPU thread, and leaves the process group on exit. Return values come
back in rank order; an exception in any rank fails the caller with that rank's traceback, a rank that exits
without returning fails it with the exit code, and a hang fails it after `timeout` seconds with the Python
stack of every rank still running (so that a hang seen once in CI says where it was), then kills them.

The processes are forked from one server process per test session that imported torch (and torch._dynamo,
which torch.optim imports at the first optimizer) once, with no thread started: a rank starts in a fraction
of a second instead of the seconds each fresh interpreter spends importing them. Otherwise a rank is as a
spawned one: the caller's working directory, sys.path and environment, and its atexit handlers run at its end.

run_until_one_dies(fn, world_size): the ranks of a test where one is killed; the others are stopped then.

run_parts(parts, world_size): several such functions, one after the other in the same ranks (one process start
for a file's many checks); each part's result or failure comes back on its own, so that a part that fails fails
only the tests that read it.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.queues
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from crew.launcher.plan.ports import free_port


# transformers' Llama too: the SP, TP and their checkpoint tests build one in every rank (1.3 s of imports each)
PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "transformers.models.llama.modeling_llama"]


def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    here = os.getcwd()
    os.chdir(tempfile.gettempdir())  # the server's own folder: never a test's job folder (conftest's job_dir)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.chdir(here)
    return context


# a rank's answer: every thread's Python stack, into its file in the stacks folder (USR1 is crew's preemption notice)
STACKS_SIGNAL = signal.SIGUSR2
_stacks_file = None  # open for the rank's whole life: faulthandler writes to its descriptor


def _entry(fn, rank, world_size, port, args, results, environ, stacks):
    global _stacks_file
    _stacks_file = open(Path(stacks) / f"rank{rank}.txt", "w")  # noqa: SIM115
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    try:
        # Plain pickle copies tensor data inline; the queue's own pickler would share it by file
        # descriptor, which is gone once this process exits.
        results.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit._run_exitfuncs()  # a forked process ends in os._exit, which skips them


def _start(fn, world_size: int, args: tuple, stacks: str) -> tuple[list, multiprocessing.queues.Queue]:
    """fn(rank, *args) started in `world_size` forked ranks; their results come back on the queue."""
    context = _context()
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_entry,
                             args=(fn, rank, world_size, port, args, results, dict(os.environ), stacks))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    return procs, results


def run_ranks(fn, world_size: int = 2, *args, timeout: float = 120.0) -> list:
    stacks = tempfile.mkdtemp(prefix="crew-ranks-")
    procs, results = _start(fn, world_size, args, stacks)
    try:
        collected = _collect(procs, results, time.monotonic() + timeout, stacks)
        return [collected[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(stacks, ignore_errors=True)


def _collect(procs: list, results: multiprocessing.queues.Queue, deadline: float, stacks: str) -> dict:
    collected = {}
    while len(collected) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            _fail_if_gone(procs, collected, results)
            if time.monotonic() > deadline:
                raise AssertionError(_hung(procs, collected, stacks)) from None
            continue
        if status == "error":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        collected[rank] = pickle.loads(value)
    return collected


def _fail_if_gone(procs: list, collected: dict, results: multiprocessing.queues.Queue) -> None:
    """A rank that exited without a result: its peers would wait in a collective until the timeout."""
    gone = [rank for rank, proc in enumerate(procs) if rank not in collected and proc.exitcode is not None]
    if gone and results.empty():
        time.sleep(1.0)  # a rank's result is in the pipe before it exits; give the reader a moment
        if results.empty():
            codes = ", ".join(f"rank {rank}: {procs[rank].exitcode}" for rank in gone)
            raise AssertionError(f"a rank exited without returning or raising (exit codes {codes})")


def _hung(procs: list, collected: dict, stacks: str) -> str:
    running = [rank for rank, proc in enumerate(procs) if rank not in collected and proc.is_alive()]
    for rank in running:
        os.kill(procs[rank].pid, STACKS_SIGNAL)
    time.sleep(0.5)  # faulthandler writes from its C signal handler: at once, whatever the rank is doing
    where = "\n".join(f"--- rank {rank} ---\n{_read(Path(stacks) / f'rank{rank}.txt')}" for rank in running)
    for rank in running:
        procs[rank].kill()
    return f"ranks {running} did not finish in time (the others: {sorted(collected)}); where they were:\n{where}"


def _read(stack: Path) -> str:
    return stack.read_text() if stack.exists() else "(no stack: the rank had not started)\n"


def run_until_one_dies(fn, world_size: int = 2, *args, timeout: float = 60.0) -> list[int | None]:
    """Start fn(rank, *args) in `world_size` ranks as run_ranks does, for a rank that is meant to die (say, by
    SIGKILL): once a rank has died, the others are killed, as a launcher stops the ranks at a first failure.
    Each rank's exit code in rank order (negative: the signal that ended it), None where this killed it. What the
    ranks returned or raised is not read: once a rank is gone, its peers fail in their next collective, as they
    should; the caller asserts on what the ranks left behind."""
    stacks = tempfile.mkdtemp(prefix="crew-ranks-")
    procs, _ = _start(fn, world_size, args, stacks)
    deadline = time.monotonic() + timeout
    try:
        while not any(proc.exitcode for proc in procs) and any(proc.is_alive() for proc in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"no rank died within {timeout} s and not every rank finished")
            time.sleep(0.05)
        return [proc.exitcode for proc in procs]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        shutil.rmtree(stacks, ignore_errors=True)


def _parts(rank, parts):
    done = {}
    for name, fn, args in parts:
        try:
            done[name] = ("ok", fn(rank, *args))
        except Exception:
            done[name] = ("error", traceback.format_exc())
    return done


class Parts:
    """What run_parts brought back: `parts[name]` is that part's results in rank order, or fails with the
    traceback of the first rank where it raised."""

    def __init__(self, ranks: list[dict]) -> None:
        self.ranks = ranks

    def __getitem__(self, name: str) -> list:
        for rank, done in enumerate(self.ranks):
            status, value = done[name]
            if status == "error":
                raise AssertionError(f"part {name!r}, rank {rank} failed:\n{value}")
        return [done[name][1] for done in self.ranks]


def run_parts(parts: dict, world_size: int = 2, timeout: float = 240.0) -> Parts:
    """Run each `name: (fn, *args)` of `parts`, in order, as fn(rank, *args) in the same `world_size` ranks.

    A part that raises on every rank leaves the next parts to run; one that raises on some ranks only may
    leave the others waiting in a collective, which the timeout ends (every part then fails)."""
    listed = [(name, fn, tuple(args)) for name, (fn, *args) in parts.items()]
    return Parts(run_ranks(_parts, world_size, listed, timeout=timeout))
