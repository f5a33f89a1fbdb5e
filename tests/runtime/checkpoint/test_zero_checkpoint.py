"""Checkpoints at ZeRO stages 1-3: exact resume, other world sizes and stages, export, 16-bit weights.

A spawned world costs seconds on two cores, so each runs many checks: one world of two ranks
trains, saves and resumes at stages 1, 2 and 3 (fp32, bf16, fp16) and loads each checkpoint at other
stages; the module-scoped fixture keeps what the tests compare, and the checkpoints for the loads on
one and four ranks and for export. Stage 2 keeps whole parameters and saves like stage 1 (the
replicated format, its fp32 masters gathered from the ranks that own them); the sharded format it
wrote when it was FSDP2 still loads.
"""

from __future__ import annotations

import copy
import zlib
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from dist import run_ranks

from crew.runtime.checkpoint import integrity
from test_checkpoint import dataset, ds_config, make_model

SAVE_AT, END = 3, 6  # 16 samples a step on two ranks, 56 an epoch: the resume crosses an epoch
FP16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}  # the scale moves


def zero_config(stage: int, precision: str = "fp32") -> dict:
    extra = {"fp16": FP16} if precision == "fp16" else {"bf16": {"enabled": True}} if precision == "bf16" else {}
    return ds_config(accumulation=2, gradient_clipping=0.5, zero_optimization={"stage": stage},
                     checkpoint={"resume_data_position": True}, **extra)


def build(config: dict):
    """An engine and its stream of batches (built after a load_checkpoint, it resumes the loader)."""
    import crew

    engine, _, loader, _ = crew.initialize(model=make_model(), training_data=dataset(), config=config)
    return engine, batches(loader)


def batches(loader):
    """The loader's batches across epochs. Keep one stream per engine: a new iter(loader) starts
    the next epoch (or the loaded resume point)."""
    while True:
        yield from loader


