"""run_ranks(fn, world_size): call fn(rank, *args) in `world_size` real processes joined by gloo.

Each process gets the launcher environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
MASTER_PORT, LOCAL_RANK), one CPU thread, and leaves the process group on exit. Return values come
back in rank order; an exception in any rank fails the caller with that rank's traceback; a hang
fails after `timeout` seconds and kills every rank.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn, rank, world_size, port, args, results):
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


def run_ranks(fn, world_size: int = 2, *args, timeout: float = 120.0) -> list:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_entry, args=(fn, rank, world_size, port, args, results))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        collected = {}
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value)
        return [collected[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
