"""A DeepSpeed 0.19 checkpoint tag (deepspeed_files.py) as the state crew's loader loads: the fp32 weights by
parameter name, the optimizer state by parameter name, the scheduler, the counters and client_state. From
there loading.py moves the optimizer state into any ZeRO stage at any world size, as for crew's own
checkpoints.

Where the fp32 weights are (DeepSpeed keeps them apart from the 16-bit module under bf16/fp16):
  stage 0   the module itself in fp32; under bf16/fp16 the optimizer's fp32 copies: "fp32_groups" (one a
            parameter, FP16_UnfusedOptimizer) or "fp32_groups_flat" (one flat tensor a group, FP16_Optimizer)
  stage 1-2 each rank's "single_partition_of_fp32_groups": a group's parameters flattened in param_shapes
            order (with param_alignment_paddings after each), the flat tensor cut into equal partitions,
            the last padded (group_paddings); the optimizer state ("base_optimizer_state") likewise
  stage 3   each rank's "fp32_flat_groups": every parameter padded to a multiple of the world size and each
            rank holding its 1/world of it, one after the other; the optimizer state likewise
as deepspeed/utils/zero_to_fp32.py reassembles them. At stage 0 the files name no parameters: the
optimizer's entries are matched to this engine's parameters by position, as DeepSpeed's own load does.
The optimizer state then takes the conventions of this engine's optimizer (DeepSpeed's kernels count `step` as
an int, CPU Adagrad names torch's `sum` otherwise, the groups carry other settings), its param groups matched to
this engine's by the parameters they hold; a state of another optimizer is refused.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from crew.runtime.checkpoint.deepspeed_files import (
    MODEL_STATES,
    ZERO3_MODEL_STATES,
    optim_files,
    read,
    refuse_unsupported,
)
from crew.runtime.checkpoint.layout import CheckpointError

DEEPSPEED = "deepspeed"  # the "format" loading.py sees in place of a crew manifest's
# what DeepSpeed's _load_checkpoint keeps out of the client_state it returns (engine.py, 0.19.8)
_ENGINE_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                "random_ltd")


class _Tag:
    """One tag's files, read on demand: the model states of rank 0 and, for stages 1-3, every rank's
    optimizer file."""

    def __init__(self, folder: Path, mp: int = 0, tensor_parallel: bool = False):
        refuse_unsupported(folder, tensor_parallel)
        self.folder, self.mp = folder, mp
        zero3 = not (folder / MODEL_STATES).is_file()
        name = ZERO3_MODEL_STATES.format(rank=0) if zero3 else MODEL_STATES
        self.model_file = folder / name.replace("mp_rank_00", f"mp_rank_{mp:02d}")
        self.model = read(self.model_file)
        if not isinstance(self.model, dict) or "module" not in self.model:
            raise CheckpointError(f"{self.model_file} is not a DeepSpeed model states file (no 'module' in it)")
        self.world_size = int(self.model.get("dp_world_size") or 1)
        self.zero = self.model.get("param_shapes") is not None  # saved by a ZeRO optimizer (stages 1-3)
        self.stage = 3 if zero3 else (None if self.zero else 0)  # 1 or 2: from the optimizer files
        self._optim: list[dict] | None = None

    def optim(self) -> list[dict]:
        """Each rank's optimizer_state_dict (stages 1-3)."""
        if self._optim is None:
            self._optim = []
            for path in optim_files(self.folder, self.world_size, self.mp):
                saved = read(path)
                state = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
                if not isinstance(state, dict):
                    raise CheckpointError(f"{path} is not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict)")
                self._optim.append(state)
            if self.stage is None:  # BF16_Optimizer's files do not say; its layout is stage 1's
                self.stage = int(self._optim[0].get("zero_stage", 1))
        return self._optim

    def lp_dtype(self) -> torch.dtype:
        """The dtype the module trained in (fp32, bf16 or fp16)."""
        buffers = set(self.model.get("buffer_names") or ())
        dtypes = [value.dtype for name, value in self.model["module"].items()
                  if name not in buffers and isinstance(value, torch.Tensor) and value.is_floating_point()]
        return dtypes[0] if dtypes else torch.float32

    def param_shapes(self) -> list[dict[str, torch.Size]]:
        return [dict(group) for group in self.model["param_shapes"]]

    def optimizer_file(self) -> Path:
        """The file the optimizer state is in (rank 0's at stages 1-3)."""
        return self.model_file if self.stage == 0 else optim_files(self.folder, self.world_size, self.mp)[0]

    def where(self) -> str:
        return f"{self.folder}'s optimizer files"