def train(engine, stream, until_step: int) -> list[float]:
    """Train to `until_step` (dropout: the RNG state matters too), inputs in the compute dtype
    (FSDP2 does not cast them)."""
    losses = []
    while engine.global_steps < until_step:
        inputs, targets = next(stream)
        output = engine(inputs.to(engine.precision.dtype)).float()
        loss = torch.nn.functional.mse_loss(output, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def whole_state(engine) -> dict | None:
    """{"model": fp32 weights, "optim": optimizer state by parameter name}, whole, at any stage
    (a collective; None on ranks other than 0 at stages 1-2)."""
    from crew.runtime.checkpoint import fp32_module_state, optimizer_param_names
    from crew.runtime.checkpoint.state import gathered_masters

    if engine.zero.shards_params:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optim = get_state_dict(engine.module, engine.optimizer,
                                      options=StateDictOptions(full_state_dict=True))
        return copy.deepcopy({"model": model, "optim": optim["state"]})  # "step" is the live tensor
    optimizer = engine.optimizer
    masters = gathered_masters(engine)  # stage 2 under bf16/fp16: each rank keeps its own masters
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
        if engine.global_rank != 0:
            return None
    names = optimizer_param_names(engine)
    return copy.deepcopy({"model": fp32_module_state(engine, masters),  # a copy: these are the live tensors
                          "optim": {names[i]: entry for i, entry in optimizer.state_dict()["state"].items()}})


def assert_same_state(actual: dict, expected: dict) -> None:
    assert actual["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(actual["model"][name], value), f"weight {name} differs"
    assert actual["optim"].keys() == expected["optim"].keys()
    for name, entry in expected["optim"].items():
        assert actual["optim"][name].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(actual["optim"][name][key], value), f"optimizer {name}.{key} differs"


# -- one world per stage: resume, plus loads at other stages ----------------------------------------

def stage_world(rank: int, stage: int, precision: str, folder: str, other_stages: list[int],
                out: str) -> dict:
    config = zero_config(stage, precision)
    engine, stream = build(config)
    before = train(engine, stream, SAVE_AT)
    engine.save_checkpoint(folder, client_state={"losses": len(before)})
    if stage == 3:  # and in crew 0.1's sharded layout, which still loads
        from crew.runtime.checkpoint import saving

        layout, saving._layout = saving._layout, lambda engine: "sharded"
        try:
            engine.save_checkpoint(f"{folder}_sharded", client_state={"losses": len(before)})
        finally:
            saving._layout = layout
    saved = whole_state(engine)
    saved_precision = engine.precision.state_dict()
    continued = train(engine, stream, END)

    fresh, fresh_stream = build(config)
    hashed, digest = [], integrity.file_digest  # which files this rank checks at load
    integrity.file_digest = lambda path: hashed.append(path.relative_to(Path(folder)).as_posix()) or digest(path)
    try:
        _, client = fresh.load_checkpoint(folder)
    finally:
        integrity.file_digest = digest
    result = {"saved": saved, "client": client, "continued": continued, "hashed": hashed,
              "loaded_precision": fresh.precision.state_dict(), "saved_precision": saved_precision,
              "resumed": train(fresh, fresh_stream, END), "other_stages": {}}
    for other in other_stages:  # the same checkpoint into engines at other stages
        engine, _ = build(zero_config(other, precision))
        engine.load_checkpoint(folder)
        result["other_stages"][other] = (engine.global_steps, whole_state(engine))
    if stage == 3:  # and 16-bit weights gathered from the shards
        engine, stream = build(zero_config(3, "bf16"))
        train(engine, stream, 1)
        engine.save_16bit_model(out, "weights.bin")
        result["bf16_model"] = whole_state(engine)["model"]
        result["damaged_shard_error"] = load_with_a_damaged_shard(rank, config, Path(folder))
    return result


def load_with_a_damaged_shard(rank: int, config: dict, folder: Path) -> str:
    """Rank 1 flips a byte of its optimizer file, which one rank checks: every rank must raise."""
    import torch.distributed as dist

    shard = folder / f"global_step{SAVE_AT}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    original = shard.read_bytes()
    if rank == 1:
        shard.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
    dist.barrier()
    try:
        build(config)[0].load_checkpoint(folder)
        error = "loaded"
    except Exception as exc:
        error = str(exc)
    dist.barrier()
    if rank == 1:
        shard.write_bytes(original)  # whole again for the tests that load it after this world
    return error


# stage: (its precision, the stages that load its checkpoint in the same world); a precision each
WORLDS = {0: ("fp16", []), 1: ("fp32", [3]), 2: ("bf16", [0, 1]), 3: ("fp16", [])}


def all_stages(rank: int, root: str) -> dict:
    return {stage: stage_world(rank, stage, precision, f"{root}/stage{stage}/ckpt", others,
                               f"{root}/stage{stage}/out")
            for stage, (precision, others) in WORLDS.items()}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    """{stage: (its checkpoint dir, each rank's result)}: one world of two ranks runs them all."""
    root = tmp_path_factory.mktemp("stages")
    ranks = run_ranks(all_stages, 2, str(root))
    return {stage: (root / f"stage{stage}" / "ckpt", [result[stage] for result in ranks]) for stage in WORLDS}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_exact(worlds, stage):
    _, ranks = worlds[stage]
    for result in ranks:
        assert result["resumed"] == result["continued"]  # exact, step for step
        assert len(result["resumed"]) == (END - SAVE_AT) * 2
        assert result["client"] == {"losses": SAVE_AT * 2}


def test_manifest_names_stage_and_format(worlds):
    def tag(stage: int):
        folder = worlds[stage][0] / f"global_step{SAVE_AT}"
        manifest = json.loads((folder / "crew_checkpoint.json").read_text())
        return manifest, {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}

    common = {"crew_checkpoint.json", "rank0.pt", "rank1.pt"}
    for stage, prefix in ((1, ""), (2, "bf16_")):  # DeepSpeed's files (stage 2 runs bf16), crew's beside
        manifest, files = tag(stage)
        assert (manifest["zero_stage"], manifest["format"]) == (stage, "deepspeed")
        assert files == common | {"crew_state.pt", "mp_rank_00_model_states.pt"} | {
            f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)}
    common.add("client_state.pt")
    manifest, files = tag(3)
    assert (manifest["zero_stage"], manifest["format"]) == (3, "deepspeed")
    assert files == common - {"client_state.pt"} | {"crew_state.pt"} | {  # each rank wrote its own
        f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in (0, 1) for kind in ("model", "optim")}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_manifest_has_every_files_size_and_crc32_from_every_rank(worlds, stage):
    folder = worlds[stage][0] / f"global_step{SAVE_AT}"
    listed = json.loads((folder / "crew_checkpoint.json").read_text())["files"]
    on_disk = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert set(listed) == set(on_disk) - {"crew_checkpoint.json"}
    for name, data in on_disk.items():  # hashed as written, by the rank (or DCP) that wrote it
        if name != "crew_checkpoint.json":
            assert listed[name] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_load_checks_every_file_it_reads_once_in_the_job(worlds, stage):
    """Stage 3: each rank reads pieces of most shard files (replicated tensors sit in one of them); the
    shard files are split among the ranks all the same, not hashed whole by every rank."""
    folder, ranks = worlds[stage]
    hashed = ranks[0]["hashed"] + ranks[1]["hashed"]
    assert len(hashed) == len(set(hashed)), hashed
    tag = f"global_step{SAVE_AT}"
    listed = json.loads((folder / tag / "crew_checkpoint.json").read_text())["files"]
    assert sorted(hashed) == sorted(f"{tag}/{name}" for name in listed)


def test_a_damaged_shard_fails_every_rank_checked_once_in_the_job(worlds):
    folder, ranks = worlds[3]
    shard = folder / f"global_step{SAVE_AT}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    for result in ranks:  # one rank hashed it (the files are split among all ranks), every rank failed
        assert "failed on 1 rank(s)" in result["damaged_shard_error"]
        assert f"{shard} is damaged: its crc32 differs" in result["damaged_shard_error"]


def test_fp16_at_stage0_is_written_as_deepspeeds_fp16_optimizer(worlds):
    """FP16_Optimizer's state_dict (deepspeed/runtime/fp16/fused_optimizer.py, the "AdamW" config's FusedAdam): the
    dynamic loss scale's keys beside the base optimizer's state over one flat fp32 tensor a group."""
    from crew.runtime.checkpoint.deepspeed_files import read

    folder, ranks = worlds[0]
    optimizer = read(folder / f"global_step{SAVE_AT}" / "mp_rank_00_model_states.pt")["optimizer"]
    scaler = ranks[0]["saved_precision"]["loss_scaler"]
    assert optimizer["dynamic_loss_scale"] is True
    assert (optimizer["cur_scale"], optimizer["cur_iter"]) == (scaler["cur_scale"], scaler["cur_iter"])
    assert (optimizer["scale_factor"], optimizer["scale_window"]) == (2.0, FP16["loss_scale_window"])
    assert optimizer["last_overflow_iter"] == scaler["last_overflow_iter"]
    assert {"optimizer_state_dict", "fp32_groups_flat", "clip_grad"} <= set(optimizer)


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_loss_scale_survives_a_round_trip(worlds, stage):
    _, ranks = worlds[stage]
    for result in ranks:
        saved = result["saved_precision"]["loss_scaler"]
        assert saved["cur_scale"] > 2 ** FP16["initial_scale_power"]  # it moved before the save
        assert result["loaded_precision"]["loss_scaler"] == saved


def test_stage1_checkpoint_loads_into_a_stage3_engine(worlds):
    _, ranks = worlds[1]
    steps, state = ranks[0]["other_stages"][3]
    assert steps == SAVE_AT
    assert_same_state(state, ranks[0]["saved"])


def test_stage2_checkpoint_loads_into_stage0_and_stage1_engines(worlds):
    _, ranks = worlds[2]
    for stage in (0, 1):
        steps, state = ranks[0]["other_stages"][stage]
        assert steps == SAVE_AT
        assert_same_state(state, ranks[0]["saved"])


# -- other world sizes ----------------------------------------------------------------------------

def load_elsewhere(rank: int, stage: int, folder: str) -> dict:
    engine, stream = build(zero_config(stage, "fp16"))
    engine.load_checkpoint(folder, tag=f"global_step{SAVE_AT}")
    state = whole_state(engine)
    scaler = engine.precision.state_dict()["loss_scaler"]
    steps = engine.global_steps
    train(engine, stream, SAVE_AT + 1)  # the loaded optimizer state steps on the new shards
    return {"state": state, "scaler": scaler, "steps": steps}


def test_a_sharded_stage2_checkpoint_of_two_ranks_loads_at_stage2_on_four(worlds, tmp_path):
    """Before stage 2 kept whole parameters it was FSDP2, and saved the sharded format stage 3 saves:
    such a checkpoint (stage 3's, its manifest saying stage 2) loads into today's stage 2, by name."""
    import shutil

    folder, saved = worlds[3]
    old = tmp_path / "old"
    shutil.copytree(f"{folder}_sharded", old)
    manifest_path = old / f"global_step{SAVE_AT}" / "crew_checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["format"] == "sharded"
    manifest_path.write_text(json.dumps({**manifest, "zero_stage": 2}))
    results = run_ranks(load_elsewhere, 4, 2, str(old))
    for result in results:
        assert result["steps"] == SAVE_AT
        assert result["scaler"] == saved[0]["saved_precision"]["loss_scaler"]
    assert_same_state(results[0]["state"], saved[0]["saved"])  # consolidated on rank 0, masters gathered


def test_stage1_checkpoint_of_two_ranks_loads_on_one_at_stages_0_and_1(worlds):
    folder, saved = worlds[1]
    for stage in (0, 1):
        engine, _ = build(zero_config(stage))
        engine.load_checkpoint(folder, tag=f"global_step{SAVE_AT}")
        assert engine.global_steps == SAVE_AT
        assert_same_state(whole_state(engine), saved[0]["saved"])


def test_stage3_checkpoint_of_two_ranks_loads_on_one(worlds):
    folder, saved = worlds[3]
    result = load_elsewhere(0, 3, str(folder))
    assert result["steps"] == SAVE_AT
    assert_same_state(result["state"], saved[0]["saved"])
    engine, _ = build(zero_config(3, "fp16"))
    engine.load_checkpoint(folder, load_module_only=True)
    assert engine.global_steps == 0 and not engine.optimizer.state
    assert_same_state({"model": whole_state(engine)["model"], "optim": {}},
                      {"model": saved[0]["saved"]["model"], "optim": {}})


# -- export and 16-bit weights --------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
def test_export_consolidates_a_checkpoint_of_any_stage(worlds, tmp_path, stage):
    from crew.runtime.checkpoint import export

    folder, ranks = worlds[stage]
    export(folder / f"global_step{SAVE_AT}", tmp_path / "model.pt")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    make_model().load_state_dict(exported, strict=True)
    assert all(value.dtype == torch.float32 for value in exported.values())
    for name, value in ranks[0]["saved"]["model"].items():
        assert torch.equal(exported[name], value), name


def test_save_16bit_model_at_stage3_gathers_bf16_weights(worlds):
    folder, ranks = worlds[3]
    half = torch.load(folder.parent / "out" / "weights.bin", weights_only=True)
    make_model().load_state_dict(half, strict=True)
    for name, value in ranks[0]["bf16_model"].items():
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], value.to(torch.bfloat16)), name


