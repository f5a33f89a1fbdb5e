"""ZeRO stage 3 as DeepSpeed 0.19.8 saves it: this rank's part of zero_pp_rank_<R>_mp_rank_00_model_states.pt
and its whole [bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt (saving.py names and writes the files). Under
AutoTP, as DeepSpeed: R is the data-parallel rank, mp_rank_<t> the TP rank, and the partitions are of t's slices
over the data-parallel group.

DeepSpeed's stage 3 (deepspeed/runtime/zero/stage3.py) splits each of the optimizer's param groups into sub
groups of about `zero_optimization.sub_group_size` elements, flattens every parameter, pads it to a multiple of
the world size and gives rank r the r-th 1/world of it. A rank's fp32_flat_groups[s] is its slice of each
parameter of sub group s, one after the other; the base optimizer steps that flat tensor, so its state is keyed
by sub-group index, each entry flat in the same layout (plus Adam's scalar `step`).

crew's stage 3 is FSDP2: each parameter a DTensor sharded by rows (Shard(0)). Where the rows divide evenly over
the ranks, a rank's rows are exactly its DeepSpeed slice and are taken as they are. Elsewhere (uneven rows, HSDP's
2-D mesh) the pieces are not DeepSpeed's slices: such a parameter or optimizer state tensor is gathered whole, one
at a time (DTensor.full_tensor(), a collective that every rank calls in the same order, the choice made from
shapes alike everywhere), and this rank's slice is cut from it: no rank holds more than one parameter whole.
Under bf16/fp16 the sharded fp32 parameters are the master weights; the module's placeholders and frozen
fragments are in the 16-bit dtype, as DeepSpeed's.
"""

from __future__ import annotations

import collections
import copy
import math

import torch

from crew.runtime.checkpoint.deepspeed_files import DynamicLossScaler, LossScaler, ZeroStageEnum
from crew.runtime.checkpoint.layout import CheckpointError

DS_VERSION = "0.19.8"  # the DeepSpeed whose layout this is, as its files record it
_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeedZeroConfig.sub_group_size's default
_GROUP_KEYS = {  # the defaults of deepspeed/ops/adam/fused_adam.py's, cpu_adam.py's, adagrad/cpu_adagrad.py's __init__
    "FusedAdam": ("lr", "bias_correction", "betas", "eps", "weight_decay"),
    "DeepSpeedCPUAdam": ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad"),
    "DeepSpeedCPUAdagrad": ("lr", "eps", "weight_decay", "amsgrad"),
}
_STATE_KEYS = {"DeepSpeedCPUAdagrad": {"sum": "exp_avg_sq"}}  # torch's name -> the DeepSpeed optimizer's


def zero3_model_states(engine, exclude_frozen: bool) -> dict:
    """This rank's stage-3 keys of zero_pp_rank_<R>_mp_rank_00_model_states.pt as DeepSpeed 0.19.8 writes them:
    module (parameters as DeepSpeed's empty placeholders, buffers whole), buffer_names, param_shapes,
    frozen_param_shapes, frozen_param_fragments (this rank's partition), shared_params. The caller adds the
    keys common to every stage. A collective (the frozen parameters are gathered one at a time)."""
    module, optimizer = engine.module, engine.optimizer
    names = _param_names(module)
    frozen = [(name, param) for param, name in names.items() if not _optimized(param)]
    if exclude_frozen:
        frozen_shapes = frozen_fragments = None
    else:
        frozen_shapes = collections.OrderedDict((name, param.shape) for name, param in frozen)
        frozen_fragments = collections.OrderedDict(
            (name, _slice(param, engine).to(_lp_dtype(engine, param))) for name, param in frozen)
    return {
        "module": _module_placeholders(engine, exclude_frozen),
        "buffer_names": _buffer_names(module),
        "param_shapes": None if optimizer is None else [
            collections.OrderedDict((name, param.shape) for name, param in sub_group)
            for _, sub_group in _sub_groups(engine, names)],
        "frozen_param_shapes": frozen_shapes,
        # as DeepSpeed's: None without an optimizer, worked out on rank 0 only
        "shared_params": None if optimizer is None else _shared_params(module) if engine.global_rank == 0 else {},
        "frozen_param_fragments": frozen_fragments,
    }


