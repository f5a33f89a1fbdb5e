"""ZeRO stages 1-3 (crew/runtime/zero/) in real gloo processes: stage 0's losses, stage 2's
whole parameters and partitioned gradients, the memory each stage's theory promises, zero.Init,
GatheredParameters, and the zero_optimization keys."""

from __future__ import annotations

import pytest
import torch
from dist import run_parts, run_ranks

STEPS = 20
MICRO, ACCUMULATION, WORLD = 4, 2, 2


def make_model(blocks: int = 4, width: int = 16) -> torch.nn.Module:
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(blocks)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


# This file's models are small enough for DeepSpeed's stage3_param_persistence_threshold (1e5 elements) to keep
# every parameter whole: at 0 stage 3 shards them all (test_zero_comm3.py tests the whole ones).
SHARD_ALL = {"stage3_param_persistence_threshold": 0}


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 0.5, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, **(SHARD_ALL if stage == 3 else {})}, **extra}


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective at stage 3, where they are DTensor shards)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for name, p in module.named_parameters()}


def train(rank: int, stage: int, steps: int = STEPS, hook=None, **extra) -> dict:
    """The mean loss over both ranks per step, and the final weights. `hook`: registered on the first weight's
    gradient before initialize, as a user or PEFT does."""
    import crew

    torch.manual_seed(0)
    model = make_model()
    if hook is not None:
        model[0][0].weight.register_hook(hook)
    engine, _, _, _ = crew.initialize(model=model, config=config(stage, **extra))
    dtype = next(engine.module.parameters()).dtype if stage < 3 else engine.precision.dtype
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        for _ in range(ACCUMULATION):
            inputs = torch.randn(MICRO * WORLD, 16, generator=generator)
            targets = inputs.sum(dim=1, keepdim=True).sin()
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = torch.nn.functional.mse_loss(engine(inputs[mine].to(dtype)).float(), targets[mine])
            engine.backward(loss)
            engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    return {"losses": losses, "params": full_params(engine.module), "steps": engine.global_steps,
            "optimizer": type(engine.optimizer).__name__,
            "sharded": [type(p).__name__ for p in engine.module.parameters()]}


def every_stage(rank: int, **extra) -> dict:
    return {stage: train(rank, stage, **extra) for stage in range(4)}


def hooked(rank: int) -> dict:
    """A gradient hook on one weight (it halves the gradient) at stage 0 and 3; how often it ran."""
    results = {}
    for stage in (0, 3):
        runs = []

        def halve(grad: torch.Tensor, runs=runs) -> torch.Tensor:
            runs.append(1)
            return grad / 2

        results[stage] = {**train(rank, stage, steps=2, hook=halve), "runs": len(runs)}
    return results


def frozen_model_made_with(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def frozen_engines(rank: int) -> dict:
    """A model with no trainable parameter and no optimizer at each stage, as TRL's prepare_deepspeed builds
    its reference/reward/teacher models (`deepspeed.initialize(model=frozen, config=...)`, stage forced to 0
    below ZeRO-3): DeepSpeed accepts it, broadcasts rank 0's weights and runs its forward."""
    import crew

    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    seen = {}
    for stage in range(4):
        model = frozen_model_made_with(seed=rank)  # different weights on each rank: the engine uses rank 0's
        model.requires_grad_(False)
        engine, optimizer, _, scheduler = crew.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}})
        engine.eval()
        with torch.no_grad():
            seen[stage] = {"out": engine(inputs), "optimizer": (optimizer, engine.optimizer, scheduler),
                           "training": engine.training}
    return seen


