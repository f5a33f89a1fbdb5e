"""The census of DeepSpeed names (docs/deepspeed_names.json, written by tools/deepspeed_census.py from the source
of transformers, accelerate, peft, trl, lightning and llamafactory): every name is provided by crew, or refused on
purpose (tools/deepspeed_crew_check.py REFUSED) with an error that names it.

One rank (a world of one, gloo) imports each name through crew's `deepspeed` alias, as the libraries do, and
looks each attribute up on real crew engines at ZeRO 0-3; the same rank checks what the census made crew add
(optimizer.overflow, _consolidated_16bit_state_dict, deepspeed.runtime.utils.move_to_device, pp.get_accelerator,
zero_to_fp32's get_model_state_file and get_optim_files).
The imports run in the rank so that the alias never enters this pytest process.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from conftest import REPO
from dist import run_ranks

sys.path.insert(0, str(REPO / "tools"))
import deepspeed_crew_check as check  # noqa: E402

CENSUS = json.loads((REPO / "docs" / "deepspeed_names.json").read_text())


def _overflow_flags() -> list[bool]:
    """optimizer.overflow after a finite fp16 step, an overflowing one, and a finite one again (DeepSpeed's ZeRO
    optimizers set it on every step; Accelerate's step_was_skipped reads it)."""
    engine = check.tiny_engine(1, fp16={"enabled": True, "auto_cast": True, "initial_scale_power": 4})
    flags = [engine.optimizer.overflow]
    for scale in (1.0, float("inf"), 1.0):
        engine.backward(engine(torch.ones(2, 4)).float().sum() * scale)
        engine.step()
        flags.append(engine.optimizer.overflow)
    engine.destroy()
    return flags


def _move_to_device() -> dict:
    from deepspeed.runtime.utils import move_to_device

    kept, other = torch.ones(2), torch.zeros(2)
    moved = move_to_device({"a": [kept, (other,)]}, "cpu", criterion_func=lambda t: t is kept)
    return {"same": moved["a"][0] is kept, "values": moved["a"][1][0].tolist(),
            "types": [type(moved["a"]).__name__, type(moved["a"][1]).__name__]}


def _zero_to_fp32_files(engine, folder) -> dict:
    """Lightning's convert_zero_checkpoint_to_fp32_state_dict lists a tag folder's DeepSpeed files with these."""
    from deepspeed.utils.zero_to_fp32 import get_model_state_file, get_optim_files

    deepspeed_tag = folder / "deepspeed" / "global_step1"
    deepspeed_tag.mkdir(parents=True)
    for rank in (10, 2):
        (deepspeed_tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    (deepspeed_tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").touch()
    engine.save_checkpoint(str(folder / "crew"), tag="step1")
    try:
        get_optim_files(folder / "crew" / "step1")
        refusal = None
    except Exception as error:  # the type is part of what is checked
        refusal = f"{type(error).__name__}: {error}"
    return {"optim": [pathlib.Path(f).name[:22] for f in get_optim_files(deepspeed_tag)],
            "model": pathlib.Path(get_model_state_file(deepspeed_tag, 3)).name, "crew": refusal}


def _census_rank(rank: int, names: list[dict], folder) -> dict:
    from crew.deepspeed import alias

    alias.install()
    verdicts = {e["name"]: check.check_import(e["name"]) for e in names if e["kind"] != "attribute"}
    engines = {stage: check.tiny_engine(stage) for stage in range(4)}
    verdicts.update(check.check_attributes([e["name"] for e in names if e["kind"] == "attribute"], engines))
    from deepspeed.runtime.zero import partition_parameters as pp

    zero3 = engines[3]
    consolidated = zero3._consolidated_16bit_state_dict()
    try:
        engines[0]._consolidated_16bit_state_dict()
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"verdicts": verdicts, "overflow": _overflow_flags(), "move": _move_to_device(),
            "zero_to_fp32": _zero_to_fp32_files(engines[0], folder),
            "device": pp.get_accelerator().device_name(), "refusal": refusal,
            "consolidated": {k: v.tolist() for k, v in consolidated.items()},
            "whole": {k: v.tolist() for k, v in zero3._zero3_consolidated_16bit_state_dict().items()}}


@pytest.fixture(scope="module")
def census_rank(tmp_path_factory) -> dict:
    return run_ranks(_census_rank, 1, CENSUS["names"], tmp_path_factory.mktemp("census"))[0]


def test_every_name_is_provided_or_refused_naming_it(census_rank):
    assert len(CENSUS["names"]) > 40 and set(CENSUS["libraries"]) >= {"transformers", "accelerate", "trl"}
    problems = {}
    for name, (verdict, detail) in census_rank["verdicts"].items():
        refusal = check.refusal_for(name)
        if verdict == "missing":
            problems[name] = f"missing: {detail}"
        elif verdict == "refused" and refusal is None:
            problems[name] = f"refused, but not on purpose (not in REFUSED): {detail}"
        elif verdict == "refused" and not (refusal in detail and _names_it(name, detail)):
            problems[name] = f"refused with an error that does not say {refusal!r} and name it: {detail}"
        elif verdict == "provided" and refusal is not None:
            problems[name] = "provided, yet REFUSED lists it: drop it from REFUSED"
    assert not problems, "\n".join(f"{name}: {why}" for name, why in problems.items())


def _names_it(name: str, message: str) -> bool:
    """The error names `name` or the module of it that failed to import (`from deepspeed.X import Y`)."""
    parts = name.split(".")
    return any(".".join(parts[:end]) in message for end in range(2, len(parts) + 1))


def test_names_deepspeed_lacks_are_not_provided(census_rank):
    """`in_deepspeed` was measured with real DeepSpeed 0.19.8 (tools/deepspeed_reference.py, run by the census):
    a name it lacks must be missing under crew too, since the libraries feature-detect (ESMFold calls
    deepspeed.utils.is_initialized() in a try)."""
    unchecked = [e["name"] for e in CENSUS["names"] if "in_deepspeed" not in e]
    assert not unchecked, f"rerun tools/deepspeed_census.py with --deepspeed-python: {unchecked} unchecked"
    lacking = [e["name"] for e in CENSUS["names"] if e["in_deepspeed"] is False]
    assert "deepspeed.utils.is_initialized" in lacking and len(lacking) < len(CENSUS["names"]) // 10
    assert all(census_rank["verdicts"][name][0] != "provided" for name in lacking)


def test_every_attribute_is_curated(census_rank):
    attributes = [e for e in CENSUS["names"] if e["kind"] == "attribute"]
    assert attributes and all(e["name"][1:] in check.ATTRIBUTES for e in attributes)
    assert {".ds_numel", ".zero_gather_16bit_weights_on_model_save", ".set_gradient_accumulation_boundary"} <= {
        e["name"] for e in attributes}


def test_what_the_census_added(census_rank):
    # DeepSpeed 0.19.8 has no fp16 on CPU, so this is its source's rule (stage_1_and_2.py step() sets
    # self.overflow on every step). Measured with DeepSpeed 0.19.8 (DS_ACCELERATOR=cpu, torchrun, one rank, this
    # model and config): `overflow` is on the optimizer at stages 1-3 and at stage 0 under bf16, not at stage 0 in
    # fp32 (its bare FusedAdam), where crew's is False, which Accelerate reads as it reads its absence.
    assert census_rank["overflow"] == [False, False, True, False]
    # the same call on DeepSpeed 0.19.8's move_to_device gave exactly these values
    assert census_rank["move"] == {"same": True, "values": [0.0, 0.0], "types": ["list", "tuple"]}
    assert census_rank["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    # DeepSpeed 0.19.8's message, word for word: crew has ZeRO-3 and no tensor parallelism
    assert census_rank["refusal"].startswith("consolidated_16bit_state_dict is only applicable to cases where")
    assert census_rank["consolidated"] == census_rank["whole"] and len(census_rank["whole"]) == 4


def test_zero_to_fp32_file_lists(census_rank):
    files = census_rank["zero_to_fp32"]
    assert files["optim"] == ["bf16_zero_pp_rank_2_mp", "bf16_zero_pp_rank_10_m"]  # DeepSpeed's natural order
    assert files["model"] == "zero_pp_rank_0_mp_rank_00_model_states.pt"
    # a crew checkpoint at stage 0 has no optimizer files: DeepSpeed's error, word for word
    assert files["crew"].startswith("FileNotFoundError: can't find *_optim_states.pt files in directory"), files


def test_the_scanner_follows_pythons_bindings(tmp_path):
    """tools/deepspeed_census.py on a library file: imports, chains cut where DeepSpeed's modules end (a
    DeepSpeed source tree in miniature, with deepspeed.zero an alias as in deepspeed/__init__.py), scopes, and
    the curated attributes, read directly or through hasattr."""
    import deepspeed_census as census

    src = tmp_path / "deepspeed"
    for module in ("runtime/zero/partition_parameters.py", "comm/comm.py", "utils/logging.py"):
        (src / module).parent.mkdir(parents=True, exist_ok=True)
        (src / module).write_text("")
    (src / "__init__.py").write_text("from .runtime import zero\n")
    for package in ("runtime", "runtime/zero", "comm", "utils"):
        (src / package / "__init__.py").touch()
    library = '''
import torch.distributed as dist
import deepspeed

def save(engine, p):
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    with deepspeed.zero.GatheredParameters([p]):
        dist.get_rank()
    deepspeed.utils.logging.logger.info("x")
    engine.module.train()
    self.optimizer.zero_grad()
    return p.ds_status == ZeroParamStatus.AVAILABLE and hasattr(p, "ds_numel")

def plain(deepspeed):
    dist.barrier()
    deepspeed.zero.Init()
'''
    found = {(name, line) for name, line in census.scan_file(library, census.DeepSpeedModules(src))}
    assert found == {
        ("deepspeed", 3), ("deepspeed.comm", 6), ("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus", 7),
        ("deepspeed.zero.GatheredParameters", 8), ("deepspeed.comm.get_rank", 9),
        ("deepspeed.utils.logging.logger", 10), (".module", 11), (".ds_status", 13),
        ("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.AVAILABLE", 13), (".ds_numel", 13)}
