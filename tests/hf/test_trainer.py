"""A Hugging Face Trainer script with a ZeRO config of "auto" values (transformers' DeepSpeed docs' shape),
unchanged, under `crew run --as_deepspeed --num_gpus 2`: one job trains at ZeRO stages 1 and 2, resumes
from `checkpoint-3/global_step3` exactly, writes weights `from_pretrained` loads, and runs Trainer's four
optimizer/scheduler combinations (scripts/trainer_deepspeed.py)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO, crew

pytest.importorskip("transformers", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("accelerate", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")

SCRIPT = REPO / "tests" / "hf" / "scripts" / "trainer_deepspeed.py"
STAGES = (1, 2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("trainer")
    run = crew("run", "--num_gpus", "2", "--as_deepspeed", str(SCRIPT), "--stages", ",".join(map(str, STAGES)),
               "--combos_stage", "2", cwd=job_dir, timeout=300)
    assert run.code == 0, run.err[-3000:]
    results = [json.loads((job_dir / f"result{rank}.json").read_text()) for rank in range(2)]
    return job_dir, results


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def test_trainer_trains_on_both_ranks_with_whole_equal_parameters(trained):
    _, (rank0, rank1) = trained
    assert rank0["world"] == rank1["world"] == 2  # one world of 2 ranks, not two worlds of one
    for stage in map(str, STAGES):
        seen = rank0["stages"][stage]
        assert seen["module_is_model"] and seen["config_is_dict"]
        assert seen["whole"], f"stage {stage}: the model's parameters are not plain whole tensors"
        assert seen["digest"] == rank1["stages"][stage]["digest"], f"stage {stage}: ranks' weights differ"
        assert [log["step"] for log in seen["full"]] == [1, 2, 3, 4, 5, 6]
        assert all(math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"]) for log in seen["full"])


def test_stages_give_the_same_training(trained):
    _, (rank0, _) = trained
    first, second = (rank0["stages"][str(stage)]["full"] for stage in STAGES)
    for a, b in zip(first, second, strict=True):
        assert close(a["loss"], b["loss"], 1e-5) and close(a["grad_norm"], b["grad_norm"], 1e-4), (a, b)
        assert a["lr"] == b["lr"]


def test_resume_from_checkpoint_continues_exactly(trained):
    job_dir, (rank0, _) = trained
    for stage in map(str, STAGES):
        seen = rank0["stages"][stage]
        assert {"global_step3", "latest"} <= set(seen["files"])
        assert (job_dir / f"out{stage}" / "checkpoint-3" / "latest").read_text().strip() == "global_step3"
        uninterrupted = seen["full"][3:]
        assert [log["step"] for log in seen["resumed"]] == [4, 5, 6]
        for a, b in zip(uninterrupted, seen["resumed"], strict=True):
            assert close(a["loss"], b["loss"]) and close(a["grad_norm"], b["grad_norm"]) and a["lr"] == b["lr"], (a, b)
        assert seen["resumed_digest"] == seen["digest"]


def test_save_model_writes_weights_from_pretrained_loads(trained):
    _, (rank0, _) = trained
    for stage in map(str, STAGES):
        assert rank0["stages"][stage]["loaded_digest"] == rank0["stages"][stage]["digest"]


def test_the_four_optimizer_scheduler_combinations(trained):
    # (config optimizer?, config scheduler?): DeepSpeed's WarmupDecayLR (log warmup over 2 steps: 0 at the
    # first) or Trainer's own linear schedule (0.005, 0.01, then 0 at the end of 3 steps); the lr the
    # optimizer holds is the one the scheduler set, so a client optimizer's param groups stay the caller's
    _, (rank0, _) = trained
    expected = {"True,True": [0.0, 0.01, 0.01], "False,True": [0.0, 0.01, 0.01],
                "True,False": [0.005, 0.01, 0.0], "False,False": [0.005, 0.01, 0.0]}
    combos = rank0["combos"]
    for combo, lrs in expected.items():
        assert [log["lr_used"] for log in combos[combo]] == pytest.approx(lrs), combo
    first_losses = {combo: logs[0]["loss"] for combo, logs in combos.items()}
    assert len({round(loss, 6) for loss in first_losses.values()}) == 1, first_losses