class TiedByHand(torch.nn.Module):
    """An output layer tied to the first layer by hand: the parent's forward reads a child's weight outside the
    child's forward (DeepSpeed's test_ext_param_getattr); at stage 3 that child is a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.linear(self.second(self.first(x)).tanh(), self.first.weight).sum(dim=1)


def tied_by_hand(rank: int) -> dict:
    """Its losses, at stages 0 and 3, three steps and a forward without gradients."""
    import crew

    losses = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        engine, _, _, _ = crew.initialize(model=TiedByHand(), config=config(stage, gradient_accumulation_steps=1))
        data = torch.randn(4, MICRO * WORLD, 16, generator=torch.Generator().manual_seed(2))
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        losses[stage] = []
        for x in data[:3]:
            loss = engine(x[mine]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses[stage].append(loss.item())
        with torch.no_grad():
            losses[stage].append(engine(data[3][mine]).pow(2).mean().item())
    return losses


def every_stage_and_frozen(rank: int) -> tuple[dict, dict, dict | str]:
    try:
        tied = tied_by_hand(rank)
    except Exception as error:  # fails its own test only, not the job's others
        tied = f"{type(error).__name__}: {error}"
    return every_stage(rank), frozen_engines(rank), tied


@pytest.fixture(scope="module")
def job():
    """Every two-rank check of this file in the same two processes (one start): the memory first, as in a
    fresh process; the parts are defined below."""
    return run_parts({"memory": (memory_by_stage,), "stages": (every_stage_and_frozen,),
                      "low_precision": (low_precision,), "stage2": (stage2_world,), "init": (init_cases,),
                      "gather": (gather_at_every_stage,), "hooked": (hooked,)}, WORLD, timeout=300)


@pytest.fixture(scope="module")
def stages_job(job) -> list[tuple[dict, dict, dict]]:
    return job["stages"]


def test_stages_1_2_3_give_stage_0s_losses_and_weights_with_accumulation_and_clipping(stages_job):
    ranks = [trained for trained, _, _ in stages_job]
    base = ranks[0][0]
    assert base["steps"] == STEPS and base["losses"][-1] < base["losses"][0]
    for stage in (1, 2, 3):
        for rank in ranks:
            torch.testing.assert_close(rank[stage]["losses"], base["losses"], rtol=1e-5, atol=1e-7)
            for name, value in base["params"].items():
                torch.testing.assert_close(rank[stage]["params"][name], value, rtol=1e-5, atol=1e-6)
    # each stage really runs on its own machinery
    assert ranks[0][1]["optimizer"] == "GatheringZeroRedundancyOptimizer"  # param_sync.py's subclass
    assert ranks[0][2]["optimizer"] == "PartitionedOptimizer"
    assert set(ranks[0][3]["sharded"]) == {"DTensor"}
    assert set(ranks[0][0]["sharded"]) == set(ranks[0][2]["sharded"]) == {"Parameter"}  # whole at stage 2


def test_a_parameters_own_gradient_hook_runs_at_stage_3_which_keeps_it_whole(job):
    """FSDP2 would replace the hooked parameter and drop its hook (DeepSpeed's stage 3 runs it): crew keeps it whole,
    so the hook runs on every backward and the weights end as at stage 0; the others are still sharded."""
    for result in job["hooked"]:
        assert result[0]["runs"] == result[3]["runs"] == 2 * ACCUMULATION
        assert result[3]["sharded"][0] == "Parameter" and "DTensor" in result[3]["sharded"][1:]
        for name, value in result[0]["params"].items():
            assert torch.allclose(result[3]["params"][name], value, atol=1e-6), name


def test_a_frozen_model_without_optimizer_runs_at_every_stage_with_rank_0s_weights(stages_job):
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = frozen_model_made_with(seed=0)(inputs)
    for rank, (_, seen, _) in enumerate(stages_job):
        for stage in range(4):
            torch.testing.assert_close(seen[stage]["out"], expected, rtol=0, atol=1e-6,
                                       msg=f"rank {rank}, stage {stage}")
            assert seen[stage]["training"] is False
        # DeepSpeed builds a stand-in ZeRO optimizer at stages 1-3; at stage 0 in fp32 there is none
        assert seen[0]["optimizer"] == (None, None, None)


def test_a_units_weight_read_in_the_parents_forward_trains_as_at_stage_0(stages_job):
    for _, _, losses in stages_job:
        assert not isinstance(losses, str), losses
        torch.testing.assert_close(losses[3], losses[0], rtol=1e-5, atol=1e-7)
        assert losses[0][2] < losses[0][0]


def low_precision(rank: int) -> dict:
    return {(stage, kind): train(rank, stage, steps=8, **{kind: {"enabled": True}})
            for stage in (0, 2, 3) for kind in ("bf16", "fp16")}


def test_bf16_and_fp16_at_stages_2_and_3_track_stage_0(job):
    # Stage 0 keeps a 16-bit model with fp32 masters and reduces 16-bit gradients once per step; stage 2
    # too, but reduces on every micro step and keeps each master on one rank; stage 3 keeps fp32 shards,
    # computes in 16 bits and reduces in fp32: the same training, not the same bits.
    ranks = job["low_precision"]
    runs = ranks[0]
    for stage in (2, 3):
        for kind in ("bf16", "fp16"):
            torch.testing.assert_close(runs[(stage, kind)]["losses"], runs[(0, kind)]["losses"],
                                       rtol=2e-2, atol=1e-3)
            assert runs[(stage, kind)]["losses"][-1] < runs[(stage, kind)]["losses"][0]
            for name, value in runs[(stage, kind)]["params"].items():  # stage 2: broadcast whole, equal
                assert torch.equal(ranks[1][(stage, kind)]["params"][name], value), (stage, kind, name)


# -- stage 2: whole parameters, partitioned gradients -------------------------------------------

STAGE2_STEPS = 6
FP16 = {"enabled": True, "initial_scale_power": 4, "hysteresis": 1}


def batch_of(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One global micro batch (MICRO samples for each rank), as train() draws it."""
    inputs = torch.randn(MICRO * WORLD, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def stage2_fp32(rank: int) -> dict:
    """fp32 at stage 2: who holds which .grad after each backward, the norms, the whole parameters."""
    import crew
    torch.manual_seed(0)
    engine, _, _, _ = crew.initialize(model=make_model(), config=config(2))
    names = {id(p): name for name, p in engine.module.named_parameters()}
    generator = torch.Generator().manual_seed(1)
    holding, norms = [], []
    for _ in range(STAGE2_STEPS):
        for _ in range(ACCUMULATION):
            inputs, targets = batch_of(generator)
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs[mine]), targets[mine]))
            holding.append(sorted(names[id(p)] for p in engine.module.parameters() if p.grad is not None))
            # the gradients reduced so far, whole from their owners (a collective; the last boundary's kept)
            whole = {name: engine.optimizer.from_owner(p, grad=True) for name, p in engine.module.named_parameters()}
            engine.step()
        norms.append(engine.get_global_grad_norm().item())
    return {"holding": holding, "norms": norms, "owned": sorted(names[id(p)] for p in engine.zero.grads.owned),
            "whole_grads": whole,
            "params": {name: (type(p), p.detach().clone()) for name, p in engine.module.named_parameters()},
            "state": {name: (type(v), v.clone()) for name, v in engine.module.state_dict().items()}}


