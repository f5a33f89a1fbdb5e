"""`make gpu-check` (benchmarks/gpu_check.py) on a machine without CUDA: one line, exit 0."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, gpu-check runs every check (make gpu-check)")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("gpu-check: no CUDA device here")


def test_losses_match_within_the_dtypes_tolerance_step_by_step():
    assert gpu_check.within([1.0, 0.5], [1.0005, 0.5004], "fp32")
    assert not gpu_check.within([1.0, 0.6], [1.0, 0.5], "bf16")  # one step off by 20%
    assert not gpu_check.within([1.0], [1.0, 0.5], "fp32")  # a step missing


def test_the_cuda_tests_run_from_the_files_that_mark_them_only():
    files = gpu_check.cuda_test_files()
    assert "tests/runtime/test_cuda.py" in files and "tests/deepspeed/test_checkpointing.py" in files
    assert not any(file.startswith("tests/hf/") for file in files)  # trl/datasets: not on the GPU machines
