"""Checkpoints: exact resume, atomic under SIGKILL at any point, safe and clear loading, export."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import crew
from dist import run_ranks, run_until_one_dies
from dying_save import save_twice


def make_model(hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(56, 8, generator=generator)  # 56: epochs end mid-way through a step
    return torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))


def ds_config(accumulation: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5}},
            **extra}


def train(engine, loader, until_step: int) -> list[float]:
    """Train to `until_step`, across epochs; a dropout model, so the RNG state matters too."""
    losses = []
    while engine.global_steps < until_step:
        for inputs, targets in loader:
            dtype = next(engine.module.parameters()).dtype
            loss = torch.nn.functional.mse_loss(engine(inputs.to(dtype)).float(), targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.global_steps == until_step:  # moves only on a boundary: stop right there
                return losses
    return losses


def session(rank: int, config: dict, folder: str, start: str, until_step: int) -> dict:
    """One run of new processes: fresh, or resumed from `folder`; trains; saves."""
    import crew

    engine, _, loader, _ = crew.initialize(model=make_model(), training_data=dataset(), config=config)
    client = None
    if start == "resume":
        _, client = engine.load_checkpoint(folder)
    losses = train(engine, loader, until_step)
    engine.save_checkpoint(folder, client_state={"losses_so_far": len(losses)})
    return {"losses": losses, "client": client,
            "params": {k: v.clone() for k, v in engine.module.state_dict().items()}}


EXACT_DATA = {"resume_data_position": True}  # crew's loader resumes itself (DeepSpeed's default: no)
CONFIGS = {
    "accumulation": ds_config(accumulation=2, checkpoint=EXACT_DATA),
    "no-accumulation": ds_config(accumulation=1, checkpoint=EXACT_DATA),
    "bf16": ds_config(accumulation=2, bf16={"enabled": True}, checkpoint=EXACT_DATA),
}


def in_turn(rank: int, fn, calls: list[tuple]) -> list:
    """Sessions one after another in the same two processes: one spawn instead of one per session
    (each session seeds its model and data afresh, and a resume restores the RNG from its checkpoint)."""
    return [fn(rank, *args) for args in calls]


def sessions(fn, calls: list[tuple]) -> list[list]:
    """[session][rank] -> what fn returned."""
    return [list(results) for results in zip(*run_ranks(in_turn, 2, fn, calls), strict=True)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_exact_on_two_ranks(tmp_path, name):
    config, steps = CONFIGS[name], 6  # 6 steps of 16 samples: past the end of the first epoch
    whole, first, second = sessions(session, [(config, str(tmp_path / "whole"), "fresh", 2 * steps),
                                              (config, str(tmp_path / "split"), "fresh", steps),
                                              (config, str(tmp_path / "split"), "resume", 2 * steps)])
    for rank in range(2):
        assert first[rank]["losses"] + second[rank]["losses"] == whole[rank]["losses"]
        for key, value in whole[rank]["params"].items():
            assert torch.equal(second[rank]["params"][key], value), f"{key} differs after resume"
        assert second[rank]["client"] == {"losses_so_far": len(first[rank]["losses"])}


def deepspeed_style_session(rank: int, config: dict, folder: str, start: str, until_step: int) -> dict:
    """A DeepSpeed script's resume: it keeps its own count in client_state and skips the batches it
    consumed, as DeepSpeed's docs tell it to (DeepSpeed's loader has no position of its own)."""
    import logging

    import crew

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("crew").addHandler(handler)
    engine, _, loader, _ = crew.initialize(model=make_model(), training_data=dataset(), config=config)
    consumed = engine.load_checkpoint(folder)[1]["consumed"] if start == "resume" else 0
    logging.getLogger("crew").removeHandler(handler)
    losses = []
    for index, (inputs, targets) in enumerate(loader):
        if index < consumed:
            continue
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.global_steps == until_step:
            break
    if start == "fresh":
        engine.save_checkpoint(folder, client_state={"consumed": index + 1})
    return {"losses": losses, "said": [line for line in said if line.startswith("data loader:")]}


def test_a_deepspeed_script_that_skips_consumed_batches_resumes_exactly_by_default(tmp_path):
    # 56 samples, 2 ranks x micro 4: 7 steps an epoch; the split at step 3, the end at 6, one epoch
    config, folder = ds_config(accumulation=1), str(tmp_path / "split")
    whole, first, second, crews_own = sessions(deepspeed_style_session, [
        (config, str(tmp_path / "whole"), "fresh", 6), (config, folder, "fresh", 3),
        (config, folder, "resume", 6), (ds_config(accumulation=1, checkpoint=EXACT_DATA), folder, "resume", 6)])
    assert first[0]["losses"] + second[0]["losses"] == whole[0]["losses"]
    assert "starts its epoch from the beginning, as DeepSpeed's does" in second[0]["said"][0]
    assert '"resume_data_position": true' in second[0]["said"][0]
    # crew's exact resume is opt-in because such a script would then skip the batches twice
    assert first[0]["losses"] + crews_own[0]["losses"] != whole[0]["losses"]
    assert crews_own[0]["said"] == [
        "data loader: resumes where the checkpoint stopped (checkpoint.resume_data_position); a script "
        "that skips the batches it consumed must not also do so now"]
    assert second[1]["said"] == []  # rank 0 says it


def single_engine(config: dict | None = None, model: torch.nn.Module | None = None):
    import crew

    engine, _, loader, _ = crew.initialize(model=model or make_model(), training_data=dataset(),
                                           config=config or ds_config())
    return engine, loader


def test_nothing_to_load_returns_none_none(tmp_path):
    engine, _ = single_engine()
    assert engine.load_checkpoint(tmp_path / "empty") == (None, None)


def test_missing_tag_names_the_tags_there(tmp_path):
    engine, loader = single_engine()
    train(engine, loader, 1)
    engine.save_checkpoint(tmp_path, tag="first")
    with pytest.raises(Exception, match=r"checkpoint tag 'nope' is not in .* \(complete tags in the save dir, "
                                        r"oldest first: first\): pass a complete tag"):
        engine.load_checkpoint(tmp_path, tag="nope")


def test_a_different_model_shape_is_named(tmp_path):
    engine, loader = single_engine()
    train(engine, loader, 1)
    engine.save_checkpoint(tmp_path)
    other, _ = single_engine(model=make_model(hidden=12))
    with pytest.raises(Exception, match=r"does not fit this model: 0.weight: saved \(16, 8\), model \(12, 8\)"):
        other.load_checkpoint(tmp_path)


def test_unsafe_client_state_is_refused_at_save(tmp_path):
    engine, _ = single_engine()
    with pytest.raises(Exception, match="client_state cannot be loaded safely"):
        engine.save_checkpoint(tmp_path, client_state={"bad": Path("/")})
    assert not (tmp_path / "latest").exists()


@pytest.mark.parametrize("tag", ["../escape", ".hidden", "a/b", ""])
def test_bad_tags_are_refused(tmp_path, tag):
    engine, _ = single_engine()
    with pytest.raises(Exception, match="is not a valid folder name"):
        engine.save_checkpoint(tmp_path, tag=tag)


def test_keep_last_removes_older_checkpoints(tmp_path):
    engine, loader = single_engine(ds_config(checkpoint={"keep_last": 2}))
    for step in range(1, 5):
        train(engine, loader, step)
        engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "global_step4", "latest"]
    assert (tmp_path / "latest").read_text() == "global_step4"


def test_saving_the_same_tag_again_replaces_it(tmp_path):
    engine, loader = single_engine()
    train(engine, loader, 1)
    engine.save_checkpoint(tmp_path, tag="best")
    train(engine, loader, 2)
    engine.save_checkpoint(tmp_path, tag="best")
    fresh, _ = single_engine()
    fresh.load_checkpoint(tmp_path)
    assert fresh.global_steps == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest"]


def test_a_different_world_size_loads_the_model_and_optimizer(tmp_path):
    saved = run_ranks(session, 2, ds_config(), str(tmp_path), "fresh", 3)
    engine, _ = single_engine()
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == 3
    for key, value in saved[0]["params"].items():
        assert torch.equal(engine.module.state_dict()[key], value)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_scheduler_on_the_client_optimizer_still_sets_the_lr_after_a_load(tmp_path, stage):
    """Accelerate keeps a client scheduler outside the engine, on the optimizer the script built; under
    DeepSpeed, which loads that optimizer itself, it still sets the lr the engine steps with after a load."""
    import crew

    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1 / (step + 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = crew.initialize(model=model, optimizer=client, config=config)
    engine.save_checkpoint(tmp_path)
    schedule.step()
    engine.load_checkpoint(tmp_path)
    assert engine.get_lr() == [0.01]  # the saved lr
    schedule.step()
    assert engine.get_lr() == pytest.approx([0.01 / 3])


def test_crew_export_writes_one_fp32_state_dict(tmp_path):
    engine, loader = single_engine(ds_config(bf16={"enabled": True}))
    train(engine, loader, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    result = crew("export", str(tmp_path / "ckpt"), str(tmp_path / "model.pt"), cwd=tmp_path)
    assert result.code == 0, result.err
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in exported.values())
    masters = {n: engine.precision.master_of(p) for n, p in engine.module.named_parameters()}
    for name, master in masters.items():
        assert torch.equal(exported[name], master)  # the fp32 masters, not bf16-rounded weights
    plain = make_model()
    plain.load_state_dict(exported)


def test_export_to_safetensors_and_save_16bit_model(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    engine, loader = single_engine(ds_config(bf16={"enabled": True}))
    train(engine, loader, 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    assert crew("export", str(tmp_path / "ckpt" / "global_step1"), str(tmp_path / "m.safetensors"),
                cwd=tmp_path).code == 0
    make_model().load_state_dict(safetensors.load_file(tmp_path / "m.safetensors"))
    engine.save_16bit_model(tmp_path / "out", "weights.bin")
    half = torch.load(tmp_path / "out" / "weights.bin", weights_only=True)
    assert half["0.weight"].dtype == torch.bfloat16
    make_model().load_state_dict(half)
    engine.module[0].weight.requires_grad_(False)
    engine.save_fp16_model(tmp_path / "out", "all.bin")  # DeepSpeed's old name
    engine.save_16bit_model(tmp_path / "out", "trainable.bin", exclude_frozen_parameters=True)
    assert set(torch.load(tmp_path / "out" / "all.bin", weights_only=True)) == set(half)
    assert set(torch.load(tmp_path / "out" / "trainable.bin", weights_only=True)) == set(half) - {"0.weight"}


def test_export_of_a_folder_without_checkpoint_is_a_clear_error(tmp_path):
    result = crew("export", str(tmp_path), str(tmp_path / "x.pt"), cwd=tmp_path)
    assert result.code == 2
    assert "neither a checkpoint tag folder" in result.err and "Traceback" not in result.err


# A save that cannot complete (a real write error on one rank): test_checkpoint_integrity.py


# -- SIGKILL at chosen points of a save -----------------------------------------------------------

# The job: dying_save.save_twice, run by crew run once (its report and teardown) and in run_until_one_dies's
# ranks at every kill point (cheaper: the ranks fork from a process that imported torch).
KILLER = f"""
    import os, sys
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from dying_save import save_twice
    save_twice(int(os.environ["RANK"]), ".", sys.argv[1], int(sys.argv[2]))
