"""crew's checkpoint is DeepSpeed 0.19.8's: for the cases of deepspeed_data/ (files written by real DeepSpeed), crew
trains the same model with the same config, saves, and its tag folder holds the same files with the same keys,
tensor shapes and dtypes, and values of the same types (deepspeed_writing.py); crew's own files lie beside. That
real DeepSpeed loads them and trains on with crew's losses is benchmarks/deepspeed_load_crew.py (by hand)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from dist import run_ranks

from crew.runtime.checkpoint.deepspeed_files import read

DATA = Path(__file__).parent / "deepspeed_data"
EXPECTED = json.loads((DATA / "expected.json").read_text())
_spec = importlib.util.spec_from_file_location("make_checkpoints", DATA / "make_checkpoints.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)
CASES = ["stage0_fp32", "stage1_fp32", "stage2_fp32", "stage3_fp32", "stage0_bf16", "stage1_bf16", "stage2_bf16",
         "stage3_bf16", "stage0_bf16_groups", "stage3_bf16_groups", "fusedadam_stage0_fp32_decay",
         "fusedadam_stage1_fp32", "fusedadam_stage2_bf16", "fusedadam_stage3_fp32", "cpuadam_stage1_offload",
         "cpuadam_stage2_offload", "cpuadam_stage3_offload_bf16", "lora_stage3"]
CREW_FILES = {"crew_checkpoint.json", "crew_state.pt", "rank0.pt", "rank1.pt"}


def save_all(rank: int, root: str) -> None:
    import crew

    for name in CASES:
        case = EXPECTED["cases"][name]
        model, params = made.case_model(name, seed=0)
        engine, *_ = crew.initialize(model=model, model_parameters=params, config=case["config"])
        dtype = {"bf16": torch.bfloat16}.get(case["precision"], torch.float32)
        for step in range(made.K_STEPS):
            for micro_step in range(made.ACCUMULATION):
                inputs, targets = made.batch(step, micro_step, rank, made.WORLD)
                engine.backward(made.loss_of(engine(inputs.to(dtype)), targets))
                engine.step()
        engine.save_checkpoint(f"{root}/{name}", tag="global_step3", client_state=made.CLIENT_STATE)


def structure(value, path: str = ""):
    """{path: what is there}: a dict's keys, a tensor's shape and dtype, a list's length, a scalar's type, an
    object's class and attributes. ds_config is the user's config: only its type counts."""
    if isinstance(value, dict) and not path.endswith("ds_config"):
        out = {path: ("dict", sorted(map(str, value)))}
        for key, item in value.items():
            out.update(structure(item, f"{path}/{key}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {path: (type(value).__name__, len(value))}
        for index, item in enumerate(value):
            out.update(structure(item, f"{path}[{index}]"))
        return out
    if isinstance(value, torch.Tensor):
        return {path: ("tensor", tuple(value.shape), value.dtype)}
    if isinstance(value, torch.Size):
        return {path: ("Size", tuple(value))}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {path: (type(value).__name__, structure(vars(value)))}
    return {path: type(value).__name__}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layout")
    run_ranks(save_all, 2, str(root), timeout=300)
    return root


@pytest.mark.parametrize("name", CASES)
def test_crew_writes_deepspeeds_files_keys_shapes_and_dtypes(saved, name):
    theirs, ours = DATA / name / made.TAGS.get(name, "global_step3"), saved / name / "global_step3"
    files = {path.name for path in theirs.iterdir()}
    assert {path.name for path in ours.iterdir()} == files | CREW_FILES
    assert (saved / name / "latest").read_text() == "global_step3"
    for file in sorted(files):
        expected, actual = structure(read(theirs / file)), structure(read(ours / file))
        assert actual == expected, f"{file}: " + "; ".join(
            f"{key}: DeepSpeed {expected.get(key)}, crew {actual.get(key)}"
            for key in sorted(set(expected) | set(actual)) if expected.get(key) != actual.get(key))[:2000]


def test_deepspeeds_pickled_classes_are_written_under_deepspeeds_names(saved):
    """DeepSpeed unpickles its own ZeroStageEnum, LossScaler and fragment_address from crew's files."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(
        saved / "stage2_bf16" / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert sorted(names) == ["deepspeed.runtime.fp16.loss_scaler.LossScaler",
                             "deepspeed.runtime.zero.config.ZeroStageEnum",
                             "deepspeed.utils.tensor_fragment.fragment_address"]
