"""A backend this machine cannot run is refused at init_distributed with the backend named and the fix, not
torch's "module 'torch._C' has no attribute '_cuda_setDevice'" (UER-py passes --backend nccl by default)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import crew
from crew.errors import CrewError


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL works here")
@pytest.mark.parametrize("backend", ["nccl", "NCCL"])
def test_nccl_without_a_gpu_names_the_backend_and_the_fix(backend, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(CrewError, match=rf"dist_backend='{backend}'.*NCCL needs a CUDA GPU.*dist_backend='gloo'"):
        crew.init_distributed(dist_backend=backend)
    assert not dist.is_initialized()
