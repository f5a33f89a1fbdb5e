"""Checkpoints written by earlier crew versions still load and train on exactly: crew 0.1's "replicated"
(model_states.<i>-of-<k>.pt) and "sharded" (stage 3's DCP folder) layouts, written by
crew_0_1_data/made.py with the losses each run had after its save."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from dist import run_ranks

DATA = Path(__file__).parent / "crew_0_1_data"
sys.path.insert(0, str(DATA))
import make_crew_checkpoints as made  # noqa: E402  (the generator's model, data and configs)

EXPECTED = json.loads((DATA / "expected.json").read_text())


def resume_all(rank: int, root: str) -> dict:
    import crew

    out = {}
    for name, (stage, precision) in made.RUNS.items():
        engine, *_ = crew.initialize(model=made.model(), config=made.config(stage, precision))
        path, client = engine.load_checkpoint(f"{root}/{name}")
        out[name] = {"path": path, "client": client, "steps": engine.global_steps,
                     "losses": made.steps(engine, rank, made.END)}
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> list[dict]:
    import shutil

    root = tmp_path_factory.mktemp("crew_0_1")
    for name in made.RUNS:  # a copy: a load must not need to write, but keep the fixtures pristine
        shutil.copytree(DATA / name, root / name)
    return run_ranks(resume_all, 2, str(root), timeout=300)


@pytest.mark.parametrize("name", list(made.RUNS))
def test_crew_0_1_checkpoint_loads_and_trains_on_its_recorded_losses(resumed, name):
    for rank, result in enumerate(resumed):
        run = result[name]
        assert run["path"].endswith(f"{name}/global_step{EXPECTED['save_at']}")
        assert run["client"] == {"saved_by": "crew 0.1", "step": EXPECTED["save_at"]}
        assert run["losses"] == pytest.approx(EXPECTED["losses"][name][rank], rel=1e-6)
