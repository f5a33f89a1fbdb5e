"""The hook crew runs first in every rank (crew/launcher/node/site/sitecustomize.py): finished two-rank jobs
exit cleanly whatever the script leaves alive at exit, and a sitecustomize of the user's still runs."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, crew, write_script
from dist import run_ranks

SITE = REPO / "crew" / "launcher" / "node" / "site" / "sitecustomize.py"
JOBS = 4


def rank_site():
    """The hook as a module of its own name (importing it as `sitecustomize` would run the shadowed one)."""
    spec = importlib.util.spec_from_file_location("crew_rank_site", SITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("line, idle", [
    ("202 0x55f6b4b464b0 0x189 0x0 0x0 0x0 0xffffffff 0x7f5dbb7fdd 0x7f", True),  # gloo worker waiting for work
    ("202 0x55f6b4b464b0 0x89 0x0 0x0 0x0 0xffffffff 0x7f5dbb7fdd 0x7f", True),  # same, monotonic clock
    ("202 0x7ffd1b2c 0x189 0x0 0x7fffd8713b80 0x0 0xffffffff 0x7f 0x7f", False),  # timed: the GIL's wait
    ("202 0x55f6b4b46400 0x80 0x2 0x0 0x0 0x0 0x7f5dbb7fdd 0x7f", None),  # a mutex (or, before glibc 2.34, idle)
    ("running", False),
    ("-1 0x7ffd7f2db530 0x7f5dc0c10b10", False),  # preempted outside a system call
    ("232 0x11 0x7f5dbbffeb80 0x40 0xa 0x0 0x0 0x7f 0x7f", False),  # epoll_wait
    ("", False),
])
def test_a_gloo_worker_is_idle_only_in_an_untimed_condition_wait(line, idle):
    site = rank_site()
    if idle is None:  # plain FUTEX_WAIT: glibc before 2.34 waits on a condition variable with it too
        idle = 0 in site._IDLE_OPS
    assert site.idle_waiting(line) is idle


def _busy_then_idle(rank: int) -> tuple[int, int, float]:
    dist.init_process_group("gloo")
    site = rank_site()
    if rank == 1:
        time.sleep(1.0)  # rank 0's all_reduce waits for this one inside a gloo worker
    work = dist.all_reduce(torch.ones(4), async_op=True)
    if rank == 0:
        time.sleep(0.3)  # a worker has taken the work and waits for rank 1's data
    busy_inside = site.busy_gloo_workers() if rank == 0 else -1
    work.wait()
    del work
    waited = site.wait_for_gloo_workers()
    return busy_inside, site.busy_gloo_workers(), waited


def test_gloo_workers_count_as_busy_inside_a_collective_and_idle_after_it():
    (busy_inside, busy_after, waited), _ = run_ranks(_busy_then_idle, 2)
    assert busy_inside == 1  # one worker runs the all_reduce; the other waits for work
    assert busy_after == 0 and waited < 1.0


DDP_ALIVE_AT_EXIT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]), bucket_cap_mb=0.01)
for _ in range(3):
    model(torch.randn(8, 64)).sum().backward()
"""  # ends in the backward's all-reduces, model and group alive: under torchrun 21 of 40 such jobs aborted


def test_finished_two_rank_jobs_exit_cleanly_whatever_the_script_leaves_alive(job_dir):
    write_script(job_dir, "train.py", DDP_ALIVE_AT_EXIT)
    failed = []
    for _ in range(JOBS):
        done = crew("run", "--num_gpus", "2", "train.py", cwd=job_dir)
        if done.code:
            failed.append((done.code, done.err[-400:]))
    # Without the hook 4 jobs would all pass by chance about once in 20 runs (benchmarks/exits.py: torchrun
    # 21 aborts in 40 such jobs, crew 0 in 40); benchmarks/exits.py measures it properly.
    assert not failed, f"{len(failed)} of {JOBS} finished jobs failed at exit: {failed[0]}"


USER_SITE = """
import os
print("user sitecustomize ran; crew's stack pipe was taken:", "CREW_STACKS" not in os.environ, flush=True)
"""


def test_a_sitecustomize_of_the_users_runs_after_crews(job_dir):
    (job_dir / "mysite").mkdir()
    write_script(job_dir / "mysite", "sitecustomize.py", USER_SITE)
    write_script(job_dir, "show.py", "import sys; print('first on the path:', sys.path[1].endswith('node/site'))")
    done = crew("run", "--num_gpus", "1", "--env", f"PYTHONPATH={job_dir / 'mysite'}", "show.py", cwd=job_dir)
    assert done.code == 0, done.err
    assert "user sitecustomize ran; crew's stack pipe was taken: True" in done.out
    assert "first on the path: True" in done.out


ACCELERATE_BACKEND = """
    import json, os
    from accelerate.state import PartialState
    print(json.dumps([str(x) for x in PartialState._prepare_backend(PartialState, cpu=False)]))
    print(json.dumps([str(x) for x in PartialState._prepare_backend(PartialState, cpu=True)]))
"""


@pytest.mark.parametrize("on_cpu, expected", [
    ("1", ["gloo", "DistributedType.MULTI_CPU"]),  # --as_deepspeed without a GPU: one world over gloo
    ("", ["None", "DistributedType.NO"]),  # Accelerate's own answer: no backend, each rank a world of one
])
def test_accelerate_gets_gloo_for_deepspeed_on_a_machine_without_gpu(tmp_path, on_cpu, expected):
    pytest.importorskip("accelerate", reason="needs the test extra (accelerate)")
    import json
    import os
    import subprocess
    import sys
    import textwrap

    env = {**os.environ, "PYTHONPATH": str(SITE.parent), "CREW_DEEPSPEED_ON_CPU": on_cpu, "LOCAL_RANK": "0",
           "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(ACCELERATE_BACKEND)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    without_cpu, with_cpu = (json.loads(line) for line in proc.stdout.splitlines())
    assert without_cpu == expected
    assert with_cpu == ["gloo", "DistributedType.MULTI_CPU"]  # cpu=True (ACCELERATE_USE_CPU) is Accelerate's own
