"""DeepSpeed example scripts, unchanged in their shape (tests/deepspeed/scripts/, origins noted in each),
run by `crew run --as_deepspeed` on 2 CPU ranks at ZeRO stages 0 and 3: they train, and resume."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import crew

from conftest import REPO

SCRIPTS = REPO / "tests" / "deepspeed" / "scripts"


@pytest.mark.parametrize("stage", [0, 3])
def test_cifar10_script_trains(job_dir, stage):
    run = crew("run", "--num_gpus", "2", "--as_deepspeed", str(SCRIPTS / "cifar10_style.py"), "--deepspeed",
               "--stage", str(stage), cwd=job_dir, timeout=240)
    assert run.code == 0, run.err
    losses = [float(x) for x in re.findall(r"\] \[\s*\d+,\s+\d+\] loss:\s+([0-9.]+)", run.out)]
    assert len(losses) == 6 and losses[-1] < losses[0] * 0.7, run.out
    assert "Accuracy of the network on the 40 test images" in run.out
    assert "final steps 64" in run.out  # 2 epochs x 512 samples / 16


@pytest.mark.parametrize("stage", [0, 3])
def test_getting_started_script_trains_and_resumes_from_its_client_state(job_dir, stage):
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 0.02}}, "zero_optimization": {"stage": stage}}
    (job_dir / "ds_config.json").write_text(json.dumps(config))
    script = shutil.copy(SCRIPTS / "getting_started_style.py", job_dir)
    args = ["run", "--num_gpus", "2", "--as_deepspeed", script, "--deepspeed", "--deepspeed_config",
            "ds_config.json"]
    whole = crew(*args, cwd=job_dir)
    assert whole.code == 0, whole.err
    uninterrupted = json.loads((job_dir / "losses0.json").read_text())
    assert sum(uninterrupted[-10:]) < sum(uninterrupted[:10]) / 3  # it learns
    resumed = crew(*args, "--load_dir", "ckpt", "--ckpt_id", "step20", cwd=job_dir)
    assert resumed.code == 0, resumed.err
    assert json.loads((job_dir / "losses0.json").read_text()) == uninterrupted[20:]  # exactly, unchanged
