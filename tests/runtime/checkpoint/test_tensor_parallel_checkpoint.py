"""AutoTP tensor-parallel checkpoints (crew/runtime/checkpoint/tensor_parallel.py) in DeepSpeed 0.19.8's files.

2 ranks (TP 2): a run saved after 2 steps and resumed in a fresh engine trains on with bitwise the losses of the
run that went on (ZeRO 0 fp32, ZeRO 1 bf16); the tag holds DeepSpeed's files (mp_rank_00/01_model_states.pt with
each TP rank's slices under Hugging Face's names); save_16bit_model writes the whole weights, which
transformers' from_pretrained loads; a checkpoint of TP 2 loads into TP 1 (resharded); real DeepSpeed's own
AutoTP checkpoint (tensor_parallel_data/, make_fixtures.py) loads with DeepSpeed's weights and next loss, also at
TP 1 and, for its ZeRO 2 one of 4 ranks, on 2.
4 ranks (TP 2 x DP 2, ZeRO 2 and 3): the same resume, and DeepSpeed's ZeRO 2 and ZeRO 3 checkpoints of that layout
(make_zero3_fixture.py's too on TP 2 x DP 1); at ZeRO 3 the whole weights gathered over both dimensions.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch
from dist import run_parts

DATA = Path(__file__).parent / "tensor_parallel_data"
_spec = importlib.util.spec_from_file_location("make_fixtures", DATA / "make_fixtures.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)
made.CASES.setdefault("stage3_fp32_dp2", (3, "fp32", 4))  # DeepSpeed's ZeRO 3 + TP 2 x DP 2: make_zero3_fixture.py


def _reset() -> None:
    from crew.runtime import parallel
    from crew.runtime.tensor_parallel import setup
    parallel.reset()
    setup.reset()


SHARD_ALL = {"stage3_param_persistence_threshold": 0}  # stage 3: every parameter sharded, as in a large model


def _engine(stage: int, precision: str, tp: int = 2, case: str = "stage0_fp32"):
    import crew.deepspeed as deepspeed
    _reset()
    model = made.make_model(case)  # a Phi-3 or GPT-NeoX case: the split its DeepSpeed fixture was made with
    config = {**made.config(stage, precision), "tensor_parallel": {"autotp_size": tp, **made.SECTIONS.get(case, {})}}
    if stage == 3:
        config["zero_optimization"] = {"stage": 3, **SHARD_ALL}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _steps(engine, rank: int, first: int, count: int, tp: int = 2) -> list[float]:
    losses = []
    for step in range(first, first + count):
        tokens = made.batch(rank, step) if tp == 2 else made.batch(rank * 2, step)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def _whole(engine) -> dict:
    from crew.runtime.tensor_parallel import gather_full
    return {name: gather_full(param).float().clone() for name, param in engine.module.named_parameters()}


def _shared_dir() -> Path:
    import torch.distributed as dist

    import crew.deepspeed as deepspeed
    deepspeed.init_distributed("gloo")
    box = [tempfile.mkdtemp(prefix="crew-tp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def resume(rank: int, stage: int, precision: str, case: str = "stage0_fp32") -> dict:
    """Save after 2 steps, 2 more (A); a fresh engine loads and trains the same 2 (B)."""
    folder = _shared_dir()
    engine = _engine(stage, precision, case=case)
    _steps(engine, rank, 0, 2)
    engine.save_checkpoint(folder, tag="t2", client_state={"mine": 7})
    going_on = _steps(engine, rank, 2, 2)
    final = _whole(engine)
    engine = _engine(stage, precision, case=case)
    path, client = engine.load_checkpoint(folder)
    resumed = _steps(engine, rank, 2, 2)
    same = all(torch.equal(final[name], value) for name, value in _whole(engine).items())
    files = sorted(p.name for p in (folder / "t2").iterdir() if p.name.endswith("_states.pt"))
    mine = f"zero_pp_rank_{rank // 2}_mp_rank_0{rank % 2}_model_states.pt" if stage == 3 else \
        f"mp_rank_0{rank % 2}_model_states.pt"
    model = torch.load(folder / "t2" / mine, weights_only=False)
    keys = {key: model[key] for key in ("dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
                                        "global_steps", "mine")}
    keys["universal"] = model["universal_checkpoint_info"]  # as DeepSpeed's for the same model (ds_to_universal)
    shapes = {name: tuple(value.shape) for name, value in model["module"].items()}
    if stage == 3:  # the module's parameters are DeepSpeed's empty placeholders: the slices' shapes are here
        shapes = {name: tuple(shape) for group in model["param_shapes"] for name, shape in group.items()}
    keys["order"] = list(model)
    return {"A": going_on, "B": resumed, "same": same, "files": files, "keys": keys, "shapes": shapes,
            "client": client["mine"], "steps": engine.global_steps, "path": Path(path).name}


def whole_weights(rank: int, stage: int = 0) -> dict:
    """save_16bit_model and _consolidated_16bit_state_dict under TP 2: the whole weights; from_pretrained."""
    import transformers
    folder = _shared_dir()
    engine = _engine(stage, "fp32")
    _steps(engine, rank, 0, 1)
    whole = _whole(engine)
    engine.save_16bit_model(folder)
    consolidated = engine._consolidated_16bit_state_dict()
    out = {"flag": engine.zero_gather_16bit_weights_on_model_save(), "consolidated": consolidated is not None}
    if rank == 0:
        engine.module.config.save_pretrained(folder)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        out["worst"] = max((loaded.state_dict()[name] - value).abs().max().item() for name, value in whole.items())
        out["consolidated_worst"] = max((consolidated[name] - value).abs().max().item()
                                        for name, value in whole.items())
        out["shapes"] = {name: tuple(value.shape) for name, value in consolidated.items()}
    return out


def reshard(rank: int, case: str = "stage0_fp32") -> dict:
    """A TP 2 checkpoint into TP 1 (2 data-parallel ranks): the whole weights and the next step's loss."""
    folder = _shared_dir()
    engine = _engine(0, "fp32", case=case)
    _steps(engine, rank, 0, 2)
    engine.save_checkpoint(folder, tag="t2")
    whole = _whole(engine)
    tokens = made.batch(0, 2)
    expected = engine(input_ids=tokens, labels=tokens).loss.item()
    single = _engine(0, "fp32", tp=1, case=case)
    single.load_checkpoint(folder)
    same = all(torch.equal(param.detach(), whole[name]) for name, param in single.module.named_parameters())
    loss = single(input_ids=tokens, labels=tokens).loss.item()
    exported = None
    if rank == 0:  # `crew export`: every TP rank's slices joined
        from crew.runtime.checkpoint import export
        export(folder, folder / "whole.pt")
        saved = torch.load(folder / "whole.pt", weights_only=True)
        exported = all(torch.equal(saved[name], value) for name, value in whole.items())
    return {"same": same, "loss": abs(loss - expected), "steps": single.global_steps, "exported": exported}