def stage2_fp16_overflow(rank: int) -> dict:
    """fp16 at stage 2: an inf in rank 1's input at step 2 skips that step on both ranks; the fp32
    masters, each on one rank, gathered whole (weights broadcast in place, biases flattened)."""
    import crew
    from crew.runtime.checkpoint.state import gathered_masters
    from crew.runtime.zero import param_sync

    param_sync.OWN_COLLECTIVE = 64
    torch.manual_seed(0)
    engine, _, _, _ = crew.initialize(model=make_model(), config=config(2, fp16=FP16))
    generator = torch.Generator().manual_seed(1)
    record = []
    for step in range(4):
        before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        scale = engine.loss_scale
        for micro in range(ACCUMULATION):
            inputs, targets = batch_of(generator)
            mine = inputs[rank * MICRO:(rank + 1) * MICRO].clone()
            if step == 2 and micro == 0 and rank == 1:
                mine[0, 0] = float("inf")
            loss = torch.nn.functional.mse_loss(engine(mine.half()).float(), targets[rank * MICRO:(rank + 1) * MICRO])
            engine.backward(loss)
            engine.step()
        moved = any(not torch.equal(p, before[name]) for name, p in engine.module.named_parameters())
        record.append((moved, engine.was_step_applied(), scale, float(engine.get_global_grad_norm())))
    own = {name: engine.precision.master_of(p).detach().clone() for name, p in engine.module.named_parameters()
           if engine.precision.master_of(p) is not p}
    whole = {name: engine.optimizer.from_owner(p) for name, p in engine.module.named_parameters()}
    return {"record": record, "skipped": engine.skipped_steps, "masters": own, "gathered": gathered_masters(engine),
            "from_owner": whole, "params": {name: p.detach().clone() for name, p in engine.module.named_parameters()}}