# -- what cannot work says so ---------------------------------------------------------------------

def test_a_checkpoint_without_parameter_names_names_both_stages(tmp_path, monkeypatch):
    """A stage 0 checkpoint from before parameter names were saved (crew 0.1's layout): its optimizer state
    cannot be placed in a stage 3 engine; the weights still load."""
    from crew.runtime.checkpoint import saving

    engine, stream = build(zero_config(0))
    train(engine, stream, 1)
    with monkeypatch.context() as patch:
        patch.setattr(saving, "_layout", lambda engine: "replicated")  # the writer of crew 0.1's layout
        engine.save_checkpoint(tmp_path)
    states = tmp_path / "global_step1" / "model_states.0-of-1.pt"
    old = torch.load(states, weights_only=True)
    del old["optimizer_param_names"]
    torch.save(old, states)
    without_checksums(tmp_path / "global_step1")  # as that crew wrote it
    sharded, _ = build(zero_config(3))
    with pytest.raises(Exception, match=r"saved at ZeRO stage 0 and this engine runs stage 3.*"
                                        r"load_optimizer_states=False.*crew export"):
        sharded.load_checkpoint(tmp_path)
    sharded.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert sharded.global_steps == 1
    assert_same_state({"model": whole_state(sharded)["model"], "optim": {}},
                      {"model": whole_state(engine)["model"], "optim": {}})