# -- flat partitions -> tensors by name --------------------------------------------------------------

def _zero12_split(pieces: list[torch.Tensor], paddings: list[int], shapes: dict, alignment: list[int] | None,
                  where: str) -> dict[str, torch.Tensor]:
    """One param group at stages 1-2: the ranks' partitions (with or without their trailing padding) -> the
    group's tensors by name."""
    needed = sum(math.prod(shape) for shape in shapes.values()) + sum(alignment or [])
    lengths = [piece.numel() for piece in pieces]
    if sum(lengths) != needed:  # the padding is still there: cut it off
        lengths = [piece.numel() - padding for piece, padding in zip(pieces, paddings, strict=True)]
    if sum(lengths) != needed:
        raise CheckpointError(f"{where}: the ranks' partitions hold {sum(lengths)} elements, the parameters "
                              f"{list(shapes)} need {needed}: the files do not belong to one checkpoint")
    whole = torch.cat([piece.reshape(-1)[:length] for piece, length in zip(pieces, lengths, strict=True)])
    out, offset = {}, 0
    for index, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        out[name] = whole[offset:offset + numel].view(shape)  # views of a fresh tensor: no copy
        offset += numel + (alignment[index] if alignment else 0)
    return out


def _zero3_split(pieces: list[torch.Tensor], shapes: dict, where: str) -> dict[str, torch.Tensor]:
    """Stage 3: each rank's flat tensor (all its sub-groups, in order) -> whole tensors by name."""
    world = len(pieces)
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        out[name] = torch.cat([piece[offset:offset + part] for piece in pieces])[:numel].view(shape)
        offset += part
    if any(piece.numel() != offset for piece in pieces):
        raise CheckpointError(f"{where}: a rank's partition holds {pieces[0].numel()} elements, the parameters "
                              f"need {offset} a rank: the files do not belong to one checkpoint")
    return out


def _split_state(tag: _Tag, per_rank: list[list[torch.Tensor]], group_shapes: list[dict]) -> dict[str, torch.Tensor]:
    """Flat tensors, [rank][group or sub-group], in the tag's layout -> tensors by parameter name."""
    if tag.stage == 3:
        merged = {name: shape for shapes in group_shapes for name, shape in shapes.items()}
        return _zero3_split([torch.cat([t.reshape(-1) for t in groups]) for groups in per_rank], merged, tag.where())
    out = {}
    optim = tag.optim()
    for group, shapes in enumerate(group_shapes):
        paddings = [state.get("group_paddings", [0] * len(group_shapes))[group] for state in optim]
        alignment = optim[0].get("param_alignment_paddings")
        out.update(_zero12_split([groups[group] for groups in per_rank], paddings, shapes,
                                 alignment[group] if alignment else None, tag.where()))
    return out


# -- weights ---------------------------------------------------------------------------------------

def _stage0_copies(tag: _Tag) -> tuple[list[list[torch.Tensor]], bool] | None:
    """Stage 0 under bf16/fp16: the optimizer's fp32 copies, [group][parameter] (FP16_UnfusedOptimizer) or
    [group][one flat tensor] (FP16_Optimizer, flat: True); None without them (fp32)."""
    optimizer = tag.model.get("optimizer")
    if not isinstance(optimizer, dict):
        return None
    if "fp32_groups" in optimizer:
        return [list(group) for group in optimizer["fp32_groups"]], False
    if "fp32_groups_flat" in optimizer:
        return [[flat] for flat in optimizer["fp32_groups_flat"]], True
    return None