def stage2_world(rank: int) -> dict:
    return {"fp32": stage2_fp32(rank), "fp16": stage2_fp16_overflow(rank)}


def one_process(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same training on one process taking the global batch of 16 in one micro step."""
    import crew

    torch.manual_seed(0)
    ds_config = dict(config(0), train_micro_batch_size_per_gpu=MICRO * WORLD * ACCUMULATION,
                     gradient_accumulation_steps=1)
    engine, _, _, _ = crew.initialize(model=make_model(), config=ds_config)
    generator = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        parts = [batch_of(generator) for _ in range(ACCUMULATION)]
        inputs, targets = (torch.cat(tensors) for tensors in zip(*parts))
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
        norms.append(engine.get_global_grad_norm().item())
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}, norms


@pytest.fixture(scope="module")
def stage2_ranks(job) -> list[dict]:
    return job["stage2"]


def test_stage2_keeps_whole_equal_plain_parameters_on_every_rank(stage2_ranks):
    first, second = (ranks["fp32"] for ranks in stage2_ranks)
    for kind in ("params", "state"):
        assert first[kind].keys() == second[kind].keys() and first[kind]
        for name, (cls, value) in first[kind].items():
            assert cls in (torch.Tensor, torch.nn.Parameter), (name, cls)  # not DTensor shards
            assert value.shape == make_model().state_dict()[name].shape
            assert torch.equal(value, second[kind][name][1]), name


def test_stage2_a_rank_holds_only_its_own_gradients_and_only_at_the_boundary(stage2_ranks):
    first, second = (ranks["fp32"] for ranks in stage2_ranks)
    every = sorted(name for name, _ in make_model().named_parameters())
    assert first["owned"] and second["owned"]
    assert sorted(first["owned"] + second["owned"]) == every  # each parameter has one owner
    for result in (first, second):
        for micro, holding in enumerate(result["holding"]):
            boundary = micro % ACCUMULATION == ACCUMULATION - 1
            assert holding == (result["owned"] if boundary else []), micro
    assert first["whole_grads"].keys() == set(every)
    for name, grad in first["whole_grads"].items():  # deepspeed.utils.safe_get_full_grad's source
        assert grad is not None and grad.abs().sum() > 0 and torch.equal(grad, second["whole_grads"][name])


def test_stage2_with_accumulation_equals_one_process_taking_the_global_batch(stage2_ranks):
    """2 micro steps x 2 ranks x 4 samples, the gradients averaged on every micro step, clipped on the
    norm summed over both ranks' parts: what one process computes from the 16 samples at once."""
    params, norms = one_process(STAGE2_STEPS)
    for ranks in stage2_ranks:
        torch.testing.assert_close(ranks["fp32"]["norms"], norms, rtol=1e-5, atol=1e-7)
        assert max(norms) > config(2)["gradient_clipping"]  # clipping took effect
        for name, value in params.items():
            torch.testing.assert_close(ranks["fp32"]["params"][name][1], value, rtol=1e-5, atol=1e-6)


def test_stage2_fp16_overflow_on_one_rank_skips_the_step_on_both(stage2_ranks):
    first, second = (ranks["fp16"] for ranks in stage2_ranks)
    for result in (first, second):
        assert result["skipped"] == 1
        moved, applied, scale, norm = zip(*result["record"])
        assert moved == applied == (True, True, False, True)
        assert norm[2] == float("inf") and all(n < float("inf") for n in norm[:2] + norm[3:])
        assert scale[3] == scale[2] / 2  # halved after the overflow (hysteresis 1)
    assert first["record"] == second["record"]
    for name, value in first["params"].items():
        assert torch.equal(value, second["params"][name]), name
    # the fp32 masters are partitioned too: each rank keeps those of the parameters it owns
    assert first["masters"] and second["masters"] and not first["masters"].keys() & second["masters"].keys()
    masters = {**first["masters"], **second["masters"]}
    assert masters.keys() == {name for name, _ in make_model().named_parameters()}
    for result in (first, second):  # gathered from their owners, whole, on every rank
        for kind in ("gathered", "from_owner"):
            assert result[kind].keys() == masters.keys()
            for name, value in masters.items():
                assert result[kind][name].dtype == torch.float32 and torch.equal(result[kind][name], value), name
        for name, value in masters.items():  # the fp16 model weights are the masters, rounded
            assert torch.equal(result["params"][name], value.half()), name


# -- memory -----------------------------------------------------------------------------------

MEMORY_BLOCKS, MEMORY_WIDTH = 32, 96  # narrow weights: a step's scratch of one weight stays small
MODEL_STATES = ("PARAM", "GRAD", "OPT")  # FSDPMemTracker's (un)sharded params and grads, optimizer


def tracked_bytes_per_param(rank: int, stage: int) -> float:
    """Parameter, gradient and optimizer-state bytes held at the peak of one training step, per
    parameter, as torch's memory tracker sees them. DDP's gradient buckets come from its C++
    reducer, which the tracker files under activations, and stage 2's gradients come out of its
    buckets as temporaries: at stages 0-2 this is the total, which a one-row batch leaves to the model
    states. Stage 2's buckets count too: a bucket size below one weight's elements keeps them to two
    weights' gradients (its default, 5e8 elements, holds the whole gradient during the backward: 4
    bytes per parameter more at the peak, as DeepSpeed's own bucket)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    import crew

    torch.manual_seed(0)
    model = make_model(MEMORY_BLOCKS, MEMORY_WIDTH)
    count = sum(p.numel() for p in model.parameters())
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "steps_per_print": 1000,
                 "zero_optimization": {"stage": stage, **({"reduce_bucket_size": 4096} if stage == 2 else {}),
                                       # each unit sharded again after its forward and none fetched ahead (the
                                       # defaults keep a small model whole until its backward, as DeepSpeed's)
                                       **({"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                           **SHARD_ALL} if stage == 3 else {})}}
    if stage == 1:  # its all-gather of the updated parameters holds as many elements (the model, by default)
        ds_config["zero_optimization"]["reduce_bucket_size"] = 4096
    # AdamW one tensor at a time: the foreach kernels' scratch (another 1/N of the params) is no model state
    engine, _, _, _ = crew.initialize(model=model, config=ds_config,
                                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False))

    def step() -> None:
        engine.backward(engine(torch.randn(1, MEMORY_WIDTH)).pow(2).mean())
        engine.step()

    step()  # the optimizer state exists from the first step on
    optimizer = engine.optimizer.optim if stage in (1, 2) else engine.optimizer  # ZeRO-1/2's local part
    if stage == 3:
        tracker = FSDPMemTracker(engine.module, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(engine.module, optimizer)
    with tracker:
        step()
    peak = {str(kind): size for kind, size in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    if stage < 3:
        return peak["Total"] / count
    return sum(size for kind, size in peak.items() if any(word in kind for word in MODEL_STATES)) / count


def memory_by_stage(rank: int) -> dict:
    return {stage: tracked_bytes_per_param(rank, stage) for stage in range(4)}


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_rank_match_each_stages_theory_within_10_percent(job, world):
    theory = {0: 16, 1: 4 + 4 + 8 / world, 2: 4 + (4 + 8) / world, 3: 16 / world}  # fp32 Adam
    for rank, measured in enumerate(job["memory"] if world == WORLD else run_ranks(memory_by_stage, world)):
        for stage, expected in theory.items():
            assert abs(measured[stage] - expected) <= 0.10 * expected, (rank, stage, measured[stage], expected)


# -- zero.Init --------------------------------------------------------------------------------

class NoReset(torch.nn.Module):
    """A module with no reset_parameters() (as GPT-2's Conv1D): its __init__ alone sets its values."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(width))


class Tower(torch.nn.Module):
    """A parent that re-initialises its children with apply() in its own __init__, as HF models did."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.gain = NoReset(1)
        self.apply(self._init)

    @staticmethod
    def _init(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.gain.scale


def init_then_train(rank: int, stage: int) -> dict:
    import crew

    torch.manual_seed(0)
    expected = {name: p.detach().clone() for name, p in Tower().named_parameters()}
    torch.manual_seed(0 if rank == 0 else 7)  # rank 1 draws other values: rank 0's must win
    with crew.zero.Init():
        built = Tower()
    placeholders = {name: (p.numel(), p.ds_tensor.numel(), tuple(p.ds_shape), p.ds_status.name)
                    for name, p in built.named_parameters()}
    engine, _, _, _ = crew.initialize(model=built, config=config(stage))
    trained_from = full_params(engine.module)
    engine.backward(engine(torch.randn(MICRO, 16)).pow(2).mean())
    engine.step()
    return {"placeholders": placeholders, "expected": expected, "trained_from": trained_from}


def init_peak_bytes(rank: int) -> dict:
    """The peak of live tensor bytes while a 64 MiB model of 1 MiB layers is built under zero.Init, and
    outside it (torch's MemTracker counts tensors, not the C allocator's pages)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import crew

    def big() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(64)])

    peaks = {}
    for where in ("under_init", "outside"):
        tracker = MemTracker()
        with tracker, crew.zero.Init(enabled=where == "under_init"):
            model = big()
        peaks[where] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        if where == "under_init":
            peaks["kept"] = sum(p.ds_tensor.numel() * 4 for p in model.parameters())
    return peaks


