"""crew's deepspeed.utils.zero_to_fp32 against DeepSpeed 0.19.8's own, on checkpoints real DeepSpeed wrote (ZeRO
stages 0-3, fp32/bf16, tests/runtime/checkpoint/deepspeed_data/, and zero_to_fp32_data/frozen_*: a frozen layer
and a tied weight). zero_to_fp32_data/make_expected.py ran DeepSpeed's functions on those folders and recorded
every result (tensors by sha256: equal means bitwise equal), every file an export wrote, and every error; here
the same recorder runs crew's module and must find the same. No process group, no DeepSpeed. (Lightning's
converter, which imports DeepSpeed's names, runs on crew's shim in tests/hf/test_lightning.py: on crew's
checkpoints and on some of these, against what it wrote with DeepSpeed.)"""

from __future__ import annotations

import builtins
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from dist import run_ranks

import crew.deepspeed.utils.zero_to_fp32 as zero_to_fp32
from crew.runtime.checkpoint import CheckpointError

DATA = Path(__file__).parent / "zero_to_fp32_data"
EXPECTED = json.loads((DATA / "expected.json").read_text())
_spec = importlib.util.spec_from_file_location("make_expected", DATA / "make_expected.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)
CASES = {name: folder for name, folder in made.cases().items() if name in EXPECTED["cases"]}  # as recorded
STAGE0 = [name for name, case in EXPECTED["cases"].items() if "error" in case["optim_files"]]  # no optimizer files
# Where crew answers and DeepSpeed fails: a stage-0 folder has no parameter shapes (DeepSpeed: TypeError
# "'NoneType' object is not iterable"); crew's parse_model_states says so (ValueError) and the state dict is the
# module's fp32 weights (checked against DeepSpeed's fp32 masters below).
STAGE0_DIFFERENT = {"parse_model_states", "state", "state_by_tag", "exclude_frozen", "lazy", "convert_default",
                    "convert_sharded", "convert_sharded_safe", "convert_unsharded", "convert_bf16"}


@pytest.fixture(scope="module")
def crews() -> dict:
    """crew's zero_to_fp32 on every case, recorded as make_expected.py recorded DeepSpeed's."""
    return {name: made.record_case(zero_to_fp32, folder) for name, folder in CASES.items()}


def same_outcome(ours, theirs) -> bool:
    """Equal results; for errors the same type and DeepSpeed's message (crew may add how to fix it)."""
    if isinstance(theirs, dict) and "error" in theirs:
        if not (isinstance(ours, dict) and "error" in ours and ours["error"][0] == theirs["error"][0]):
            return False
        first_line = theirs["error"][1].strip().splitlines()[0].split("[")[0]  # not a set's order
        return ours["error"][1].startswith(theirs["error"][1]) or first_line in ours["error"][1]
    return ours == theirs


def test_every_deepspeed_fixture_is_recorded():
    core = {f"stage{stage}_{precision}" for stage in range(4) for precision in ("fp32", "bf16")}
    assert core | set(made.FROZEN_CASES) <= set(CASES), "a recorded case's folder is gone"
    assert EXPECTED["versions"]["deepspeed"] == "0.19.8"
    stages = {case["parse_optim_states"].get("value", {}).get("zero_stage") for case in EXPECTED["cases"].values()}
    assert stages == {None, 1, 2, 3}  # stage 0 has no optimizer files


@pytest.mark.parametrize("name", sorted(CASES))
def test_crew_gives_what_deepspeed_gives(crews, name):
    expected, ours = EXPECTED["cases"][name], crews[name]
    assert ours.keys() | {"lightning"} == expected.keys()
    different = STAGE0_DIFFERENT if name in STAGE0 else set()
    for key in ours.keys() - different:
        assert same_outcome(ours[key], expected[key]), (name, key, ours[key], expected[key])
    if "value" in expected["state"]:
        assert len(expected["state"]["value"]["tensors"]) >= 5  # the check compared real weights


def test_frozen_and_tied_parameters_as_deepspeed(crews):
    """The frozen_* cases: exclude_frozen_parameters drops the frozen layer; the tied weight is one tensor
    under both names (one file under safetensors refuses it, as with DeepSpeed)."""
    for name in ("frozen_stage2_fp32", "frozen_stage3_fp32", "frozen_stage3_bf16"):
        ours = crews[name]
        assert ours["state"]["value"]["same_object"] == [["out.weight", "embed.weight"]]
        assert ours["exclude_frozen"]["value"] == ["scale", "embed.weight", "mid.weight", "mid.bias", "out.weight"]
        assert ours["convert_sharded_safe"]["error"][0] == "RuntimeError"
    lazy = crews["frozen_stage3_bf16"]["lazy"]["value"]["types"]
    assert lazy["embed.weight"] == "GatheredTensor" and lazy["frozen.weight"] == "Tensor"


@pytest.mark.parametrize("name", STAGE0)
def test_a_stage0_checkpoint_gives_the_fp32_weights(name):
    """DeepSpeed's zero_to_fp32 fails on stage 0 (TypeError); crew's gives the module's weights in fp32: DeepSpeed's
    fp32 masters (under bf16 its optimizer's fp32 copies) and the buffer."""
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(CASES[name]))
    masters = torch.load(CASES[name] / "reference_fp32.pt", weights_only=True)
    assert set(state) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"}
    for key, value in masters.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], value), (name, key)
    with pytest.raises(ValueError, match="no parameter shapes"):
        zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(CASES[name] / "global_step3")))