def zero3_optim_states(engine) -> dict:
    """This rank's whole [bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt as DeepSpeed 0.19.8 writes it
    (engine._save_zero_checkpoint around stage3.py's _rigid_state_dict). A collective."""
    optimizer = engine.optimizer
    if optimizer is None:
        raise CheckpointError("a ZeRO-3 engine without an optimizer has no optimizer state to write (DeepSpeed's "
                              "save_checkpoint fails there too): save the model with save_16bit_model instead")
    sub_groups = _sub_groups(engine, _param_names(engine.module))
    flat_weights = [_flat([engine.precision.master_of(param) for _, param in sub_group], engine)
                    for _, sub_group in sub_groups]
    built = _deepspeeds_optimizer(engine)
    state = {}
    for index, (_, sub_group) in enumerate(sub_groups):
        entry = _flat_state(engine, [param for _, param in sub_group], built)
        if entry:
            state[index] = entry
    groups = []
    for number, group in enumerate(_deepspeeds_groups(optimizer)):
        indices = [index for index, (owner, _) in enumerate(sub_groups) if owner == number]
        stepped = any(index in state for index in indices)
        groups.append({**_hyperparameters(optimizer, group, built, stepped), "params": indices})
    scaler = _loss_scaler(engine)
    return {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": scaler,
            "dynamic_loss_scale": scaler.dynamic,
            "overflow": bool(getattr(optimizer, "overflow", False)),
            "partition_count": _world(engine),
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": flat_weights,
        },
        "ds_config": copy.deepcopy(engine.crew_config.raw),
        "ds_version": DS_VERSION,
    }


# -- which parameters, in which sub group -------------------------------------------------------------