def init_cases(rank: int) -> list[dict]:
    return [init_then_train(rank, stage) for stage in (3, 0)] + [init_peak_bytes(rank)]


def test_zero_init_partitions_each_module_as_built_with_rank_0s_values_and_never_holds_the_model_whole(job):
    for rank in job["init"]:
        *trained, memory = rank
        for result in trained:
            for name, (numel, piece, shape, status) in result["placeholders"].items():
                value = result["expected"][name]
                assert (numel, shape, status) == (0, tuple(value.shape), "NOT_AVAILABLE"), name
                assert piece == -(-value.numel() // WORLD), name
            assert result["trained_from"].keys() == result["expected"].keys()
            for name, value in result["expected"].items():  # apply() in __init__ reached the pieces too
                torch.testing.assert_close(result["trained_from"][name], value, rtol=0, atol=0)
        model_bytes = 64 * 512 * 512 * 4
        assert memory["kept"] == model_bytes // WORLD
        assert memory["under_init"] < 0.55 * model_bytes, memory  # its half, plus one layer while it is split
        assert memory["outside"] >= model_bytes, memory  # the measure sees a whole model


# -- GatheredParameters -----------------------------------------------------------------------

def gather_and_modify(rank: int, stage: int, precision: str | None) -> dict:
    import crew
    from crew.errors import CrewError

    torch.manual_seed(0)
    extra = {precision: {"enabled": True}} if precision else {}
    engine, _, _, _ = crew.initialize(model=make_model(), config=config(stage, **extra))
    first = engine.module[0][0]
    weight = first.weight  # held across the block, as DeepSpeed-Chat's save_zero_three_model does
    before = full_params(engine.module)["0.0.weight"]
    fetch = [p for p in (weight, None, first.bias) if p is not None and hasattr(p, "ds_id")
             and p.ds_status.name == "NOT_AVAILABLE"]
    with crew.zero.GatheredParameters(fetch, modifier_rank=None):
        seen = (tuple(first.weight.shape), type(weight.data.cpu()).__name__, weight.data.numel(), weight.data.dtype)
        first.weight.data.fill_(5.0)  # dropped at stage 3: no modifier rank
    after_dropped = full_params(engine.module)["0.0.weight"]
    with crew.zero.GatheredParameters(weight, modifier_rank=0):
        first.weight.data.fill_(float(rank + 1))  # stage 3: rank 0 writes 1.0; rank 1's 2.0 must lose
    after_written = full_params(engine.module)["0.0.weight"]
    master = engine.precision.master_of(weight)
    master_value = (master.full_tensor() if hasattr(master, "full_tensor") else master).detach().float()
    ones = torch.ones(2, 16, dtype=engine.precision.dtype)  # stage 3: seen whole in the compute dtype
    with torch.no_grad():
        outside = tuple(first(ones).shape)  # a submodule called outside the engine's forward
    try:
        first(ones)
        with_grad = None
    except CrewError as error:
        with_grad = str(error)
    state = engine.module.state_dict()  # stage 3: DeepSpeed's empty placeholders, never DTensors
    kept = engine.module.state_dict(keep_vars=True)["0.0.weight"] is weight
    return {"fetched": len(fetch), "seen": seen, "before": before, "after_dropped": after_dropped,
            "after_written": after_written, "master": master_value, "outside": outside, "with_grad": with_grad,
            "state": {type(v).__name__ for v in state.values()}, "state_numel": sum(v.numel() for v in state.values()),
            "keep_vars": kept}


def gather_at_every_stage(rank: int) -> list[dict]:
    return [gather_and_modify(rank, stage, precision)
            for stage, precision in [(3, None), (3, "bf16"), (2, "bf16"), (0, None)]]


def test_gathered_parameters_show_whole_tensors_and_write_back_the_modifier_ranks_values(job):
    for rank, results in enumerate(job["gather"]):
        assert [result["seen"][3] for result in results[:2]] == [torch.float32, torch.bfloat16]  # DeepSpeed's dtype
        for result in results[:2]:  # stage 3: the parameter object itself is whole inside the block
            assert result["fetched"] == 2 and result["seen"][:3] == ((16, 16), "Tensor", 256)
            assert torch.equal(result["after_dropped"], result["before"])
            assert torch.all(result["after_written"] == 1.0)
            assert torch.all(result["master"] == 1.0)  # the fp32 copy the optimizer steps moved too
            assert result["outside"] == (2, 16)
            assert "called outside the forward of the model the engine wraps" in result["with_grad"]
            assert (result["state"], result["state_numel"], result["keep_vars"]) == ({"Tensor"}, 0, True)
        for result in results[2:]:  # stages 0-2: nothing is partitioned, the block does nothing (DeepSpeed)
            assert result["fetched"] == 0
            assert torch.all(result["after_dropped"] == 5.0)
            assert torch.all(result["after_written"] == float(rank + 1))
            assert result["with_grad"] is None
            assert result["state_numel"] == sum(p.numel() for p in make_model().parameters())


# -- zero_optimization keys -------------------------------------------------------------------

def zero_of(section: dict, device: str = "cpu"):
    from crew.runtime.config import Config
    from crew.runtime.zero import Zero

    resolved = Config.from_dict({"train_micro_batch_size_per_gpu": 1, "zero_optimization": section}, 2)
    return Zero(resolved.zero_optimization, 2, torch.device(device))


@pytest.mark.parametrize("section, message", [
    ({"stage": 3, "wrap": "layers"}, r"zero_optimization.wrap is 'layers'; use \"blocks\""),
    ({"stage": 2, "reduce_bucket_size": -1}, r"reduce_bucket_size must be a number of elements >= 1"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, r"offload_optimizer.device is 'nvme'"),
    ({"stage": 2, "offload_param": "cpu"}, r"offload_param must be an object like"),
])
def test_bad_zero_values_are_clear_errors(section, message):
    from crew.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        zero_of(section)


def test_offload_is_a_logged_no_op_on_cpu_and_moves_the_optimizer_at_stages_1_2_on_gpus(capsys):
    assert zero_of({"stage": 1, "offload_optimizer": {"device": "cpu"}}).offload is None
    assert "offload_optimizer to cpu has no effect, training already runs on the CPU" in capsys.readouterr().out
    for stage in (1, 2):  # ZeRO-Offload: the optimizer's masters, gradients and state on the CPU
        offloaded = zero_of({"stage": stage, "offload_optimizer": {"device": "cpu"}}, device="cuda")
        assert offloaded.offload_optimizer and offloaded.offload == {"pin_memory": True}
        assert "live on the CPU, where the optimizer steps" in capsys.readouterr().out
    below = zero_of({"stage": 2, "offload_param": {"device": "cpu"}}, device="cuda")
    assert not below.offload_optimizer and below.offload is None
    assert "offload_param has no effect below stage 3 (as in DeepSpeed)" in capsys.readouterr().out
    assert zero_of({"stage": 0, "offload_optimizer": {"device": "cpu"}}, device="cuda").offload is None
    assert "offload_optimizer has no effect at stage 0 (as in DeepSpeed)" in capsys.readouterr().out
    assert zero_of({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}},
                   device="cuda").offload == {"pin_memory": False}