def _by_position(tag: _Tag, tensors: list[list[torch.Tensor]], flat: bool, groups: list[list[str]],
                 what: str) -> dict[str, torch.Tensor]:
    """Stage 0: tensors [group][parameter] (or [group][flat tensor]) matched to this engine's optimizer groups
    of parameter names by position, as DeepSpeed's own load_state_dict does."""
    shapes = {name: tuple(value.shape) for name, value in tag.model["module"].items()}
    fix = ("build the optimizer over the same parameters, in the same groups and order, as the DeepSpeed run "
           "did, or load the weights only (load_optimizer_states=False)")
    if len(tensors) != len(groups):
        raise CheckpointError(f"{tag.model_file}: the optimizer has {len(tensors)} param groups, this engine's "
                              f"{len(groups)}: {fix}")
    out = {}
    for names, group in zip(groups, tensors, strict=True):
        if flat:
            sizes = [math.prod(shapes[name]) for name in names]
            group = list(group[0].reshape(-1)[:sum(sizes)].split(sizes))
        if len(group) != len(names):
            raise CheckpointError(f"{tag.model_file}: a param group holds {len(group)} {what}, this engine's "
                                  f"{len(names)} parameters ({', '.join(names[:4])}, ...): {fix}")
        for name, tensor in zip(names, group, strict=True):
            if tensor.numel() != math.prod(shapes[name]):
                raise CheckpointError(f"{tag.model_file}: the {what} matched to {name} by position has "
                                      f"{tensor.numel()} elements, the parameter {shapes[name]}: {fix}")
            out[name] = tensor.reshape(shapes[name])  # as DeepSpeed's load: the file's tensors, not copies
    return out


def _matched_by_value(tag: _Tag, copies: list[list[torch.Tensor]], flat: bool) -> dict[str, torch.Tensor]:
    """Stage 0 without an engine (`crew export`): each fp32 copy is the parameter whose 16-bit value it
    rounds to (DeepSpeed copies the masters into the module after every step)."""
    if flat:
        raise CheckpointError(f"{tag.model_file}: FP16_Optimizer keeps its fp32 weights flat, which cannot be "
                              "matched to parameter names without the model: load the checkpoint with "
                              "engine.load_checkpoint and save it again, or export the 16-bit module weights")
    module, dtype = tag.model["module"], tag.lp_dtype()
    buffers = set(tag.model.get("buffer_names") or ())
    free = [name for name, value in module.items() if name not in buffers and value.dtype == dtype]
    out = {}
    for copy in (copy for group in copies for copy in group):
        match = next((name for name in free if module[name].numel() == copy.numel()
                      and torch.equal(copy.reshape(module[name].shape).to(dtype), module[name])), None)
        if match is None:
            raise CheckpointError(f"{tag.model_file}: an fp32 copy in the optimizer matches no parameter of the "
                                  "module: load the checkpoint into the model with engine.load_checkpoint instead")
        free.remove(match)
        out[match] = copy.reshape(module[match].shape).float().clone()
    return out


def fp32_params(tag: _Tag, position_groups: list[list[str]] | None) -> dict[str, torch.Tensor]:
    """The fp32 weights of the parameters the optimizer trained, by name. `position_groups`: the names of the
    engine's optimizer groups (stage 0 matches by position); None: match stage 0's copies by value."""
    if tag.stage == 0:
        found = _stage0_copies(tag)
        if found is None:
            return {}  # fp32: the module is the weights
        copies, flat = found
        if position_groups is None:
            return _matched_by_value(tag, copies, flat)
        return {name: value.float() for name, value in
                _by_position(tag, copies, flat, position_groups, "fp32 copies").items()}
    key = "fp32_flat_groups" if tag.stage == 3 else "single_partition_of_fp32_groups"
    return _split_state(tag, [list(state[key]) for state in tag.optim()], tag.param_shapes())


def _frozen(tag: _Tag) -> dict[str, torch.Tensor]:
    """Parameters outside the optimizer that ZeRO-2/3 saved apart ("frozen_param_fragments"): whole at stage
    2, a partition a rank at stage 3."""
    shapes = tag.model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if tag.stage != 3:
        return {name: value.float() for name, value in (tag.model.get("frozen_param_fragments") or {}).items()}
    models = [tag.model] + [read(tag.folder / ZERO3_MODEL_STATES.format(rank=rank).replace(
        "mp_rank_00", f"mp_rank_{tag.mp:02d}")) for rank in range(1, tag.world_size)]
    return {name: torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in models])[:math.prod(shape)]
            .view(shape).float() for name, shape in shapes.items()}