def without_checksums(tag: Path) -> None:
    manifest = json.loads((tag / "crew_checkpoint.json").read_text())
    del manifest["files"]
    (tag / "crew_checkpoint.json").write_text(json.dumps(manifest))


@pytest.mark.usefixtures("sharded_layout")
def test_a_sharded_checkpoint_of_another_model_is_named(tmp_path):
    engine, stream = build(zero_config(3))
    train(engine, stream, 1)
    engine.save_checkpoint(tmp_path)
    import crew

    other, _, _, _ = crew.initialize(model=torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Dropout(0.2),
                                                               torch.nn.Tanh(), torch.nn.Linear(12, 1)),
                                     config=zero_config(3))
    with pytest.raises(Exception, match=r"sharded does not fit this model: 0.weight: saved \(16, 8\), "
                                        r"model \(12, 8\)"):
        other.load_checkpoint(tmp_path)


@pytest.fixture
def sharded_layout(monkeypatch):
    """Stage 3 saves crew 0.1's sharded layout (DCP), whose reading these tests check."""
    from crew.runtime.checkpoint import saving

    monkeypatch.setattr(saving, "_layout", lambda engine: "sharded")


class _RunsCode:
    def __reduce__(self):
        return (print, ("a crafted checkpoint ran code",))


@pytest.mark.usefixtures("sharded_layout")
def test_a_crafted_sharded_metadata_cannot_run_code(tmp_path, capsys):
    engine, stream = build(zero_config(3))
    train(engine, stream, 1)
    engine.save_checkpoint(tmp_path)
    metadata = tmp_path / "global_step1" / "sharded" / ".metadata"
    metadata.write_bytes(pickle.dumps(_RunsCode()))
    manifest = json.loads((tmp_path / "global_step1" / "crew_checkpoint.json").read_text())
    manifest["files"]["sharded/.metadata"] = {"bytes": metadata.stat().st_size,  # the crafter wrote it too
                                              "crc32": f"{zlib.crc32(metadata.read_bytes()):08x}"}
    (tmp_path / "global_step1" / "crew_checkpoint.json").write_text(json.dumps(manifest))
    from crew.runtime.checkpoint import export

    with pytest.raises(Exception, match=r"\.metadata cannot be read.*builtins.print has no place"):
        export(tmp_path, tmp_path / "model.pt")
    with pytest.raises(Exception, match=r"\.metadata cannot be read"):
        engine.load_checkpoint(tmp_path)
    assert "ran code" not in capsys.readouterr().out