def deepspeeds(rank: int, case: str, tp: int = 2) -> dict:
    """Real DeepSpeed's AutoTP checkpoint into crew at its own layout (tp 2), or resharded to TP 1."""
    stage, precision, _ = made.CASES[case]
    expected = torch.load(DATA / case / "expected.pt", weights_only=True)
    engine = _engine(stage, precision, tp, case)
    _, client = engine.load_checkpoint(DATA / case)
    worst = max((value - expected["state_dict"][name].float()).abs().max().item()
                for name, value in _whole(engine).items())
    sample = rank if tp == 2 else 0  # TP 1: rank 0's sample on every rank
    tokens = made.batch(sample, 2)
    loss = engine(input_ids=tokens, labels=tokens).loss.item()
    return {"worst": worst, "loss": abs(loss - expected["next_losses"][sample]), "note": client["note"],
            "steps": engine.global_steps}


@pytest.fixture(scope="module")
def two():
    return run_parts({"resume0": (resume, 0, "fp32"), "resume1": (resume, 1, "bf16"), "whole": (whole_weights,),
                      "reshard": (reshard,), "deepspeed0": (deepspeeds, "stage0_fp32"),
                      "deepspeed0_tp1": (deepspeeds, "stage0_fp32", 1),
                      "deepspeed2_dp1": (deepspeeds, "stage2_fp32_dp2"),
                      # fused gate_up_proj as two sub-parameters (Phi-3), GPT-NeoX split by its tp_plan
                      "resume_phi3": (resume, 0, "fp32", "phi3_partition_config"),
                      "reshard_phi3": (reshard, "phi3_partition_config"),
                      "deepspeed_phi3": (deepspeeds, "phi3_partition_config"),
                      "deepspeed_phi3_tp1": (deepspeeds, "phi3_partition_config", 1),
                      "deepspeed_neox": (deepspeeds, "gpt_neox_tp_plan"),
                      "deepspeed_falcon": (deepspeeds, "falcon_heuristic"),
                      "resume_neox": (resume, 0, "fp32", "gpt_neox_tp_plan"),
                      "resume_falcon": (resume, 0, "fp32", "falcon_heuristic"),
                      "deepspeed3_dp1": (deepspeeds, "stage3_fp32_dp2")}, world_size=2)


