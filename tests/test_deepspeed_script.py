"""examples/train.py is a DeepSpeed script (`import crew as deepspeed`): it must run under crew run,
under torchrun, and as a plain single process, and learn."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO as ROOT
from conftest import crew

SCRIPT = str(ROOT / "examples" / "train.py")
CONFIG = str(ROOT / "examples" / "ds_config.json")
ARGS = ["--deepspeed", "--deepspeed_config", CONFIG, "--epochs", "3", "--samples", "2048"]


def result(folder: Path) -> dict:
    return json.loads((folder / "result.json").read_text())


def test_under_crew_run_on_two_ranks(job_dir):
    run = crew("run", "--num_gpus", "2", SCRIPT, *ARGS, "--result", "result.json", cwd=job_dir)
    assert run.code == 0, run.err
    outcome = result(job_dir)
    assert outcome["world_size"] == 2
    assert outcome["steps"] == 3 * 2048 // (16 * 2 * 2)
    assert outcome["loss"] < 3.0  # it learns: the targets' variance is about 32
    assert "[localhost:0] [crew] micro 16 × accumulation 2 × 2 ranks = 64 per step" in run.out
    assert "[localhost:0] [crew] step 20: loss" in run.out
    assert "[localhost:1] [crew] step" not in run.out  # progress from rank 0 only


def test_as_a_single_process_without_a_launcher(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, *ARGS, "--result", "result.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert result(tmp_path)["world_size"] == 1
    assert result(tmp_path)["steps"] == 3 * 2048 // 32


@pytest.mark.skipif(not shutil.which("torchrun", path=str(Path(sys.executable).parent)),
                    reason="torchrun not installed next to this Python")
def test_under_torchrun(tmp_path):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", SCRIPT, *ARGS,
                           "--result", "result.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert result(tmp_path)["world_size"] == 2


def test_a_failing_step_is_reported_by_crew_run(job_dir):
    run = crew("run", "--num_gpus", "2", SCRIPT, *ARGS, "--fail_at_step", "3", cwd=job_dir)
    assert run.code == 1
    assert "exited with code 1 (first failure)" in run.err
    assert "RuntimeError: failing on purpose at step 3" in run.err


def test_a_bad_config_is_one_clear_line_before_the_start_not_a_traceback(job_dir):
    (job_dir / "bad.json").write_text(json.dumps({
        "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW"}}))
    early = crew("run", "--num_gpus", "2", SCRIPT, "--deepspeed_config", "bad.json", cwd=job_dir)
    assert early.code == 2 and early.out == ""  # crew.precheck: no rank started
    assert early.err.startswith("crew: error: bad.json: train_batch_size 30 is not a positive multiple")
    assert early.err.count("\n") == 1 and "Set train_batch_size to 24 or 32" in early.err
    # The ranks' own check, when crew's is skipped: one clear line each, no traceback
    run = crew("run", "--num_gpus", "2", "--skip_preflight", SCRIPT, "--deepspeed_config", "bad.json", cwd=job_dir)
    assert run.code == 1
    assert f"crew: error (at {SCRIPT}:" in run.err
    assert "bad.json: train_batch_size 30" in run.err and "Set train_batch_size to 24 or 32" in run.err
    assert "Traceback" not in run.err