"""


def assert_loads(folder: Path, expected: str) -> None:
    """The checkpoint in `folder` loads, on one process (as strict as two more ranks), from the tag `expected`."""
    import crew as crew_api

    assert (folder / "ckpt" / "latest").read_text() == expected
    torch.manual_seed(0)
    engine, _, _, _ = crew_api.initialize(model=torch.nn.Linear(32, 32), config={
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    path, _ = engine.load_checkpoint(str(folder / "ckpt"))
    assert path.endswith(f"ckpt/{expected}") and engine.global_steps == 1


def test_a_rank_killed_during_a_save_under_crew_run_is_named_and_the_previous_checkpoint_loads(job_dir):
    (job_dir / "killer.py").write_text(textwrap.dedent(KILLER))
    run = crew("run", "--num_gpus", "2", "--no_local_rank", "killer.py", "rank1.pt", "1", cwd=job_dir, timeout=90)
    assert run.code == 128 + 9, run.err  # SIGKILL, reported as the first failure
    assert "rank 1 (local 1) was killed by SIGKILL" in run.err
    assert run.seconds < 30, "the surviving rank hung"
    assert_loads(job_dir, "first")


@pytest.mark.parametrize("kill_file, kill_rank, expected", [
    ("rank1.pt", 1, "first"),              # a rank dies writing its own file
    ("mp_rank_00_model_states.pt", 0, "first"),  # rank 0 dies writing DeepSpeed's model states
    ("crew_state.pt", 0, "first"),         # or crew's own beside them
    ("crew_checkpoint.json", 0, "first"),  # dies while committing, before the rename
    ("latest", 0, "first"),                # dies after the new tag is in place, before `latest`
])
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, kill_file, kill_rank, expected):
    codes = run_until_one_dies(save_twice, 2, str(tmp_path), kill_file, kill_rank)
    assert codes[kill_rank] == -signal.SIGKILL, codes
    assert_loads(tmp_path, expected)


def test_split_state_balances_bytes_and_merges_back():
    from crew.runtime.checkpoint import merge_state, split_state

    engine, loader = single_engine()
    train(engine, loader, 1)
    state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
             "global_steps": 1}
    parts = split_state(state, 3)
    assert [set(p) >= {"module", "optimizer_state"} for p in parts] == [True] * 3
    assert "global_steps" in parts[0] and "global_steps" not in parts[1]
    assert all(p["module"] or p["optimizer_state"] for p in parts)  # work for every writer
    merged = merge_state(parts)
    assert list(merged["module"]) == list(state["module"])
    assert merged["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert merged["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()