def _param_names(module: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """Each parameter's first name (a tied weight under the name it has first), as DeepSpeed's param_names."""
    return {param: name for name, param in module.named_parameters()}


def _optimized(param: torch.Tensor) -> bool:
    """deepspeed.runtime.utils.is_optimized_parameter: trainable, with at least one element."""
    return param.requires_grad and param.numel() > 0


def _deepspeeds_groups(optimizer) -> list[dict]:
    """The param groups DeepSpeed's optimizer keeps: it drops those given no parameters at all (engine.py
    _configure_optimizer), a LoRA fine-tune's empty no-decay group, say."""
    return [group for group in optimizer.param_groups if len(group["params"]) != 0]


def _sub_groups(engine, names: dict) -> list[tuple[int, list[tuple[str, torch.nn.Parameter]]]]:
    """(param group index, [(name, parameter)]) for each of DeepSpeed's sub groups, in its order
    (stage3.py _get_trainable_parameter_groups, _create_fp16_sub_groups)."""
    limit = int(float((engine.crew_config.raw.get("zero_optimization") or {}).get("sub_group_size",
                                                                                   _SUB_GROUP_SIZE)))
    out = []
    for number, group in enumerate(_deepspeeds_groups(engine.optimizer)):
        params = [param for param in group["params"] if _optimized(param)]
        unnamed = [tuple(param.shape) for param in params if param not in names]
        if unnamed:
            raise CheckpointError(f"the optimizer steps a tensor of shape {unnamed[0]} that is not a parameter of "
                                  "the model: DeepSpeed's ZeRO-3 checkpoint names every tensor it saves by its "
                                  "parameter name. Build the optimizer over model.parameters().")
        sizes = [_part(param.numel(), _world(engine)) for param in params]
        current, filled = [], 0
        for param, size in zip(params, sizes, strict=True):
            current.append((names[param], param))
            filled += size
            if (limit < sum(sizes) and filled >= limit) or param is params[-1]:
                out.append((number, current))
                current, filled = [], 0
    return out


# -- this rank's slices ----------------------------------------------------------------------------

def _world(engine) -> int:
    """The ranks stage 3 partitions over: the world, or under AutoTP the data-parallel group (each TP rank's files
    are its slices partitioned over that group, as DeepSpeed's)."""
    return engine.zero.world_size


def _rank(engine) -> int:
    group = engine.zero.group
    return engine.global_rank if group is None else torch.distributed.get_rank(group)


def _ranks(engine) -> list[int]:
    group = engine.zero.group
    return list(range(engine.world_size)) if group is None else torch.distributed.get_process_group_ranks(group)


def _part(numel: int, world: int) -> int:
    """A rank's share of a parameter padded to a multiple of the world size (DeepSpeed's partition_numel)."""
    return math.ceil(numel / world)


def _whole(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    if not isinstance(value, DTensor):
        return value.detach()
    local = value.to_local()
    if local.device.type != value.device_mesh.device_type:  # CPU offload: the shard is in host memory
        value = DTensor.from_local(local.to(value.device_mesh.device_type), value.device_mesh, value.placements,
                                   shape=value.shape, stride=value.stride())
    return value.full_tensor().detach()


def _slice(tensor: torch.Tensor, engine, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's DeepSpeed slice of `tensor` (see _partition), from its own shard where that is the slice, else
    gathered whole (a collective)."""
    shard = _even_shard(tensor, _ranks(engine))
    if shard is None:
        return _partition(_whole(tensor), engine, out)
    if out is None:
        out = torch.empty(shard.numel(), dtype=shard.dtype)
    return out.copy_(shard.reshape(-1))


def _even_shard(value: torch.Tensor, ranks: list[int]) -> torch.Tensor | None:
    """FSDP2's local rows when they are this rank's DeepSpeed slice: sharded by rows over `ranks` in order, the
    rows dividing evenly (then every slice is rows/world whole rows, with no padding); else None."""
    from torch.distributed.tensor import DTensor, Shard
    if (isinstance(value, DTensor) and tuple(value.placements) == (Shard(0),) and value.dim() > 0
            and value.shape[0] % len(ranks) == 0 and value.device_mesh.mesh.flatten().tolist() == ranks):
        return value.to_local().detach()
    return None


def _partition(whole: torch.Tensor, engine, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's slice of `whole` flattened and padded (with zeros) to a multiple of the world size, on the
    CPU; written into `out` when given."""
    flat = whole.reshape(-1)
    part = _part(flat.numel(), _world(engine))
    if out is None:
        out = torch.zeros(part, dtype=whole.dtype)
    start = min(_rank(engine) * part, flat.numel())
    piece = flat[start:start + part]
    out[:piece.numel()].copy_(piece)
    return out


def _flat(tensors: list[torch.Tensor], engine, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's slices of `tensors`, one after the other, in one flat CPU tensor; each gathered in turn where
    it must be."""
    parts = [_part(tensor.numel(), _world(engine)) for tensor in tensors]
    flat = torch.zeros(sum(parts), dtype=dtype or tensors[0].dtype)
    offset = 0
    for tensor, part in zip(tensors, parts, strict=True):
        _slice(tensor, engine, flat[offset:offset + part])
        offset += part
    return flat


def _flat_state(engine, params: list[torch.nn.Parameter], built: str | None) -> dict:
    """One sub group's optimizer state as DeepSpeed's base optimizer holds it for the flat tensor: each of the
    parameters' state tensors flat in fp32_flat_groups' layout, a scalar (Adam's step) once; under the names
    and types of DeepSpeed's own optimizer where it runs one (`built`)."""
    entries = [engine.optimizer.state.get(param, {}) for param in params]
    keys = list(dict.fromkeys(key for entry in entries for key in entry))
    out = {}
    for key in keys:
        values = [entry.get(key) for entry in entries]
        sample = next(value for value in values if value is not None)
        name = _STATE_KEYS.get(built, {}).get(key, key)
        if isinstance(sample, torch.Tensor) and sample.dim() > 0:
            out[name] = _flat([_state_tensor(value, param, key) for value, param in zip(values, params, strict=True)],
                             engine, sample.dtype)
        elif key == "step" and built is not None:  # DeepSpeed's C++ optimizers count steps in a Python int
            out[name] = int(sample.item() if isinstance(sample, torch.Tensor) else sample)
        else:
            out[name] = sample.detach().clone().cpu() if isinstance(sample, torch.Tensor) else copy.deepcopy(sample)
    return out


def _state_tensor(value: torch.Tensor | None, param: torch.nn.Parameter, key: str) -> torch.Tensor:
    if value is None:  # no state for this parameter yet (it has had no gradient): DeepSpeed's zeros
        return torch.zeros(param.shape)
    if value.shape != param.shape:
        raise CheckpointError(
            f"the optimizer's state '{key}' has shape {tuple(value.shape)} for a parameter of shape "
            f"{tuple(param.shape)}: DeepSpeed's ZeRO-3 checkpoint holds optimizer state flat, element by element "
            "with the weights, which this optimizer's state is not (a factored optimizer such as Adafactor). Save "
            "at ZeRO stage 0-2, or use an element-wise optimizer (Adam, AdamW, SGD, Adagrad).")
    return value


# -- the module ------------------------------------------------------------------------------------

def _lp_dtype(engine, param: torch.Tensor) -> torch.dtype:
    """The dtype DeepSpeed keeps a parameter in: the 16-bit one under bf16/fp16."""
    dtype = engine.precision.sharded_compute_dtype
    return dtype if dtype is not None and param.is_floating_point() else param.dtype


def _module_placeholders(engine, exclude_frozen: bool) -> collections.OrderedDict:
    """module.state_dict() as DeepSpeed's stage 3 gives it: each parameter an empty tensor, buffers whole
    (engine.module_state_dict: without the frozen parameters when asked)."""
    module = engine.module
    params = dict(module.named_parameters(remove_duplicate=False))
    out = collections.OrderedDict()
    for key, value in module.state_dict().items():
        if key in params:
            out[key] = torch.empty(0, dtype=_lp_dtype(engine, params[key]))
        else:
            out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    if exclude_frozen:
        for name, param in module.named_parameters():
            if not param.requires_grad:
                out.pop(name, None)
    return out


def _buffer_names(module: torch.nn.Module, prefix: str = "") -> list[str]:
    """The persistent buffers' names, module by module (engine._get_buffer_names)."""
    names = [prefix + name for name, buffer in module.named_buffers(recurse=False)
             if buffer is not None and name not in module._non_persistent_buffers_set]
    for name, child in module.named_children():
        names += _buffer_names(child, prefix + name + ".")
    return names


def _shared_params(module: torch.nn.Module) -> dict[str, str]:
    """{name not stored: name of the parameter holding it} for tied weights (engine._get_shared_params)."""
    first: dict[int, str] = {}
    shared = {}

    def visit(owner: torch.nn.Module, prefix: str) -> None:
        for name, param in owner.named_parameters(recurse=False):
            key = getattr(param, "ds_id", id(param))
            if key in first:
                shared[prefix + name] = first[key]
            else:
                first[key] = prefix + name
        for name, child in owner.named_children():
            visit(child, prefix + name + ".")

    visit(module, "")
    return shared


# -- the optimizer's surroundings ----------------------------------------------------------------------

def _deepspeeds_optimizer(engine) -> str | None:
    """The optimizer of DeepSpeed's own that it builds for the config where crew runs torch's (engine.py
    _configure_basic_optimizer, get_optimizer_configuration): for "Adam"/"AdamW" without torch_adam FusedAdam (its
    CPU build on a CPU), or with offload_optimizer DeepSpeedCPUAdam; for "Adagrad" with offload_optimizer
    DeepSpeedCPUAdagrad. None where it runs torch's, or the script's own optimizer."""
    if getattr(engine, "_client_optimizer_name", None) is not None:
        return None
    raw = engine.crew_config.raw
    section = raw.get("optimizer") if isinstance(raw.get("optimizer"), dict) else {}
    name = str(section.get("type", "")).lower()
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    offload = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if name in ("adam", "adamw") and not (section.get("params") or {}).get("torch_adam", False):
        return "DeepSpeedCPUAdam" if offload else "FusedAdam"
    return "DeepSpeedCPUAdagrad" if name == "adagrad" and offload else None


def _hyperparameters(optimizer, group: dict, built: str | None, stepped: bool) -> dict:
    """A param group's values as the optimizer DeepSpeed runs has them: crew's own where that is crew's (torch's
    keys), else that optimizer's keys (FusedAdam's group gains "step" at its first step) and the script's."""
    values = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
    if built is None:
        return values
    # torch's Adam has no bias_correction (it always corrects), its Adagrad no amsgrad
    known = {"bias_correction": True, "amsgrad": False, **values}
    out = {key: known[key] for key in _GROUP_KEYS[built]}
    out.update((key, value) for key, value in values.items() if key not in optimizer.defaults and key not in out)
    if built == "FusedAdam" and stepped:
        out["step"] = 0
    return out


def _loss_scaler(engine):
    """DeepSpeed's loss scaler object (stand-ins that saving pickles under DeepSpeed's class names): fp16's
    scale, and LossScaler(1.0) under bf16/fp32 as DeepSpeed's CreateLossScaler makes it."""
    crew = getattr(engine.precision, "scaler", None)
    if crew is None or not crew.dynamic:
        scaler = LossScaler()
        scaler.__dict__.update(cur_scale=float(crew.cur_scale) if crew is not None else 1.0, dynamic=False)
        return scaler
    scaler = DynamicLossScaler()
    scaler.__dict__.update(
        cur_scale=crew.cur_scale, dynamic=True, cur_iter=crew.cur_iter, last_overflow_iter=crew.last_overflow_iter,
        scale_factor=crew.scale_factor, scale_window=crew.scale_window, min_scale=crew.min_scale,
        delayed_shift=crew.delayed_shift, cur_hysteresis=crew.cur_hysteresis,
        consecutive_hysteresis=crew.consecutive_hysteresis,
        raise_error_at_min_scale=True, dtype=torch.float16)  # DeepSpeed's config cannot change it
    return scaler
