"""crew's ZeRO-3 state as DeepSpeed 0.19.8's stage-3 files (crew/runtime/checkpoint/deepspeed_zero3.py): the same
keys, shapes and dtypes as the files real DeepSpeed wrote for the same model, config and training
(deepspeed_data/stage3_*), values within training noise of DeepSpeed's own, and, read back by crew's DeepSpeed
reader, exactly the weights and optimizer state of crew's live engine. A second model has what the fixtures lack:
a frozen parameter, a tied weight and sub groups (zero_optimization.sub_group_size); a third a frozen weight tied
under two names beside a trainable adapter (a PEFT model's wte and lm_head), saved and loaded back by the engine
with and without the frozen parameters.

Real DeepSpeed loading these files and training on with crew's losses, and DeepSpeed's own zero_to_fp32.py on
them: benchmarks/deepspeed_zero3_check.py (needs DeepSpeed; run by hand)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from dist import run_ranks

from crew.runtime.checkpoint import deepspeed_files
from crew.runtime.checkpoint.deepspeed_files import OPTIM_STATES, ZERO3_MODEL_STATES, read
from crew.runtime.checkpoint.deepspeed_writing import DEEPSPEED_PICKLE

DATA = Path(__file__).parent / "deepspeed_data"
EXPECTED = json.loads((DATA / "expected.json").read_text())
_spec = importlib.util.spec_from_file_location("make_checkpoints", DATA / "make_checkpoints.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)

# every stage-3 fixture: torch's AdamW (fp32, bf16, two groups), FusedAdam's and DeepSpeedCPUAdam's layouts (int
# steps, their group keys), and a LoRA run (frozen parameters apart, the empty no-decay group DeepSpeed drops)
CASES = [name for name, case in EXPECTED["cases"].items() if case["stage"] == 3]
ZERO3_KEYS = ("module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
              "shared_params")
# crew trains the fixtures' model as DeepSpeed did (test_deepspeed_checkpoints.py: equal losses in fp32): its flat
# partitions hold DeepSpeed's numbers to these bounds; a slice cut from the wrong place is off by 0.1 or more.
VALUE_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


class TiedFrozen(torch.nn.Module):
    """An embedding tied to the output layer, a frozen layer, and parameters whose sizes do not divide by 2."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 7)
        self.frozen = torch.nn.Linear(7, 5)
        self.frozen.requires_grad_(False)
        self.mid = torch.nn.Linear(5, 7)
        self.out = torch.nn.Linear(7, 11, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, ids):
        return self.out(torch.relu(self.mid(self.frozen(self.embed(ids)))))


