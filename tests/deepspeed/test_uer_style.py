"""UER-py's DeepSpeed path under crew (scripts/uer_style.py): a client optimizer and scheduler next to the config's
optimizer and scheduler sections, as UER's shipped config has them, trains as under DeepSpeed 0.19.8: the client's
optimizer and scheduler are used, and with gradient_clipping 1.0 every step (all are clipped here) equals a
one-process plain-torch run that clips by the float64 norm, at ZeRO 2 (with UER's legacy cpu_offload) and 3.

The same script under DeepSpeed 0.19.8 (/opt/dsvenv, DS_ACCELERATOR=cpu, torchrun --nproc_per_node 2, --backend
gloo) measured: the same losses and lrs as crew, gradient norms within 1e-7 relative of this reference's, final
weights within 3e-6 of it, and at stage 3 weights equal to crew's bit for bit."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from conftest import crew

SCRIPT = Path(__file__).parent / "scripts" / "uer_style.py"


def reference() -> dict:
    spec = importlib.util.spec_from_file_location("uer_style", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference()


def test_uer_trains_with_its_own_optimizer_and_scheduler_as_one_process_would(tmp_path):
    script = shutil.copy(SCRIPT, tmp_path)
    # UER's --backend defaults to nccl; on a CPU a UER user passes gloo
    run = crew("run", "--num_gpus", "2", "--as_deepspeed", script, "--deepspeed", "--backend", "gloo",
               "--stages", "2,3", cwd=tmp_path, timeout=240)
    assert run.code == 0, run.err
    assert "Using client Optimizer as basic optimizer" in run.out
    assert "You are using ZeRO with an untested optimizer, proceed with caution" in run.out + run.err  # as DeepSpeed
    expected = reference()
    assert min(expected["norms"]) > 1.0  # gradient_clipping 1.0 acts on every step
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    for stage in (2, 3):
        seen = results[stage]
        assert seen["lrs"] == pytest.approx(expected["lrs"], rel=1e-12)  # the client's schedule, not WarmupLR
        assert seen["norms"] == pytest.approx(expected["norms"], rel=1e-6)
        assert seen["losses"] == pytest.approx(expected["losses"], rel=1e-6)
        assert seen["weights"].keys() == expected["weights"].keys()
        for name, weight in expected["weights"].items():
            torch.testing.assert_close(seen["weights"][name], weight, rtol=1e-4, atol=1e-5, msg=name)