def test_the_weights_are_deepspeeds_fp32_masters():
    """Beyond equal to DeepSpeed's tool: equal to the masters DeepSpeed held in memory at the save."""
    for name, folder in CASES.items():
        if (folder / "reference_fp32.pt").is_file() and name not in STAGE0 and "fp32accum" not in name:
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder))
            for key, value in torch.load(folder / "reference_fp32.pt", weights_only=True).items():
                assert torch.equal(state[key], value), (name, key)


def test_missing_folders_and_files_are_deepspeeds_errors(tmp_path):
    """The types DeepSpeed raises (ValueError, FileNotFoundError) with its messages; also CheckpointError for a
    missing `latest` or tag (what crew's callers catch)."""
    calls = {"no_latest": lambda: zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path)),
             "no_tag": lambda: zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="nope"),
             "no_folder": lambda: zero_to_fp32.get_model_state_file(str(tmp_path / "nope"), 2),
             "no_files": lambda: zero_to_fp32.get_optim_files(str(tmp_path))}
    for key, call in calls.items():
        kind, message = EXPECTED[key]["error"]
        with pytest.raises(getattr(builtins, kind)) as raised:
            call()
        assert str(raised.value).replace(str(tmp_path), "{dir}").startswith(message), key
        if key in ("no_latest", "no_tag"):
            assert isinstance(raised.value, CheckpointError), key
    assert [[n, w, list(zero_to_fp32.zero3_partitioned_param_info(n, w))] for n, w, _ in
            EXPECTED["partitioned_param_info"]] == EXPECTED["partitioned_param_info"]
    with pytest.raises(ValueError, match="Unsupported output dtype 'int8'"):
        zero_to_fp32.to_torch_tensor({}, dtype="int8")


def test_the_command_line_writes_deepspeeds_shards(tmp_path, monkeypatch):
    """`python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR --max_shard_size ... --safe_serialization -t TAG`."""
    name = "stage3_bf16_groups"
    monkeypatch.setattr(sys, "argv", ["zero_to_fp32.py", str(CASES[name]), str(tmp_path / "out"), "--max_shard_size",
                                      EXPECTED["shard_size"], "--safe_serialization", "-t", "global_step3"])
    zero_to_fp32._main()
    assert made.output_summary(tmp_path / "out") == EXPECTED["cases"][name]["convert_sharded_safe"]


