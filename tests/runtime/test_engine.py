"""The engine's step, in real gloo processes: equivalence with one big batch, accumulation, sync."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_parts

STEPS = 4
GLOBAL_BATCH = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_data(steps: int = STEPS):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(steps * GLOBAL_BATCH, 8, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True) ** 2


def config(micro: int, accumulation: int, clipping: float, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": clipping, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}, **extra}


def train_with_engine(rank: int, ds_config: dict, steps: int = STEPS) -> dict:
    """Each global step takes the next 16 rows; rank r's micro batch m is its slice of them."""
    import crew

    engine, _, _, _ = crew.initialize(model=make_model(), config=ds_config)
    inputs, targets = make_data(steps)
    micro, world = engine.train_micro_batch_size_per_gpu(), engine.world_size
    for step in range(steps):
        for m in range(engine.gradient_accumulation_steps()):
            start = step * GLOBAL_BATCH + (m * world + rank) * micro
            rows = slice(start, start + micro)
            loss = torch.nn.functional.mse_loss(engine(inputs[rows]), targets[rows])
            engine.backward(loss)
            engine.step()
    return {"params": copy.deepcopy(engine.module.state_dict()), "steps": engine.global_steps,
            "samples": engine.global_samples, "lr": engine.get_lr()}


def train_plain_torch(clipping: float, steps: int = STEPS) -> dict:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    inputs, targets = make_data(steps)
    for step in range(steps):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        if clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def assert_same_params(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Every two-rank check of this file in the same two processes (one start); the parts are defined below."""
    folder = str(tmp_path_factory.mktemp("accelerate_order"))
    return run_parts({"clipping 0.0": (train_with_engine, config(4, 2, 0.0)),
                      "clipping 0.5": (train_with_engine, config(4, 2, 0.5)),
                      "boundary": (check_accumulation_boundary,), "offloaded": (train_offloaded,),
                      "accelerate": (accelerate_resumes, folder)}, 2)


@pytest.mark.parametrize("clipping", [0.0, 0.5])
def test_two_ranks_with_accumulation_equal_one_big_batch(job, clipping):
    expected = train_plain_torch(clipping)
    ranks = job[f"clipping {clipping}"]
    for result in ranks:
        assert_same_params(result["params"], expected)
        assert result["steps"] == STEPS
        assert result["samples"] == STEPS * GLOBAL_BATCH


def test_clipping_changes_the_result():
    """Guards the test above: with these data the clipped and unclipped runs must differ."""
    clipped, unclipped = train_plain_torch(0.5), train_plain_torch(0.0)
    assert not torch.allclose(clipped["0.weight"], unclipped["0.weight"])


def test_single_process_engine_equals_plain_torch():
    result = train_with_engine(0, config(16, 1, 0.5))
    assert_same_params(result["params"], train_plain_torch(0.5))


def check_accumulation_boundary(rank: int) -> dict:
    import crew

    engine, optimizer, _, _ = crew.initialize(model=make_model(), config=config(4, 2, 0.0))
    first = next(engine.module.parameters())
    before = first.detach().clone()
    inputs, targets = make_data()
    seen = {}
    for micro_step in range(2):
        rows = slice(rank * 4 + micro_step * 8, rank * 4 + micro_step * 8 + 4)
        seen[f"boundary{micro_step}"] = engine.is_gradient_accumulation_boundary()
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[rows]), targets[rows]))
        grad = first.grad.detach().clone()
        gathered = [torch.zeros_like(grad) for _ in range(2)]
        torch.distributed.all_gather(gathered, grad)
        seen[f"grads_equal{micro_step}"] = torch.equal(gathered[0], gathered[1])
        engine.step()
        seen[f"changed{micro_step}"] = not torch.equal(first.detach(), before)
        seen[f"global_steps{micro_step}"] = engine.global_steps
    seen["grad_cleared"] = first.grad is None
    timer = engine.tput_timer  # DeepSpeed's: DeepSpeed-Chat calls update_epoch_count() after each epoch
    timer.update_epoch_count()
    seen["timer"] = (timer.micro_step_count, timer.global_step_count, timer.epoch_count)
    return seen


def test_no_sync_and_no_step_until_the_accumulation_boundary(job):
    for seen in job["boundary"]:
        assert seen == {
            "boundary0": False, "grads_equal0": False, "changed0": False, "global_steps0": 0,
            "boundary1": True, "grads_equal1": True, "changed1": True, "global_steps1": 1,
            "grad_cleared": True, "timer": (0, 1, 1)}


def test_config_scheduler_steps_once_per_optimizer_step():
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                "warmup_num_steps": 4, "warmup_type": "linear"}}
    import crew

    engine, _, _, scheduler = crew.initialize(
        model=make_model(), config=config(4, 2, 0.0, scheduler=schedule))
    assert scheduler is engine.lr_scheduler is not None
    lrs = []
    inputs, targets = make_data()
    for micro_step in range(8):
        rows = slice(micro_step * 4, micro_step * 4 + 4)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[rows]), targets[rows]))
        engine.step()
        lrs.append(engine.get_lr()[0])
    # the lr moves on each boundary (odd micro steps) and holds through the next micro step
    assert lrs[2::2] == lrs[1:-1:2]
    assert lrs[1::2] == sorted(lrs[1::2]) and lrs[-1] > lrs[1]


def test_client_optimizer_and_callable_and_model_only():
    import crew

    model = make_model()
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    no_optimizer = {"train_batch_size": 4}
    engine, optimizer, _, _ = crew.initialize(model=model, optimizer=mine, config=no_optimizer)
    assert optimizer is mine
    engine, optimizer, _, _ = crew.initialize(
        model=make_model(), optimizer=lambda params: torch.optim.SGD(params, lr=0.2),
        config=no_optimizer)
    assert isinstance(optimizer, torch.optim.SGD) and engine.get_lr() == [0.2]
    both = make_model()  # a client optimizer beside the config's section: the client's, as DeepSpeed (UER-py)
    theirs = torch.optim.SGD(both.parameters(), lr=0.3)
    engine, optimizer, _, _ = crew.initialize(model=both, optimizer=theirs, config=config(4, 1, 0.0))
    assert optimizer is theirs and engine.get_lr() == [0.3]
    engine, optimizer, _, _ = crew.initialize(model=make_model(), config=no_optimizer)  # model only, as DeepSpeed
    assert optimizer is None and engine.optimizer is None


def test_progress_line_and_batch_math_are_logged(capsys):
    import crew

    data = torch.utils.data.TensorDataset(*make_data())
    engine, _, loader, _ = crew.initialize(
        model=make_model(), training_data=data, config=config(4, 2, 0.0, steps_per_print=2))
    for inputs, targets in loader:
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    out = capsys.readouterr().out
    assert "micro 4 × accumulation 2 × 1 ranks = 8 per step; 8 steps per epoch" in out
    assert "step 2: loss " in out and "lr [0.01]" in out and "samples/s" in out
    assert "step 3:" not in out  # every steps_per_print steps only
    assert engine.global_steps == 8


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    import crew

    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, _, _, _ = crew.initialize(model=make_model(), config=config(4, 1, 0.0, fp16=fp16))
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    inputs, targets = make_data()
    loss = torch.nn.functional.mse_loss(engine(inputs[:4].half()).float(), targets[:4])
    engine.backward(loss * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.loss_scale == 2.0 ** 7
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    assert engine.global_steps == 1


def test_bf16_trains_with_fp32_master_weights():
    import crew

    engine, optimizer, _, _ = crew.initialize(
        model=make_model(), config=config(16, 1, 1.0, bf16={"enabled": True}))
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    inputs, targets = make_data(steps=40)
    losses = []
    for step in range(40):
        rows = slice(step * 16, step * 16 + 16)
        loss = torch.nn.functional.mse_loss(engine(inputs[rows].bfloat16()).float(), targets[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_the_process_group_is_destroyed_at_exit_while_python_is_whole(tmp_path):
    """Left to interpreter shutdown, gloo sometimes aborts a rank that finished fine (SIGABRT,
    'terminate called without an active exception'); DeepSpeed scripts never destroy it."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent("""
        import atexit, torch, torch.distributed as dist
        import crew
        # registered before crew.runtime.engine is imported, so it runs after crew's own exit handler
        atexit.register(lambda: print("group at exit:", dist.is_initialized()))
        engine, _, _, _ = crew.initialize(model=torch.nn.Linear(4, 4), config={
            "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        print("group during run:", dist.is_initialized())
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "group during run: True" in proc.stdout and "group at exit: False" in proc.stdout


def test_model_only_engine_and_deepspeeds_engine_attributes(tmp_path):
    import math

    import crew
    from crew.errors import ConfigError

    model = make_model()
    model.label = "mine"  # an attribute of the user's model: the engine forwards it, as DeepSpeed's
    ds_config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": math.inf}
    engine, optimizer, _, scheduler = crew.initialize(model=model, config_params=ds_config)
    assert (optimizer, scheduler, engine.optimizer) == (None, None, None)
    assert engine.config is ds_config and engine.label == "mine" and engine.module is model
    assert isinstance(engine, torch.nn.Module) and engine.steps_per_print() == math.inf
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        engine.no_such_thing  # noqa: B018
    loss = engine(torch.ones(4, 8)).sum()
    engine.backward(loss)
    with pytest.raises(ConfigError, match="engine.step\\(\\) needs an optimizer"):
        engine.step()
    engine.zero_grad()
    assert engine.save_checkpoint(tmp_path) is True  # the module (and no optimizer state) is saved
    with torch.no_grad():
        model[0].weight.zero_()
    path, _ = engine.load_checkpoint(tmp_path)
    assert path is not None and model[0].weight.abs().sum() > 0  # the weights came back
    assert not engine.is_compiled
    engine.compile(backend="eager")
    assert engine.is_compiled and torch.allclose(engine(torch.ones(4, 8)), model(torch.ones(4, 8)))


def train_offloaded(rank: int) -> dict:
    """ZeRO stages 1-2 with offload_optimizer, taking the offload path on this CPU machine: fp32 masters
    that only the owner keeps, stepped where they live, copied back and broadcast."""
    import crew
    from crew.runtime import zero

    seen = {}
    for stage in (1, 2, "1-bf16"):  # the last without offload: bf16's masters are partitioned at stage 1 too
        zero.OFFLOAD_ON_CPU = stage != "1-bf16"
        offload = {"offload_optimizer": {"device": "cpu"}} if zero.OFFLOAD_ON_CPU else {}
        extra = {"bf16": {"enabled": True}} if stage == "1-bf16" else {}
        ds_config = config(4, 2, 0.5, zero_optimization={"stage": int(str(stage)[0]), **offload}, **extra)
        engine, *_ = crew.initialize(model=make_model(), config=ds_config)
        inputs, targets = make_data()
        for step in range(STEPS):
            for m in range(2):
                start = step * GLOBAL_BATCH + (m * 2 + rank) * 4
                dtype = next(engine.module.parameters()).dtype
                output = engine(inputs[start:start + 4].to(dtype)).float()
                engine.backward(torch.nn.functional.mse_loss(output, targets[start:start + 4]))
                engine.step()
        params = list(engine.module.parameters())
        masters = [engine.precision.master_of(p) for p in params]
        seen[stage] = {"params": copy.deepcopy(engine.module.state_dict()),
                       "own_masters": sum(m is not p for m, p in zip(masters, params)),
                       "state_is_the_masters": all(any(t is s for s in masters) for t in engine.optimizer.optim.state)}
    return seen


def test_offloaded_optimizer_and_stage1_bf16_keep_each_fp32_master_on_its_owner_only(job):
    expected = train_plain_torch(0.5)
    results = job["offloaded"]
    for stage in (1, 2):
        for seen in results:
            assert_same_params(seen[stage]["params"], expected)
            assert seen[stage]["state_is_the_masters"]
        # each parameter has its fp32 master on exactly one rank (4 parameters in all)
        assert results[0][stage]["own_masters"] + results[1][stage]["own_masters"] == 4
    assert results[0]["1-bf16"]["own_masters"] + results[1]["1-bf16"]["own_masters"] == 4
    assert all(seen["1-bf16"]["state_is_the_masters"] for seen in results)


def accelerate_resumes(rank: int, folder: str) -> dict:
    """Accelerate's order (the boundary set after the forward, step() on the boundary only) at stages 1 and 2,
    and at stage 1 resumed from steps 1 and 2 in fresh engines (the boundary the caller set is part of the
    checkpoint, so a resumed engine reduces alike)."""
    import crew

    inputs, targets = make_data()

    def run(engine, steps: range, save_at: int | None = None) -> dict:
        for step in steps:
            for m in range(2):
                start = step * GLOBAL_BATCH + (m * 2 + rank) * 4
                loss = torch.nn.functional.mse_loss(engine(inputs[start:start + 4]), targets[start:start + 4])
                engine.set_gradient_accumulation_boundary(m == 1)
                engine.backward(loss)
            engine.step()
            if step + 1 == save_at:
                engine.save_checkpoint(folder, tag=f"step{save_at}")
        return copy.deepcopy(engine.module.state_dict())

    stage2 = config(4, 2, 0.5, zero_optimization={"stage": 2})
    seen = {"stage2": run(crew.initialize(model=make_model(), config=stage2)[0], range(STEPS))}
    ds_config = config(4, 2, 0.5, zero_optimization={"stage": 1})
    engine, *_ = crew.initialize(model=make_model(), config=ds_config)
    seen["uninterrupted"] = run(engine, range(STEPS), save_at=1)
    for resume_at in (1, 2):
        if resume_at == 2:  # a second checkpoint, at an even step, from a run that resumed at 1
            engine, *_ = crew.initialize(model=make_model(), config=ds_config)
            engine.load_checkpoint(folder, tag="step1")
            run(engine, range(1, STEPS), save_at=2)
        engine, *_ = crew.initialize(model=make_model(), config=ds_config)
        engine.load_checkpoint(folder, tag=f"step{resume_at}")
        seen[resume_at] = run(engine, range(resume_at, STEPS))
    return seen


def test_accelerate_order_averages_once_per_step_and_resumes_bit_for_bit(job):
    expected = train_plain_torch(0.5)  # one process, the 16 samples of each step at once
    for seen in job["accelerate"]:
        assert_same_params(seen["uninterrupted"], expected)
        assert_same_params(seen["stage2"], expected)
        for resume_at in (1, 2):
            for name, value in seen["uninterrupted"].items():
                assert torch.equal(seen[resume_at][name], value), (resume_at, name)