@pytest.mark.usefixtures("sharded_layout")
def test_damaged_shards_are_named_by_load_and_export(tmp_path):
    """Each DCP file is checked before DCP reads it; a sharded engine, a stage 0 engine (which reads
    the shards whole) and export all name the damaged one."""
    from crew.runtime.checkpoint import export

    engine, stream = build(zero_config(3))
    train(engine, stream, 1)
    engine.save_checkpoint(tmp_path)
    tag = tmp_path / "global_step1"
    for name in ("sharded/__0_0.distcp", "sharded/.metadata", "engine_state.pt"):
        path = tag / name
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0xFF
        path.write_bytes(bytes(flipped))
        damaged = f"{path} is damaged: its crc32 differs from the one its save recorded"
        for stage in (3, 0):
            with pytest.raises(Exception, match=re.escape(damaged)):
                build(zero_config(stage))[0].load_checkpoint(tmp_path)
        if name != "engine_state.pt":  # export reads only the module's shards
            with pytest.raises(Exception, match=re.escape(damaged)):
                export(tmp_path, tmp_path / "model.pt")
        path.write_bytes(original)
    build(zero_config(3))[0].load_checkpoint(tmp_path)  # whole again: loads


def test_a_checkpoint_from_before_the_first_step_leaves_the_optimizer_empty(tmp_path):
    """Adam counts its steps: a load must not make one up (torch's set_state_dict does, at lr 0)."""
    for saved_stage in (0, 3):
        engine, _ = build(zero_config(saved_stage))
        engine.save_checkpoint(tmp_path / str(saved_stage))
        for stage in (0, 3):
            other, _ = build(zero_config(stage))
            other.load_checkpoint(tmp_path / str(saved_stage))
            assert not other.optimizer.state, (saved_stage, stage)