class FrozenTiedAdapter(torch.nn.Module):
    """A PEFT-like model: a frozen embedding tied to the (so frozen) output layer, and a trainable adapter."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 7)
        self.embed.requires_grad_(False)
        self.adapter = torch.nn.Linear(7, 7)
        self.out = torch.nn.Linear(7, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.relu(self.adapter(self.embed(ids))))


TIED_CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
               "optimizer": {"type": "Adam", "params": {"lr": 0.01}},  # DeepSpeed's FusedAdam on a CPU
               "zero_optimization": {"stage": 3, "sub_group_size": 40}}
ADAGRAD_OFFLOAD = {"optimizer": {"type": "Adagrad", "params": {"lr": 0.05, "weight_decay": 0.01}},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}


def _train_fixture_case(name: str, **zero):
    import crew
    precision = made.CASES[name][1]
    model, params = made.case_model(name, seed=0)
    config = made.case_config(name)
    config["zero_optimization"] = {**config["zero_optimization"], **zero}
    engine, _, _, _ = crew.initialize(model=model, model_parameters=params, config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for step in range(made.K_STEPS):
        for micro_step in range(made.ACCUMULATION):
            inputs, targets = made.batch(step, micro_step, rank, world)
            engine.backward(made.loss_of(engine(inputs.to(dtype)), targets))
            engine.step()
    return engine


def _train_tied():
    """The tied model trained 2 steps, and its optimizer file before the first."""
    import crew
    from crew.runtime.checkpoint.deepspeed_zero3 import zero3_optim_states
    torch.manual_seed(0)
    engine, _, _, _ = crew.initialize(model=TiedFrozen(), config=TIED_CONFIG)
    before = zero3_optim_states(engine)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        ids = torch.randint(0, 11, (2, 3), generator=generator)
        engine.backward(engine(ids).float().pow(2).mean())
        engine.step()
    return engine, before


def _train_frozen_tied():
    """FrozenTiedAdapter trained 2 steps, saved by engine.save_checkpoint with and without the frozen parameters
    and loaded into an engine built from another seed, as Trainer resumes a PEFT model (load_module_strict=False
    without them). Returns the trained engine and {tag: the loaded engine's weights, whole}."""
    import shutil
    import tempfile

    import crew
    config = {**TIED_CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}

    def build(seed):
        torch.manual_seed(seed)
        return crew.initialize(model=FrozenTiedAdapter(), config=config)[0]

    engine = build(0)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        ids = torch.randint(0, 11, (2, 3), generator=generator)
        engine.backward(engine(ids).float().pow(2).mean())
        engine.step()
    folder = [tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(folder)
    loaded = {}
    for tag, exclude in (("with_frozen", False), ("without_frozen", True)):
        engine.save_checkpoint(folder[0], tag=tag, exclude_frozen_parameters=exclude)
        fresh = build(1)
        fresh.load_checkpoint(folder[0], tag=tag, load_module_strict=not exclude)
        loaded[tag] = _live(fresh)[0]
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(folder[0])
    return engine, loaded


def _one_step(extra: dict, dtype: torch.dtype = torch.float32):
    """One optimizer step of the fixtures' model at stage 3 with `extra` config."""
    import crew
    engine, _, _, _ = crew.initialize(model=made.build_model(seed=0), config=made.config(3, "fp32", extra))
    for micro_step in range(made.ACCUMULATION):
        inputs, targets = made.batch(0, micro_step, torch.distributed.get_rank(), torch.distributed.get_world_size())
        engine.backward(made.loss_of(engine(inputs.to(dtype)), targets))
        engine.step()
    return engine


def _train_fp16():
    """One step under fp16 (dynamic loss scaling), where DeepSpeed keeps a DynamicLossScaler in the file."""
    return _one_step({"fp16": {"enabled": True}}, torch.float16)


def _train_hsdp():
    """Sharded within groups of 1 rank and replicated over 2 (mics_shard_size: FSDP2 on a 2-D mesh, HSDP): every
    parameter is gathered, DeepSpeed's slices are still over the whole world."""
    return _one_step({"zero_optimization": {"stage": 3, "mics_shard_size": 1}})


def _train_adagrad_offload():
    """One step of "Adagrad" with offload_optimizer, for which DeepSpeed builds its CPU Adagrad."""
    return _one_step(ADAGRAD_OFFLOAD)


def _live(engine) -> tuple[dict, dict]:
    """The engine's fp32 weights and optimizer state by parameter name, whole (collectives)."""
    weights, state = {}, {}
    for name, param in engine.module.named_parameters():
        weights[name] = (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        entry = engine.optimizer.state.get(param)
        if entry:
            state[name] = {key: value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
                           for key, value in entry.items()}
    return weights, state


def _save_all(rank: int) -> list[dict]:
    from crew.runtime.checkpoint.deepspeed_zero3 import _even_shard, zero3_model_states, zero3_optim_states
    tied, before = _train_tied()
    frozen_tied, loaded = _train_frozen_tied()
    engines = [(name, _train_fixture_case(name)) for name in CASES] + [("tied", tied), ("frozen_tied", frozen_tied)]
    out = []
    engines += [("adagrad", _train_adagrad_offload()), ("fp16", _train_fp16()), ("hsdp", _train_hsdp()),
                # every parameter sharded, not whole (they are all under stage3_param_persistence_threshold)
                ("lora_sharded", _train_fixture_case("lora_stage3", stage3_param_persistence_threshold=0))]
    for name, engine in engines:
        weights, state = _live(engine)
        out.append({"name": name, "model": zero3_model_states(engine, exclude_frozen=False),
                    "model_without_frozen": zero3_model_states(engine, exclude_frozen=True),
                    "optim": zero3_optim_states(engine), "weights": weights, "state": state,
                    "world": engine.world_size, "before": before if name == "tied" else None,
                    "loaded": loaded if name == "frozen_tied" else None,
                    "not_gathered": [key for key, param in engine.module.named_parameters()
                                     if _even_shard(param, list(range(engine.world_size))) is not None]})
    return out


@pytest.fixture(scope="module")
def saved() -> dict[str, list[dict]]:
    """{case: [rank 0's result, rank 1's]}: one pair of processes trains every case and writes its dicts."""
    per_rank = run_ranks(_save_all, 2, timeout=240)
    return {entry["name"]: [rank[index] for rank in per_rank] for index, entry in enumerate(per_rank[0])}


# -- the layout --------------------------------------------------------------------------------------

def _layout(value):
    """The skeleton of a saved object: keys, types, tensor shapes and dtypes (values of tensors left out)."""
    if isinstance(value, dict):
        return (type(value).__name__, {key: _layout(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return (type(value).__name__, [_layout(item) for item in value])
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, deepspeed_files._Attributes):
        return (type(value).__name__, vars(value))
    return (type(value).__name__, value if isinstance(value, (torch.Size, str, bool, type(None))) else None)


def _fixture(name: str, rank: int, kind: str) -> dict:
    tag = DATA / name / EXPECTED["cases"][name]["tag"]
    if kind == "model":
        return read(tag / ZERO3_MODEL_STATES.format(rank=rank))
    prefix = "bf16_" if EXPECTED["cases"][name]["precision"] == "bf16" else ""
    return read(tag / f"{prefix}{OPTIM_STATES[0].format(rank=rank)}")


@pytest.mark.parametrize("name", CASES)
def test_the_files_hold_deepspeeds_keys_shapes_and_dtypes(saved, name):
    """Each rank's dicts against the files DeepSpeed 0.19.8 wrote for the same model and config, key by key."""
    for rank, got in enumerate(saved[name]):
        model, optim = _fixture(name, rank, "model"), _fixture(name, rank, "optim")
        assert _layout(got["model"]) == _layout({key: model[key] for key in ZERO3_KEYS})
        assert _layout(got["optim"]) == _layout(optim)
        assert got["optim"]["ds_config"] == optim["ds_config"]
        ours, theirs = got["optim"]["optimizer_state_dict"], optim["optimizer_state_dict"]
        assert ours["optimizer_state_dict"]["param_groups"] == theirs["optimizer_state_dict"]["param_groups"]
        # the values: crew trained what DeepSpeed trained, so each rank's slices hold DeepSpeed's numbers (not in
        # the padding, where DeepSpeed's are whatever the memory held under bf16; crew writes zeros)
        tolerance = VALUE_TOLERANCE[EXPECTED["cases"][name]["precision"]]
        shapes = model["param_shapes"]
        for index, (mine, its) in enumerate(zip(ours["fp32_flat_groups"], theirs["fp32_flat_groups"], strict=True)):
            held = _held(shapes[index], rank)
            assert torch.allclose(mine[held], its[held], atol=tolerance, rtol=0), (mine[held] - its[held]).abs().max()
            assert not mine[~held].any()
        for key, fragment in model["frozen_param_fragments"].items():  # LoRA's frozen base: the same weights
            held = _held({key: model["frozen_param_shapes"][key]}, rank)
            assert torch.equal(got["model"]["frozen_param_fragments"][key][held], fragment[held]), key
        for index, entry in theirs["optimizer_state_dict"]["state"].items():
            assert ours["optimizer_state_dict"]["state"][index]["step"] == entry["step"]  # a tensor or an int
            held = _held(shapes[index], rank)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(ours["optimizer_state_dict"]["state"][index][key][held], entry[key][held],
                                      atol=tolerance, rtol=0.05), key


def _held(shapes: dict, rank: int, world: int = 2) -> torch.Tensor:
    """Which elements of rank `rank`'s flat partition of a sub group are parameters (not padding)."""
    masks = []
    for shape in shapes.values():
        part = -(-shape.numel() // world)
        masks.append(torch.arange(part) < shape.numel() - rank * part)
    return torch.cat(masks)


# -- read back by crew's DeepSpeed reader ----------------------------------------------------------------

def write_tag(folder: Path, results: list[dict], optim_name: str, exclude_frozen: bool = False) -> Path:
    """The ranks' dicts as a DeepSpeed tag folder (with the keys common to every stage that saving.py adds)."""
    folder.mkdir(parents=True)
    for rank, got in enumerate(results):
        model = got["model_without_frozen"] if exclude_frozen else got["model"]
        torch.save({**model, "optimizer": None, "dp_world_size": got["world"], "mp_world_size": 1,
                    "ds_version": "0.19.8"}, folder / ZERO3_MODEL_STATES.format(rank=rank),
                   pickle_module=DEEPSPEED_PICKLE)
        torch.save(got["optim"], folder / optim_name.format(rank=rank), pickle_module=DEEPSPEED_PICKLE)
    return folder


def test_rows_that_divide_evenly_are_taken_from_the_shard_without_a_gather(saved):
    """FSDP2's rows are DeepSpeed's slice where they divide evenly over the ranks: LoRA's A matrices (2 rows) are
    written from the local shard, the rest gathered; test_the_files_hold... checks both against DeepSpeed's."""
    assert saved["lora_sharded"][0]["not_gathered"] == ["fc1_lora_a.weight", "fc2_lora_a.weight"]
    assert saved["stage3_fp32"][0]["not_gathered"] == []


@pytest.mark.parametrize("name", [*CASES, "tied", "hsdp", "lora_sharded"])
def test_crews_reader_gives_the_live_engines_weights_and_optimizer_state(saved, name, tmp_path):
    from crew.runtime.checkpoint import deepspeed_format
    prefix = "bf16_" if name in CASES and EXPECTED["cases"][name]["precision"] == "bf16" else ""
    folder = write_tag(tmp_path / "global_step3", saved[name], prefix + OPTIM_STATES[0])
    weights, state = saved[name][0]["weights"], saved[name][0]["state"]
    module = deepspeed_format.read_fp32_module(folder)
    for key, value in weights.items():
        assert torch.equal(module[key], value), key
    tag = deepspeed_format._Tag(folder)
    loaded = deepspeed_format._zero_optimizer(tag)
    assert set(loaded["state"]) == set(state)
    for key, entry in state.items():
        for item, value in entry.items():
            read_back = loaded["state"][key][item]
            if item == "step":  # DeepSpeed's FusedAdam (the tied case's config) counts in a Python int
                assert float(read_back) == float(value), key
            else:
                assert torch.equal(read_back, value), (key, item)


def test_frozen_tied_and_sub_groups_as_deepspeed_lays_them_out(saved, tmp_path):
    """DeepSpeed's rules for what the fixtures lack: frozen parameters apart (16-bit fragments, one slice a rank),
    a tied weight saved once and named in rank 0's shared_params, sub groups of sub_group_size elements a rank."""
    ranks = saved["tied"]
    model = ranks[0]["model"]
    # embed.weight 77 elements (39 a rank), mid 35 + 7 (18 + 4): sub groups close once they reach 40 a rank
    assert [list(group) for group in model["param_shapes"]] == [["embed.weight", "mid.weight"], ["mid.bias"]]
    assert model["param_shapes"][0]["embed.weight"] == torch.Size([11, 7])
    assert model["shared_params"] == {"out.weight": "embed.weight"} and ranks[1]["model"]["shared_params"] == {}
    assert list(model["frozen_param_shapes"]) == ["frozen.weight", "frozen.bias"]
    for rank, got in enumerate(ranks):
        fragments = got["model"]["frozen_param_fragments"]
        assert fragments["frozen.weight"].shape == (18,) and fragments["frozen.bias"].shape == (3,)
        whole = ranks[0]["weights"]["frozen.weight"].reshape(-1)
        assert torch.equal(fragments["frozen.weight"][:min(18, 35 - 18 * rank)], whole[18 * rank:18 * rank + 18])
        assert got["model_without_frozen"]["frozen_param_shapes"] is None
        assert "frozen.weight" not in got["model_without_frozen"]["module"]
        assert got["model"]["module"]["steps"].dtype == torch.int64
        assert got["model"]["module"]["embed.weight"].shape == (0,)
    optim = ranks[0]["optim"]["optimizer_state_dict"]
    assert [flat.numel() for flat in optim["fp32_flat_groups"]] == [39 + 18, 4]
    groups = optim["optimizer_state_dict"]["param_groups"]
    assert [group["params"] for group in groups] == [[0, 1]] and groups[0]["bias_correction"] is True
    # FusedAdam's own keys (deepspeed/ops/adam/fused_adam.py, "step" from its first step on), not torch AdamW's
    assert set(groups[0]) == {"lr", "bias_correction", "betas", "eps", "weight_decay", "step", "params"}
    assert optim["optimizer_state_dict"]["state"][0]["step"] == 2  # FusedAdam's int
    # without the frozen parameters the weights still read back
    from crew.runtime.checkpoint import deepspeed_format
    folder = write_tag(tmp_path / "tag", ranks, OPTIM_STATES[0], exclude_frozen=True)
    tag = deepspeed_format._Tag(folder)
    params = deepspeed_format.fp32_params(tag, None)
    assert torch.equal(params["mid.weight"], ranks[0]["weights"]["mid.weight"])


def test_a_frozen_weight_tied_to_a_second_name_is_saved_and_loaded_as_deepspeeds(saved, tmp_path):
    """A frozen embedding tied to the output layer (a PEFT model's wte and lm_head): written once, by its first
    name, in frozen_param_fragments, the second name in shared_params, as DeepSpeed 0.19.8 wrote them for this
    model; without the frozen parameters, DeepSpeed drops the first name only (module_state_dict), writes no
    fragments, and its zero_to_fp32 leaves the second name out. Each read back and loaded into a fresh engine."""
    from crew.runtime.checkpoint import deepspeed_format
    ranks = saved["frozen_tied"]
    weights = ranks[0]["weights"]
    for rank, got in enumerate(ranks):
        model, without = got["model"], got["model_without_frozen"]
        assert {key: tuple(value.shape) for key, value in model["module"].items()} == {
            "embed.weight": (0,), "adapter.weight": (0,), "adapter.bias": (0,), "out.weight": (0,)}
        assert list(without["module"]) == ["adapter.weight", "adapter.bias", "out.weight"]
        assert model["frozen_param_shapes"] == {"embed.weight": torch.Size([11, 7])}
        fragment = model["frozen_param_fragments"]["embed.weight"]
        assert fragment.shape == (39,) and torch.equal(fragment[:39 - rank], weights["embed.weight"].reshape(-1)[
            39 * rank:39 * rank + 39])
        assert without["frozen_param_shapes"] is None and without["frozen_param_fragments"] is None
        shared = {"out.weight": "embed.weight"} if rank == 0 else {}
        assert model["shared_params"] == without["shared_params"] == shared
        assert [list(group) for group in model["param_shapes"]] == [["adapter.weight", "adapter.bias"]]
    module = deepspeed_format.read_fp32_module(write_tag(tmp_path / "with", ranks, OPTIM_STATES[0]))
    assert module.keys() == weights.keys() | {"out.weight"}
    for key, value in module.items():
        assert torch.equal(value, weights[key.replace("out.", "embed.")]), key
    module = deepspeed_format.read_fp32_module(write_tag(tmp_path / "without", ranks, OPTIM_STATES[0], True))
    assert module.keys() == {"adapter.weight", "adapter.bias"}  # DeepSpeed's zero_to_fp32's keys
    assert all(torch.equal(value, weights[key]) for key, value in module.items())
    # engine.load_checkpoint: every weight back; without the frozen ones, the fresh engine keeps its own embedding
    loaded = ranks[0]["loaded"]
    assert all(torch.equal(loaded["with_frozen"][key], value) for key, value in weights.items())
    assert torch.equal(loaded["without_frozen"]["adapter.weight"], weights["adapter.weight"])
    torch.manual_seed(1)
    assert torch.equal(loaded["without_frozen"]["embed.weight"], FrozenTiedAdapter().embed.weight.detach())


def test_before_the_first_step_and_deepspeeds_cpu_adagrad(saved):
    """Saved before any step: no optimizer state and no FusedAdam group step yet, as DeepSpeed's. "Adagrad" with
    offload_optimizer: DeepSpeedCPUAdagrad's layout (deepspeed/ops/adagrad/cpu_adagrad.py), torch's `sum` as its
    `exp_avg_sq`, an int step, its group keys."""
    before = saved["tied"][0]["before"]["optimizer_state_dict"]
    assert before["optimizer_state_dict"]["state"] == {}
    assert "step" not in before["optimizer_state_dict"]["param_groups"][0]
    assert [flat.numel() for flat in before["fp32_flat_groups"]] == [39 + 18, 4]
    for rank, got in enumerate(saved["adagrad"]):
        optimizer = got["optim"]["optimizer_state_dict"]["optimizer_state_dict"]
        assert set(optimizer["state"]) == {0} and optimizer["state"][0]["step"] == 1
        assert set(optimizer["param_groups"][0]) == {"lr", "eps", "weight_decay", "amsgrad", "params"}
        shapes = got["model"]["param_shapes"][0]
        parts = [-(-shape.numel() // 2) for shape in shapes.values()]
        expected = torch.cat([torch.nn.functional.pad(
            got["state"][name]["sum"].reshape(-1)[rank * part:(rank + 1) * part], (0, part)).narrow(0, 0, part)
            for name, part in zip(shapes, parts, strict=True)])
        assert torch.equal(optimizer["state"][0]["exp_avg_sq"], expected)


def test_fp16_keeps_deepspeeds_dynamic_loss_scaler(saved):
    """fp16 (which DeepSpeed refuses on a CPU, so no fixture): a DynamicLossScaler with every attribute DeepSpeed's
    has (deepspeed/runtime/fp16/loss_scaler.py), crew's scale, 16-bit placeholders."""
    got = saved["fp16"][0]
    optim = got["optim"]["optimizer_state_dict"]
    scaler = vars(optim["loss_scaler"])
    assert type(optim["loss_scaler"]).__name__ == "DynamicLossScaler" and optim["dynamic_loss_scale"] is True
    assert set(scaler) == {"cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
                           "min_scale", "delayed_shift", "cur_hysteresis", "consecutive_hysteresis",
                           "raise_error_at_min_scale", "dtype"}
    assert scaler["cur_scale"] == 2.0 ** 16 and scaler["cur_iter"] == 1 and scaler["dtype"] is torch.float16
    assert got["model"]["module"]["fc1.weight"].dtype == torch.float16
    assert got["model"]["module"]["scale"].dtype == torch.float32  # a buffer as the module holds it
    assert optim["fp32_flat_groups"][0].dtype == torch.float32


def test_a_factored_optimizer_state_is_refused():
    """Optimizer state that is not element-wise with the weights (Adafactor's row and column factors) cannot
    be laid out flat as DeepSpeed's: one clear error, not a wrong file."""
    from crew.runtime.checkpoint.deepspeed_zero3 import _state_tensor
    from crew.runtime.checkpoint.layout import CheckpointError
    with pytest.raises(CheckpointError, match="Adafactor"):
        _state_tensor(torch.zeros(7), torch.nn.Parameter(torch.zeros(7, 5)), "row_var")
    assert copy.copy(_state_tensor(None, torch.nn.Parameter(torch.zeros(2, 3)), "exp_avg")).shape == (2, 3)
