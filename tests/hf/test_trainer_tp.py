"""A Hugging Face Trainer script with DeepSpeed's AutoTP (`"tensor_parallel": {"autotp_size": 2}`) under
`crew run --as_deepspeed --num_gpus 2` (scripts/trainer_tp.py): Trainer trains with each linear split over the
2 ranks (one data-parallel rank: both train on the same batches), and rank 0 then trains a copy of the initial
model in one process, without TP or DeepSpeed, on the batches the steps saw with the optimizer, schedule and
clipping Trainer built from the config. Asserted: every step's loss and gradient norm equal that reference's,
each rank holds its part of each split weight, and save_model writes the whole weights, which from_pretrained
loads equal to the trained ones and to the reference's. At ZeRO stage 1 and 3."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO, crew

pytest.importorskip("transformers", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("accelerate", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")

SCRIPT = REPO / "tests" / "hf" / "scripts" / "trainer_tp.py"
RANKS = TP = 2


@pytest.mark.parametrize("stage", [1, 3])  # 3: each TP slice sharded by FSDP2 (over one data-parallel rank here)
def test_trainer_with_autotp_trains_as_one_process_and_saves_whole_weights(tmp_path, stage):
    run = crew("run", "--num_gpus", str(RANKS), "--as_deepspeed", str(SCRIPT), "--tp", str(TP), "--stage", str(stage),
               cwd=tmp_path, timeout=300)
    assert run.code == 0, run.err[-3000:]
    ranks = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(RANKS)]
    first = ranks[0]
    assert first["engine"].startswith("crew.") and first["world"] == RANKS

    # one data-parallel rank: every step, both ranks trained on the same batch, and logged the same
    assert len(first["steps"]) == len(first["seen"]) == len(first["reference"]) > 1
    assert all(len(step) == RANKS and all(batch == step[0] for batch in step) for step in first["seen"])
    assert all(rank["seen"] == first["seen"] and rank["steps"] == first["steps"] for rank in ranks)

    for step, reference in zip(first["steps"], first["reference"], strict=True):
        assert math.isclose(step["loss"], reference["loss"], rel_tol=1e-5), (step, reference)
        assert math.isclose(step["grad_norm"], reference["grad_norm"], rel_tol=1e-5), (step, reference)

    # each rank holds 1/TP of every projection of every layer along its split dim, the rest whole
    projections = {name for name in first["shapes"] if name.endswith("_proj.weight")}
    assert projections and projections <= first["split"].keys()
    for rank in ranks:
        assert rank["split"].keys() == first["split"].keys()
        for name, part in rank["split"].items():
            assert part["whole"] == first["shapes"][name], name
            expected = list(part["whole"])
            expected[part["dim"]] //= TP
            assert part["local"] == expected, (name, part)

    # save_model wrote the whole weights: from_pretrained loads the trained ones, which are the reference's, and
    # training moved them. Adam divides each gradient by its own size, so float noise on a near-zero one moves its
    # weight by up to the lr (ulp-level differences a step, not lr-sized ones): a few weights differ by a fraction
    # of the lr, the rest by float rounding, so each tensor's mean difference stays far under the lr; a wrong
    # weight decay or lr moves whole tensors by lr x weight decay a step, which that catches
    learning_rate = first["learning_rate"]
    assert first["keys_equal"]
    assert first["saved_vs_trained"] == 0.0
    assert first["moved"] > learning_rate
    assert first["saved_vs_reference"] < learning_rate / 10
    assert first["saved_vs_reference_mean"] < learning_rate / 1000