def test_the_split_is_huggingface_hubs():
    """Shards as huggingface_hub's split_torch_state_dict_into_shards cuts them (DeepSpeed calls it), shared
    tensors and tensors over the limit included, without needing huggingface_hub."""
    hub = pytest.importorskip("huggingface_hub")
    shared = torch.empty(30)
    state = {"a": torch.empty(10), "b": shared, "c": torch.empty(200), "d": torch.empty(5), "e": shared,
             "f": torch.empty(40), "g": torch.empty(1, dtype=torch.int64)}
    for limit in ("0.2KB", "0.5KB", "1KB", "10KB", 150):
        split = hub.split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.bin",
                                                       max_shard_size=limit)
        files, metadata = zero_to_fp32._split_into_shards(state, "model.bin", limit)
        assert files == split.filename_to_tensors and metadata == split.metadata, limit


def test_the_file_names_are_deepspeeds():
    from crew.deepspeed.checkpoint.utils import (
        get_layer_ckpt_name_for_rank,
        get_model_ckpt_name_for_rank,
        get_zero_ckpt_name_for_rank,
    )

    tag = CASES["stage2_fp32"] / "my_tag"
    assert Path(get_model_ckpt_name_for_rank(tag, "00")).is_file()
    assert [Path(get_zero_ckpt_name_for_rank(tag, rank, 0)).is_file() for rank in (0, 1, 2)] == [True, True, False]
    assert get_layer_ckpt_name_for_rank("tag", 3, 1) == "tag/3-model_01_model_states.pt"


def test_checkpoints_of_crew_0_1_give_their_fp32_weights():
    """Folders of crew 0.1's own layouts (crew_checkpoint.json, no DeepSpeed files): replicated at stages 0 and 2,
    sharded at 3. The same training saved at stages 0, 2 and 3 gives the same weights."""
    folder = Path(__file__).parents[1] / "runtime" / "checkpoint" / "crew_0_1_data"
    states = {name: zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder / name))
              for name in ("stage0_fp32", "stage2_fp32", "stage3_fp32", "stage2_bf16")}
    first = states["stage0_fp32"]
    assert len(first) >= 2 and all(value.dtype == torch.float32 for value in first.values())
    for name, state in states.items():
        assert state.keys() == first.keys(), name
        for key, value in first.items():
            torch.testing.assert_close(state[key], value, **({"rtol": 0.05, "atol": 0.05} if "bf16" in name else {}))
    with pytest.raises(FileNotFoundError, match="can't find \\*_optim_states.pt files"):  # DeepSpeed's files only
        zero_to_fp32.get_optim_files(str(folder / "stage2_fp32" / "global_step3"))


def _crew_stage0_bf16(rank: int, folder: str) -> dict:
    import crew
    from crew.deepspeed.utils import safe_get_full_fp32_param

    model = made.FrozenTiedModel()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 0.05}}}  # FusedAdam: FP16_Optimizer's flat fp32 copies
    engine, _, _, _ = crew.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    engine.backward(engine(torch.randn(2, 7).bfloat16()).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(folder)
    return {name: safe_get_full_fp32_param(param).clone() for name, param in engine.module.named_parameters()}


def test_crews_stage0_bf16_checkpoint_with_flat_fp32_copies_gives_its_masters(tmp_path):
    """DeepSpeed keeps FusedAdam's fp32 copies flat at stage 0 under bf16 and its zero_to_fp32 cannot read stage 0;
    crew's checkpoint names the flat copies' parameters (crew_state.pt): zero_to_fp32 gives the masters exactly."""
    masters = run_ranks(_crew_stage0_bf16, 1, str(tmp_path))[0]
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert state["frozen.weight"].dtype == torch.float32 and state["scale"].dtype == torch.float32
    for name in ("embed.weight", "mid.weight", "mid.bias"):
        assert torch.equal(state[name], masters[name]), name
    assert torch.equal(state["out.weight"], state["embed.weight"])