def module_state(tag: _Tag, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's state dict with `params` (fp32 weights by name) in place of the saved 16-bit or empty
    (stage 3) parameters, frozen parameters from their fragments, a tied weight's second name (shared_params)
    from its first; floating-point values in fp32. Without a tied weight saved apart from it (a frozen one
    under exclude_frozen_parameters), a second name is left out, as zero_to_fp32 leaves it."""
    frozen = _frozen(tag)
    shared = tag.model.get("shared_params") or {}
    buffers = set(tag.model.get("buffer_names") or ())
    # A tied parameter saved under two names is one storage in the file (torch.save keeps the sharing): the
    # second name takes the first's fp32 weights (stage 0 saves no shared_params). Empty placeholders excluded.
    tied = {saved.data_ptr(): name for name, saved in tag.model["module"].items() if name in params and saved.numel()}
    out = {}
    for name, saved in tag.model["module"].items():
        twin = tied.get(saved.data_ptr()) if saved.numel() else None
        holder = shared.get(name)  # a tied weight's first name: trained (params) or frozen
        value = params.get(name, params.get(holder, params.get(twin, frozen.get(name, frozen.get(holder, saved)))))
        if value is saved and tag.stage == 3 and name not in buffers:
            if holder is not None and holder not in tag.model["module"]:
                # tied to a frozen parameter saved with exclude_frozen_parameters: DeepSpeed's module_state_dict
                # drops the first name only and writes no fragments, its zero_to_fp32 leaves the second name out
                # and its load leaves the model's weight as it is: so does crew (load_module_strict=False)
                continue
            raise CheckpointError(f"{tag.model_file}: {name} is partitioned and its partitions are in no optimizer "
                                  "file: the checkpoint is incomplete")
        out[name] = value.float() if value.is_floating_point() else value
    return out


def read_fp32_module(folder: Path, position_groups: list[list[str]] | None = None,
                     split: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """`crew export` of a DeepSpeed tag: the whole module, floating-point tensors in fp32 (the fp32 master
    weights where DeepSpeed keeps them apart). position_groups: the optimizer groups' parameter names where the
    save recorded them (crew's crew_state.pt), for stage 0's flat fp32 copies. Under AutoTP every TP rank's
    slices joined along their dims: `split` (crew's crew_state.pt) or the tag's universal_checkpoint_info."""
    from crew.runtime.checkpoint import tensor_parallel
    folder = Path(folder)
    saved = tensor_parallel.deepspeed_size(folder)
    if saved == 1:
        tag = _Tag(folder)
        return module_state(tag, fp32_params(tag, position_groups))
    split = split if split is not None else tensor_parallel.deepspeed_dims(read(_first_model_file(folder)))
    if split is None:  # model parallel but not AutoTP's
        refuse_unsupported(folder)
    tags = [_Tag(folder, mp, tensor_parallel=True) for mp in range(saved)]
    return tensor_parallel.join([module_state(tag, fp32_params(tag, position_groups)) for tag in tags], split)


# -- optimizer state -------------------------------------------------------------------------------

def _hyperparameters(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def _stage0_optimizer(tag: _Tag, groups: list[list[str]]) -> dict:
    """Stage 0: the torch optimizer's state dict inside DeepSpeed's (FP16_Optimizer's flat per group, or one
    entry a parameter), matched to this engine's parameter names by position."""
    saved = tag.model["optimizer"]
    base = saved.get("optimizer_state_dict", saved)
    flat = "fp32_groups_flat" in saved
    saved_groups = base["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"{tag.model_file}: the optimizer has {len(saved_groups)} param groups, this "
                              f"engine's {len(groups)}: build the optimizer over the same parameters, in the same "
                              "groups, as the DeepSpeed run did, or load_checkpoint(..., load_optimizer_states=False)")
    hyper = [{**_hyperparameters(group), "params": names} for group, names in zip(saved_groups, groups, strict=True)]
    entries = [base["state"].get(index) for group in saved_groups for index in group["params"]]
    if not any(entries):  # saved before the first step
        return {"state": {}, "param_groups": hyper}
    if not all(entries):
        raise CheckpointError(f"{tag.model_file}: the optimizer has state for some parameters and not others; crew "
                              "loads it whole or not at all: load_checkpoint(..., load_optimizer_states=False)")
    is_tensor = {key: isinstance(value, torch.Tensor) and value.dim() > 0 for key, value in entries[0].items()}
    state: dict[str, dict] = {}
    for key, tensor in is_tensor.items():
        per_group = [[base["state"][index][key] for index in group["params"]] for group in saved_groups]
        if tensor:
            by_name = _by_position(tag, per_group, flat, groups, f"optimizer state '{key}'")
        else:  # a scalar (Adam's step): one for the whole group
            by_name = {name: _group_scalar(key, values) for values, names in zip(per_group, groups, strict=True)
                       for name in names}
        for name, value in by_name.items():
            state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": hyper}


def _group_scalar(key: str, values: list):
    """A group's scalar state. FusedAdam 0.19.8 counts its `step` on the group's last parameter only (the
    `state` left by its loop, deepspeed/ops/adam/fused_adam.py 147-193), the others keep the step they
    started at, and steps the whole group with that count: the group's largest is its step."""
    if key == "step" and all(isinstance(value, (int, float, torch.Tensor)) for value in values):
        return _copy(max(values, key=float))
    return _copy(values[0])


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _zero_optimizer(tag: _Tag) -> dict:
    """Stages 1-3: the base optimizer's flat state, one entry a (sub-)group on each rank -> by name."""
    key = "optimizer_state_dict" if tag.stage == 3 else "base_optimizer_state"
    bases = [state[key] for state in tag.optim()]
    if not isinstance(bases[0], dict):
        raise CheckpointError(
            f"{tag.where()}: saved with zero_optimization.elastic_checkpoint, whose optimizer state has no param "
            "groups (DeepSpeed 0.19.8 cannot load it back either with torch's Adam). Load the weights only: "
            "load_checkpoint(..., load_optimizer_states=False)")
    shapes = tag.param_shapes()
    groups = [{**_hyperparameters(group), "params": [name for index in group["params"] for name in shapes[index]]}
              for group in bases[0]["param_groups"]]
    if not bases[0]["state"]:
        return {"state": {}, "param_groups": groups}
    if any(sorted(base["state"]) != list(range(len(shapes))) for base in bases):
        raise CheckpointError(f"{tag.where()}: the optimizer state covers sub-groups {sorted(bases[0]['state'])} "
                              f"of {len(shapes)}: the checkpoint is incomplete")
    state: dict[str, dict] = {}
    for key, sample in bases[0]["state"][0].items():
        if isinstance(sample, torch.Tensor) and sample.dim() > 0:
            by_name = _split_state(tag, [[base["state"][i][key] for i in range(len(shapes))] for base in bases],
                                   shapes)
        else:
            by_name = {name: _copy(bases[0]["state"][i][key]) for i, names in enumerate(shapes) for name in names}
        for name, value in by_name.items():
            state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": groups}


# -- into the live optimizer's conventions ---------------------------------------------------------
# DeepSpeed's optimizers keep their state as torch's do, but for: DeepSpeedCPUAdam/Adagrad/Lion and FusedAdam
# count `step` as a Python int (torch: a float32 scalar tensor); an older FusedAdam counted it in the param
# group only (0.19.8 still starts from it: fused_adam.py 150-153); DeepSpeedCPUAdagrad calls torch Adagrad's
# `sum` `exp_avg_sq` (deepspeed/ops/adagrad/cpu_adagrad.py 79-86); and their groups carry settings torch's
# lack (bias_correction, amsgrad, a group step).

_TENSOR_STEP = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD", "Adadelta", "RMSprop", "Rprop", "Adafactor")
    if hasattr(torch.optim, name))
# state keys a torch optimizer takes (and those it needs); other classes (a client's own) take the state as saved
_STATE_KEYS = ((torch.optim.Adagrad, {"step", "sum"}, {"sum"}),
               ((torch.optim.Adam, torch.optim.AdamW), {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
                {"exp_avg", "exp_avg_sq"}),
               (torch.optim.SGD, {"momentum_buffer"}, set()))
# a saved group setting the live optimizer lacks, harmless at this value (the group step is moved into the state)
_NEUTRAL = {"bias_correction": True, "amsgrad": False}
# live settings a saved group may lack (what only the first step reads, or a default), and those the live group
# keeps whatever was saved (how torch computes on this machine)
_LIVE_ONLY = {"maximize", "decoupled_weight_decay", "amsgrad", "bias_correction", "initial_accumulator_value",
              "lr_decay", "initial_lr"}
_HOW = {"foreach", "fused", "capturable", "differentiable"}


def _live_class(optimizer) -> type:
    """The class that holds the state: ZeroRedundancyOptimizer's (stages 1-2) is the one it was built with."""
    built = getattr(optimizer, "_optim_constructor", None)
    return built if isinstance(built, type) else type(optimizer)


def _as_live(optimizer: dict, live_groups: list[dict] | None, cls: type, path: Path) -> dict:
    """The optimizer state by name (from _stage0_optimizer or _zero_optimizer) in the conventions of `cls`, with
    the param groups of this engine's (`live_groups`, by name) in their order, matched by the parameters they
    hold; an empty live group takes nothing. A CheckpointError naming `path` where the state does not fit."""
    fix = ("build the optimizer the DeepSpeed run had (its config's \"optimizer\" section, or the same client "
           "optimizer), or load the weights only: load_checkpoint(..., load_optimizer_states=False)")
    saved_groups = optimizer["param_groups"]
    state = {name: dict(entry) for name, entry in optimizer["state"].items()}
    for group in saved_groups:  # the group's step (an older FusedAdam's): into each parameter's state
        for name in group["params"]:
            if "step" in group and name in state and "step" not in state[name]:
                state[name]["step"] = group["step"]
    for name, entry in state.items():
        _state_as_live(entry, cls, path, name, fix)
    if live_groups is None:
        return {"state": state, "param_groups": saved_groups}
    groups = []
    for index, live in enumerate(live_groups):
        if not live["params"]:
            groups.append({**live, "params": []})
            continue
        match = [group for group in saved_groups if set(group["params"]) & set(live["params"])]
        if len(match) != 1 or set(match[0]["params"]) != set(live["params"]):
            raise CheckpointError(
                f"{path}: this engine's param group {index} holds {live['params'][:4]}..., which no saved param "
                f"group holds alone (the saved groups: {[group['params'][:4] for group in saved_groups]}): {fix}")
        groups.append(_group_as_live(match[0], live, cls, path, index, fix))
    return {"state": state, "param_groups": groups}


def _state_as_live(entry: dict, cls: type, path: Path, name: str, fix: str) -> None:
    if issubclass(cls, torch.optim.Adagrad) and set(entry) in ({"exp_avg_sq"}, {"exp_avg_sq", "step"}):
        entry["sum"] = entry.pop("exp_avg_sq")  # DeepSpeedCPUAdagrad's name for it
    for classes, allowed, needed in _STATE_KEYS:
        if issubclass(cls, classes) and (set(entry) - allowed or needed - set(entry)):
            raise CheckpointError(
                f"{path}: the saved optimizer state of {name} holds {sorted(entry)}, which this engine's "
                f"{cls.__name__} cannot take (it keeps {sorted(allowed)}): saved by another optimizer; {fix}")
    step = entry.get("step")
    if issubclass(cls, _TENSOR_STEP) and step is not None and not isinstance(step, torch.Tensor):
        entry["step"] = torch.tensor(float(step), dtype=torch.float32)


def _group_as_live(saved: dict, live: dict, cls: type, path: Path, index: int, fix: str) -> dict:
    """The saved group's settings under the live group's keys, in the live group's parameter order."""
    for key, value in saved.items():
        if key not in live and key not in ("params", "step") and (key not in _NEUTRAL or value != _NEUTRAL[key]):
            raise CheckpointError(f"{path}: the saved param group of this engine's group {index} has "
                                  f"{key}={value!r}, which this engine's {cls.__name__} has no setting for: {fix}")
    lacking = sorted(key for key in live if key not in saved and key not in _LIVE_ONLY | _HOW | {"params"})
    if lacking:
        raise CheckpointError(f"{path}: the saved param group of this engine's group {index} has no "
                              f"{', '.join(lacking)}, which this "
                              f"engine's {cls.__name__} needs: saved by another optimizer; {fix}")
    return {**live, **{key: value for key, value in saved.items() if key in live and key not in _HOW},
            "params": list(live["params"])}


# -- what loading.py loads ---------------------------------------------------------------------------

def _loss_scaler(tag: _Tag) -> dict | None:
    """fp16's loss scale as crew's scaler state (None under bf16/fp32, which have none)."""
    if tag.lp_dtype() != torch.float16:
        return None
    if tag.stage == 0:
        saved = tag.model.get("optimizer") or {}
        dynamic = bool(saved.get("dynamic_loss_scale"))
        state = {"dynamic": dynamic, "cur_scale": saved.get("cur_scale", 1.0)}
        if dynamic:
            state.update(cur_iter=saved.get("cur_iter", 0), last_overflow_iter=saved.get("last_overflow_iter", -1))
        return state
    scaler = vars(tag.optim()[0].get("loss_scaler") or object())
    state = {key: scaler[key] for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
             if key in scaler}
    return {"dynamic": bool(scaler.get("dynamic")), "cur_iter": 0, "last_overflow_iter": -1, **state}


def client_state(model: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool, module_only: bool,
                 stage0_optimizer: bool) -> dict:
    """What DeepSpeed's load_checkpoint returns as client_state: the model states dict without what the engine
    took from it (so DeepSpeed's own keys such as ds_config and global_samples stay in it), and at stage 0,
    where the optimizer state lives in that file, the optimizer's state dict under 'optimizer'."""
    taken = ["module"] if module_only else list(_ENGINE_KEYS)
    taken += ["lr_scheduler"] if load_lr_scheduler_states else []
    taken += ["optimizer"] if load_optimizer_states else []
    client = {key: value for key, value in model.items() if key not in taken}
    if stage0_optimizer and load_optimizer_states and not module_only:
        client["optimizer"] = model.get("optimizer")
    return client


def _first_model_file(folder: Path) -> Path:
    """TP rank 0's model states: mp_rank_00_model_states.pt, or at stage 3 its data-parallel rank 0's."""
    plain = folder / MODEL_STATES
    return plain if plain.is_file() else folder / ZERO3_MODEL_STATES.format(rank=0)


def read_for_load(engine, folder: Path, states: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                  module_only: bool) -> None:
    """Fill `states` as loading.py's readers do for crew's own checkpoints."""
    from crew.runtime.checkpoint import tensor_parallel
    from crew.runtime.checkpoint.state import groups_by_name
    folder = Path(folder)
    optimizer = load_optimizer_states and not module_only and engine.optimizer is not None
    named = groups_by_name(engine)
    positions = [group["params"] for group in named] if named is not None else None

    def states_of(tag: _Tag):
        if optimizer and positions is None and tag.stage == 0:
            raise CheckpointError(f"{tag.model_file}: DeepSpeed's stage 0 optimizer state is matched to this "
                                  "engine's parameters by position, and its optimizer steps tensors that are not "
                                  "parameters of the model. Load the weights only: load_checkpoint(..., "
                                  "load_optimizer_states=False)")
        params: dict[str, torch.Tensor] = {}
        if optimizer or tag.stage == 3:  # otherwise, as DeepSpeed: the module's own (16-bit) weights
            params = fp32_params(tag, positions)
        if not optimizer:  # DeepSpeed puts the fp32 weights into the 16-bit module and restores its masters from it
            params = {name: value.to(tag.lp_dtype()).float() for name, value in params.items()}
        if not optimizer:
            return module_state(tag, params), None
        return module_state(tag, params), _stage0_optimizer(tag, positions) if tag.stage == 0 else _zero_optimizer(tag)

    saved_tp = tensor_parallel.deepspeed_size(folder)
    split = tensor_parallel.deepspeed_dims(read(_first_model_file(folder))) if saved_tp > 1 else None
    if saved_tp > 1 and split is None:  # model parallel but not AutoTP's (no universal_checkpoint_info)
        refuse_unsupported(folder)
    tag, module, by_name = tensor_parallel.read_tags(engine, folder, saved_tp, split, states_of, _Tag)
    saved = tag.model
    if optimizer:
        by_name = _as_live(by_name, named, _live_class(engine.optimizer), tag.optimizer_file())
    steps = int(saved.get("global_steps") or 0)
    precision = {"skipped_steps": int(saved.get("skipped_steps") or 0)}
    scaler = _loss_scaler(tag) if optimizer else None
    if scaler is not None:
        precision["loss_scaler"] = scaler
    stage = tag.stage if tag.stage is not None else _configured_stage(saved)
    states.update(
        manifest={"format": DEEPSPEED, "zero_stage": stage, "world_size": tag.world_size},
        model={"module": module, "optimizer": by_name, "lr_scheduler": saved.get("lr_scheduler"),
               "precision": precision, "global_steps": steps,
               "global_samples": int(saved.get("global_samples", steps * engine.train_batch_size())),
               "micro_steps": engine.micro_steps,  # DeepSpeed saves none: its count goes on from where it is
               "boundary_override": engine._boundary_override, "micro_batch_sizes": None,
               "world_size": tag.world_size},
        shapes={name: tuple(value.shape) for name, value in module.items()},
        client=client_state(saved, load_optimizer_states, load_lr_scheduler_states, module_only,
                            engine.optimizer is not None and engine.zero.stage == 0),
        rank=None, module_file=tag.model_file)


def _configured_stage(model: dict) -> int:
    config = model.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    return int(zero.get("stage", 1)) if isinstance(zero, dict) else 1