def test_wrap_rules_pick_the_block_stack_the_children_or_named_classes():
    import crew
    from crew.errors import ConfigError
    from crew.runtime.zero import wrap_units

    model = torch.nn.Sequential(torch.nn.Embedding(4, 16), torch.nn.ModuleList(make_model(3).children()))
    blocks = wrap_units(model, "blocks")
    assert blocks == list(model[1])[:3]  # the repeated blocks, not the lone head Linear
    assert wrap_units(model, "children") == [model[0], model[1]]
    assert wrap_units(model, ("Linear",)) == [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with pytest.raises(ConfigError, match=r"names \['Block'\], but the model has none.*'Embedding'"):
        wrap_units(model, ("Block",))
    flat = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.LayerNorm(2))
    assert wrap_units(flat, "blocks") == [flat[0], flat[2]]  # no repeated stack: the children
    # a block whose weight another module's forward uses stays in the root, whole through the forward
    crew.zero.register_external_parameter(model[1][2], model[1][0][0].weight)
    external = crew.zero.partition_parameters.external_parameters(model)
    assert wrap_units(model, "blocks", keep_in_root=external) == list(model[1])[1:3]
    crew.zero.unregister_external_parameter(model[1][2], model[1][0][0].weight)
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        crew.zero.unregister_external_parameter(model[1][2], model[1][0][0].weight)


