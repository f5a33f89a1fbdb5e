"""A Hugging Face Trainer script with DeepSpeed's AutoTP (`"tensor_parallel": {"autotp_size": 2}`) under
`crew run --as_deepspeed --num_gpus 2` (scripts/trainer_tp.py): Trainer trains with each linear split over the
2 ranks, with the losses of the same script at TP 1 on one rank (the same batches: one data-parallel rank in
both), and save_model writes the whole weights, which from_pretrained loads equal to the trained ones."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO, crew

pytest.importorskip("transformers", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("accelerate", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")

SCRIPT = REPO / "tests" / "hf" / "scripts" / "trainer_tp.py"


def _run(job_dir, ranks: int, tp: int) -> list[dict]:
    job_dir.mkdir()
    run = crew("run", "--num_gpus", str(ranks), "--as_deepspeed", str(SCRIPT), "--tp", str(tp), cwd=job_dir,
               timeout=300)
    assert run.code == 0, run.err[-3000:]
    return [json.loads((job_dir / f"result{rank}.json").read_text()) for rank in range(ranks)]


def test_trainer_with_autotp_trains_as_tp1_and_saves_whole_weights(tmp_path):
    tp2 = _run(tmp_path / "tp2", 2, 2)
    tp1 = _run(tmp_path / "tp1", 1, 1)
    assert tp2[0]["world"] == 2 and len(tp2[0]["losses"]) == 4
    assert tp2[0]["losses"] == tp2[1]["losses"]
    for ours, reference in zip(tp2[0]["losses"], tp1[0]["losses"], strict=True):
        assert math.isclose(ours, reference, rel_tol=1e-4), (tp2[0]["losses"], tp1[0]["losses"])
    assert tp2[0]["shape"] == [64, 64] and tp2[0]["worst"] <= 1e-6