def on_node_local_dirs(rank: int, root: str) -> dict:
    """Each rank sees its own folder at root/ckpt and is alone on its "node", as on two machines
    without a shared filesystem: stage 2 (like 0-1) saves a copy per node; stage 3 refuses to save."""
    import ctypes
    import os
    import subprocess

    if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS, this process only
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", f"{root}/node{rank}", f"{root}/ckpt"], check=True)
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    ckpt = Path(root) / "ckpt"

    engine, stream = build(zero_config(2, "bf16"))
    train(engine, stream, SAVE_AT)
    engine.save_checkpoint(ckpt)
    continued = train(engine, stream, END)
    fresh, fresh_stream = build(zero_config(2, "bf16"))
    fresh.load_checkpoint(ckpt)
    result = {"continued": continued, "resumed": train(fresh, fresh_stream, END),
              "files": sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*"))}

    engine, stream = build(zero_config(3))
    train(engine, stream, 1)
    try:
        engine.save_checkpoint(ckpt)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["files_after"] = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*"))
    return result


def test_without_a_shared_filesystem_stage2_saves_per_node_and_stage3_refuses(tmp_path):
    from test_checkpoint_nodes import _isolation_unavailable

    reason = _isolation_unavailable()
    if reason:
        pytest.skip(reason)
    for name in ("ckpt", "node0", "node1"):
        (tmp_path / name).mkdir()
    for rank, result in enumerate(run_ranks(on_node_local_dirs, 2, str(tmp_path))):
        assert result["resumed"] == result["continued"]
        tag = f"global_step{SAVE_AT}"
        recovery = ["zero_to_fp32.py"] if rank == 0 else []  # written by global rank 0, as DeepSpeed's
        # each node holds every file a load there reads: DeepSpeed's, both ranks' optimizer files included
        optim = [f"{tag}/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
        assert result["files"] == sorted(["latest", tag, f"{tag}/crew_state.pt", f"{tag}/crew_checkpoint.json",
                                          f"{tag}/mp_rank_00_model_states.pt", *optim, f"{tag}/rank{rank}.pt",
                                          *recovery])
        assert result["error"].startswith("CheckpointError")
        assert ("a ZeRO stage 3 checkpoint is written by every rank, each its own partition, into one tag folder; "
                "save_dir must be on "
                f"a filesystem every node shares, and {tmp_path / 'ckpt'} is not") in result["error"]
        assert result["files_after"] == result["files"]  # nothing written, nothing left behind
    assert not list((tmp_path / "ckpt").iterdir())


def test_the_recovery_script_beside_the_tags_converts_them(worlds, tmp_path):
    # DeepSpeed writes zero_to_fp32.py beside the tags at stages 1-3, and HF's docs say to run it
    import os
    import subprocess
    import sys

    folder, ranks = worlds[2]
    script = folder / "zero_to_fp32.py"
    assert os.access(script, os.X_OK)
    proc = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path / "weights"), "-t",
                           f"global_step{SAVE_AT}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "weights"  # DeepSpeed 0.19's zero_to_fp32.py writes into an output folder
    converted = torch.load(out / "pytorch_model.bin" if out.is_dir() else out, weights_only=True)
    assert converted.keys() == ranks[0]["saved"]["model"].keys()
    assert all(torch.equal(converted[name], value) for name, value in ranks[0]["saved"]["model"].items())