def test_no_effect_keys_are_listed_once_at_start(capsys):
    import crew

    ds_config = config(3)
    ds_config["zero_optimization"].update(overlap_comm=True, reduce_bucket_size=5e7,
                                          stage3_module_granularity_threshold=100)
    crew.initialize(model=make_model(), config=ds_config)
    lines = [line for line in capsys.readouterr().out.splitlines() if "no effect" in line]
    assert len(lines) == 1
    for key in ("overlap_comm", "stage3_module_granularity_threshold", "reduce_bucket_size"):
        assert f"zero_optimization.{key}" in lines[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_client_optimizer_and_scheduler_keep_working_in_a_world_of_one(stage):
    import crew

    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    engine, engine_optimizer, _, engine_scheduler = crew.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}})
    assert engine_scheduler is scheduler
    lrs = []
    for _ in range(3):
        before = full_params(engine.module)["0.0.weight"]
        engine.backward(engine(torch.randn(2, 16)).pow(2).mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
        assert not torch.equal(full_params(engine.module)["0.0.weight"], before)  # it stepped
    assert lrs == [0.5, 0.25, 0.125]
    if stage in (1, 2):  # ZeRO-1/2 copy the lr into the optimizer that steps their part, at each step
        assert engine_optimizer.optim.param_groups[0]["lr"] == 0.25  # the lr of the third step


@pytest.mark.parametrize("rank", [1, -1, "0"])
def test_a_modifier_rank_outside_the_world_is_a_clear_error(rank):
    import crew
    from crew.errors import CrewError

    crew.init_distributed()  # a world of one
    with pytest.raises(CrewError, match=r"modifier_rank=.*give the rank whose changes are kept, 0\.\.0, or None"):
        crew.zero.GatheredParameters(torch.nn.Linear(2, 2).weight, modifier_rank=rank)


def test_a_model_on_the_meta_device_is_a_clear_error():
    import crew
    from crew.errors import ConfigError

    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ConfigError, match=r"\['0.0.weight', '0.0.bias', '1.0.weight'\] \.\.\. are on the meta device"):
        crew.initialize(model=model, config=config(3))


def test_zero_init_reads_where_to_keep_the_pieces_from_its_config(tmp_path):
    import crew
    from crew.errors import ConfigError

    offload = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert crew.zero.Init(config_dict_or_path=offload).keep_on == torch.device("cpu")
    assert crew.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}).keep_on is None
    with pytest.raises(ConfigError, match=r"zero.Init\(config_dict_or_path='.*missing.json'\): cannot read it"):
        crew.zero.Init(config_dict_or_path=str(tmp_path / "missing.json"))