@pytest.fixture(scope="module")
def four():
    return run_parts({"resume2": (resume, 2, "fp32"), "deepspeed2": (deepspeeds, "stage2_fp32_dp2"),
                      "resume3": (resume, 3, "bf16"), "whole3": (whole_weights, 3),
                      "deepspeed3": (deepspeeds, "stage3_fp32_dp2")}, world_size=4)


@pytest.mark.parametrize("part", ["resume0", "resume1"])
def test_resume_trains_on_with_the_same_losses(two, part):
    for result in two[part]:
        assert result["A"] == result["B"]
        assert result["same"] and result["steps"] == 4 and result["client"] == 7 and result["path"] == "t2"


def test_the_files_are_deepspeeds(two):
    zero0, zero1 = two["resume0"][0], two["resume1"][0]
    assert zero0["files"] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert zero1["files"] == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                              "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
                              "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    deepspeeds = torch.load(DATA / "stage0_fp32" / "t2" / "mp_rank_00_model_states.pt", weights_only=True)
    order = zero0["keys"].pop("order")
    assert order == [key if key != "note" else "mine" for key in deepspeeds]  # DeepSpeed's keys, in its order
    assert zero0["keys"] == {"dp_world_size": 1, "mp_world_size": 2, "global_steps": 2, "mine": 7,
                             "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 2},
                             "universal": deepspeeds["universal_checkpoint_info"]}
    shapes = zero0["shapes"]  # each TP rank's slices, Hugging Face's names (as DeepSpeed's, measured)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8, 16)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 8)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (16, 16)
    assert shapes["model.embed_tokens.weight"] == (32, 16) and shapes["model.norm.weight"] == (16,)


def test_whole_weights_load_with_from_pretrained(two):
    first = two["whole"][0]
    assert first["worst"] <= 1e-6 and first["consolidated_worst"] == 0
    assert first["shapes"]["model.layers.0.self_attn.q_proj.weight"] == (16, 16)
    assert first["shapes"]["lm_head.weight"] == (32, 16)
    assert [r["flag"] for r in two["whole"]] == [True, True]
    assert [r["consolidated"] for r in two["whole"]] == [True, False]


def test_a_tp2_checkpoint_loads_into_tp1_and_exports_whole(two):
    for result in two["reshard"]:
        assert result["same"] and result["loss"] < 1e-5 and result["steps"] == 2
    assert two["reshard"][0]["exported"]


def test_deepspeeds_autotp_checkpoint_exports_whole(tmp_path):
    from crew.runtime.checkpoint import export
    for case in made.CASES:
        export(DATA / case, tmp_path / f"{case}.pt")
        saved = torch.load(tmp_path / f"{case}.pt", weights_only=True)
        expected = torch.load(DATA / case / "expected.pt", weights_only=True)["state_dict"]
        assert list(saved) == list(expected)
        assert all(torch.equal(saved[name], value.float()) for name, value in expected.items())


@pytest.mark.parametrize("world,part", [(2, "deepspeed0"), (2, "deepspeed0_tp1"), (4, "deepspeed2"),
                                        (2, "deepspeed2_dp1"), (2, "deepspeed_phi3"), (2, "deepspeed_phi3_tp1"),
                                        (2, "deepspeed_neox"), (2, "deepspeed_falcon"),
                                        # deepspeed2_dp1: ZeRO 2 of TP 2 x DP 2 on TP 2 x DP 1
                                        (4, "deepspeed3"), (2, "deepspeed3_dp1")])  # ZeRO 3 of TP 2 x DP 2
