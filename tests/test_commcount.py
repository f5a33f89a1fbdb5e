"""tests/commcount.py counts what the backend gets: one window, payloads by nccl-tests' rules, coalesced blocks
and C++-issued ops (DDP's reducer) as the profiler sees them."""

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tests.commcount import CommCounter, bus_factor
from tests.dist import run_ranks


def _count(rank: int) -> dict:
    originals = (dist.all_reduce, c10d.all_gather_single)
    counter = CommCounter()
    counter.install()
    wrapped = dist.all_reduce is not originals[0] and c10d.all_gather_single is not originals[1]
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))  # 272 fp32 parameters
    for _ in range(2):  # DDP rebuilds its buckets (a broadcast) on its second step: outside the window
        ddp(torch.ones(2, 16)).sum().backward()
    dist.all_reduce(torch.ones(1000))  # before the window
    with counter.measure():
        ddp(torch.ones(2, 16)).sum().backward()
        dist.all_reduce(torch.ones(10, dtype=torch.bfloat16))
        dist.all_gather_into_tensor(torch.empty(6 * n), torch.ones(6))  # calls all_gather_single inside
        dist.reduce_scatter_tensor(torch.empty(5), torch.ones(5 * n))
        dist.broadcast(torch.ones(3), 0)
        with c10d._coalescing_manager():
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(4))
        dist.barrier()
    dist.all_reduce(torch.ones(1000))  # after it
    counter.uninstall()
    restored = wrapped and (dist.all_reduce, c10d.all_gather_single) == originals
    return {"summary": counter.summary(), "restored": restored}


def test_counts_one_window_as_the_backend_sees_it():
    results = run_ranks(_count, 2)
    assert results[0]["summary"] == results[1]["summary"]
    summary = results[0]["summary"]
    assert summary["all_reduce"]["calls"] == 3  # DDP's bucket, the bf16 one, the coalesced block
    assert summary["all_reduce"]["payload_bytes"] == 272 * 4 + 10 * 2 + 2 * 4 * 4
    assert summary["all_reduce"]["bus_bytes"] == summary["all_reduce"]["payload_bytes"] * bus_factor("all_reduce", 2)
    assert summary["all_gather"] == {"calls": 1, "payload_bytes": 12 * 4, "bus_bytes": 12 * 4 / 2}
    assert summary["reduce_scatter"] == {"calls": 1, "payload_bytes": 10 * 4, "bus_bytes": 10 * 4 / 2}
    assert summary["broadcast"] == {"calls": 1, "payload_bytes": 12, "bus_bytes": 12}
    assert summary["barrier"] == {"calls": 1}
    check = summary["check"]
    assert check["issued_from_cpp"] == {"all_reduce": 1} and check["agree"]
    assert all(r["restored"] for r in results)


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("reduce", 4) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