def test_deepspeeds_autotp_checkpoint_loads(two, four, world, part):
    for result in (two if world == 2 else four)[part]:
        assert result["worst"] == 0 and result["loss"] < 1e-5
        assert result["note"] == "fixture" and result["steps"] == 2


def test_zero2_over_data_parallel_ranks_resumes(four):
    results = four["resume2"]
    for result in results:
        assert result["A"] == result["B"] and result["same"] and result["steps"] == 4
    assert results[0]["files"] == sorted(["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"] +
                                         [f"zero_pp_rank_{d}_mp_rank_0{t}_optim_states.pt"
                                          for d in range(2) for t in range(2)])
    assert results[0]["keys"]["dp_world_size"] == 2 and results[0]["keys"]["mp_world_size"] == 2


def test_zero3_resumes_in_deepspeeds_files(four):
    """TP 2 x DP 2 at stage 3 (bf16): the resume is exact, each rank writes DeepSpeed's stage-3 + TP files
    (zero_pp_rank_<dp rank>_mp_rank_<tp rank>, as DeepSpeed 0.19.8 names them, measured) with its TP slices'
    shapes."""
    results = four["resume3"]
    for result in results:
        assert result["A"] == result["B"] and result["same"] and result["steps"] == 4 and result["client"] == 7
    assert results[0]["files"] == sorted(f"{prefix}zero_pp_rank_{d}_mp_rank_0{t}_{kind}_states.pt"
                                         for d in range(2) for t in range(2)
                                         for prefix, kind in (("", "model"), ("bf16_", "optim")))
    keys = results[1]["keys"]
    assert (keys["dp_world_size"], keys["mp_world_size"]) == (2, 2)
    assert keys["universal"]["parameter_with_row_parallelism_patterns"]  # DeepSpeed's key, in its files too
    assert results[1]["shapes"]["model.layers.0.self_attn.q_proj.weight"] == (8, 16)
    assert results[1]["shapes"]["model.layers.0.self_attn.o_proj.weight"] == (16, 8)


def test_zero3_whole_weights_are_gathered_over_dp_and_tp(four):
    first = four["whole3"][0]
    assert first["worst"] <= 1e-6 and first["consolidated_worst"] == 0
    assert first["shapes"]["model.layers.0.self_attn.q_proj.weight"] == (16, 16)
    assert first["shapes"]["lm_head.weight"] == (32, 16)
    assert [r["flag"] for r in four["whole3"]] == [True] * 4
    assert [r["consolidated"] for r in four["whole3"]] == [True, False, False, False]


def test_fused_sub_parameters_resume_and_reshard_in_deepspeeds_files(two):
    """Phi-3's gate_up_proj split as [2, -1]: resume exact, TP 2 -> 1 joined sub-parameter by sub-parameter, and the
    universal_checkpoint_info (sub-parameter shape, shard widths, affine map) DeepSpeed writes for the same split."""
    for result in two["resume_phi3"]:
        assert result["A"] == result["B"] and result["same"] and result["steps"] == 4
    for result in two["reshard_phi3"]:
        assert result["same"] and result["loss"] < 1e-5 and result["steps"] == 2
    deepspeeds = torch.load(DATA / "phi3_partition_config" / "t2" / "mp_rank_00_model_states.pt", weights_only=True)
    assert two["resume_phi3"][0]["keys"]["universal"] == deepspeeds["universal_checkpoint_info"]
    assert two["resume_phi3"][0]["shapes"]["model.layers.0.mlp.gate_up_proj.weight"] == (32, 16)


@pytest.mark.parametrize("part, case", [("resume_neox", "gpt_neox_tp_plan"), ("resume_falcon", "falcon_heuristic")])
def test_a_split_by_tp_plan_or_parser_resumes_in_deepspeeds_files(two, part, case):
    """GPT-NeoX (its tp_plan), Falcon (DeepSpeed's parser): resume exact, universal_checkpoint_info as DeepSpeed's."""
    for result in two[part]:
        assert result["A"] == result["B"] and result["same"] and result["steps"] == 4
    deepspeeds = torch.load(DATA / case / "t2" / "mp_rank_00_model_states.pt", weights_only=True)
    assert two[part][0]["keys"]["universal"] == deepspeeds["universal_checkpoint_info"]
