"""crew's state as the files of a DeepSpeed 0.19.8 tag (deepspeed_files.py names them), with DeepSpeed's keys,
so that DeepSpeed's load_checkpoint, zero_to_fp32.py and ds_to_universal read a crew checkpoint (stages 0-2;
stage 3's per-rank content comes from deepspeed_zero3.py).

    mp_rank_00_model_states.pt    deepspeed/runtime/engine.py _save_checkpoint: the module in its training dtype,
                                  buffer_names, at stage 0 the optimizer (under bf16 FP16_UnfusedOptimizer's
                                  state_dict with the fp32 copies), at stages 1-2 param_shapes and shared_params
                                  (stage 2: the frozen parameters too), the counters, the scheduler, ds_config,
                                  ds_version, and client_state's keys
    [bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt
                                  _save_zero_checkpoint around zero/stage_1_and_2.py state_dict: rank R's
                                  partition of every param group flattened (padded to nccl_start_alignment_factor
                                  x world), the base optimizer's state over it, the loss scaler, group_paddings,
                                  partition_count, param_slice_mappings, ...

DeepSpeed pickles three of its own classes into these files (ZeroStageEnum, LossScaler/DynamicLossScaler,
fragment_address). crew writes its stand-ins (deepspeed_files.STAND_INS) under DeepSpeed's names with a pickler
of its own, so deepspeed need not be installed to write them and DeepSpeed unpickles its own classes.
"""

from __future__ import annotations

import math
import pickle
import types
from collections import OrderedDict

import torch

from crew.runtime.checkpoint import tensor_parallel
from crew.runtime.checkpoint.deepspeed_files import (
    STAND_INS,
    DynamicLossScaler,
    FragmentAddress,
    LossScaler,
    ZeroStageEnum,
)

DS_VERSION = "0.19.8"  # the DeepSpeed whose layout crew writes
ALIGNMENT_FACTOR = 2  # stage_1_and_2.py nccl_start_alignment_factor: partitions start 4-byte aligned in fp16
# _common_checkpoint_state's keys (engine.py): a client_state key of the same name would replace them
ENGINE_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
               "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
               "ds_config", "ds_version")
_NAMES = {cls: name.rsplit(".", 1) for cls, name in STAND_INS}
# the param group keys of DeepSpeed's own optimizers (ops/adam/fused_adam.py, cpu_adam.py __init__'s defaults)
_GROUP_KEYS = {"fused_adam": ("lr", "bias_correction", "betas", "eps", "weight_decay"),
               "cpu_adam": ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad")}
_GROUP_DEFAULTS = {"bias_correction": True, "amsgrad": False}


class _Pickler(pickle._Pickler):
    """pickle's Python pickler, writing crew's stand-ins as DeepSpeed's classes (the C pickler insists that the
    module it names can be imported here)."""

    def save_global(self, obj, name=None):
        if obj not in _NAMES:
            return super().save_global(obj, name)
        module, qualname = _NAMES[obj]
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


# torch.save(..., pickle_module=DEEPSPEED_PICKLE): torch subclasses its Pickler
DEEPSPEED_PICKLE = types.ModuleType("crew_deepspeed_pickle")
DEEPSPEED_PICKLE.Pickler = _Pickler


def optim_file(rank: int, bf16: bool, mp: int = 0) -> str:
    """engine.py _get_rank_zero_ckpt_name: data-parallel rank `rank` of TP rank `mp`."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"


def _attributes(cls, **values):
    obj = cls.__new__(cls)
    obj.__dict__.update(values)
    return obj


def shared_params(module: torch.nn.Module) -> dict[str, str]:
    """engine.py _get_shared_params: a tied parameter's other names -> the name it is saved under."""
    first, shared = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            shared[name] = first[id(param)]
        else:
            first[id(param)] = name
    return shared


def group_names(optimizer_state: dict, names: list[str]) -> list[list[str]]:
    """The parameter names of each param group of a torch optimizer state dict (names by its indices)."""
    return [[names[index] for index in group["params"]] for group in optimizer_state["param_groups"]]


def kept_by_deepspeed(engine, optimizer_state: dict, names: list[str]) -> dict:
    """The optimizer state as DeepSpeed's optimizer holds it: without param groups given no parameters (engine.py
    _configure_optimizer drops them) and, at ZeRO stages 1-2, only the parameters its ZeRO optimizer steps
    (trainable, with elements: utils.is_optimized_parameter). The indices stay; only names map them."""
    params = dict(engine.module.named_parameters())

    def kept(index: int) -> bool:
        param = params.get(names[index])
        return engine.zero.stage == 0 or param is None or (param.requires_grad and param.numel() > 0)

    groups = [{**group, "params": [index for index in group["params"] if kept(index)]}
              for group in optimizer_state["param_groups"]]
    groups = [group for group in groups if group["params"]]
    indices = {index for group in groups for index in group["params"]}
    return {"state": {index: entry for index, entry in optimizer_state["state"].items() if index in indices},
            "param_groups": groups}


def deepspeed_optimizer(engine) -> str | None:
    """Which optimizer DeepSpeed builds for this config where its state dict differs from torch's: "fused_adam"
    for "Adam"/"AdamW" without torch_adam, "cpu_adam" for them with offload_optimizer (engine.py
    _configure_basic_optimizer); None for torch's own and a client optimizer."""
    raw = engine.crew_config.raw
    section = raw.get("optimizer") if isinstance(raw.get("optimizer"), dict) else {}
    params = section.get("params") if isinstance(section.get("params"), dict) else {}
    if str(section.get("type", "")).lower() not in ("adam", "adamw") or params.get("torch_adam"):
        return None
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    return "cpu_adam" if offload.get("device") in ("cpu", "nvme") else "fused_adam"


def as_deepspeeds(engine, optimizer_state: dict) -> dict:
    """A torch Adam state dict as DeepSpeed's FusedAdam (ops/adam/fused_adam.py) or DeepSpeedCPUAdam
    (ops/adam/cpu_adam.py) keeps it, where the config makes DeepSpeed build one: an int `step` per parameter
    (their C++ steps take an int), their group keys (`bias_correction`, not torch's), and FusedAdam's group
    `step` (its CUDA build counts there). crew restores its own groups and steps from crew_state.pt."""
    kind = deepspeed_optimizer(engine)
    if kind is None:
        return optimizer_state
    state = {index: {key: int(value) if key == "step" else value for key, value in entry.items()}
             for index, entry in optimizer_state["state"].items()}
    groups = []
    for group in optimizer_state["param_groups"]:
        steps = [state[index]["step"] for index in group["params"] if "step" in state.get(index, {})]
        kept = {key: group.get(key, _GROUP_DEFAULTS.get(key)) for key in _GROUP_KEYS[kind]}
        extra = {"step": steps[0] if steps else 0} if kind == "fused_adam" else {}
        groups.append({**kept, **extra, "params": group["params"]})
    return {"state": state, "param_groups": groups}


def model_states(engine, fp32: dict, optimizer_state: dict | None, names: list[str] | None, exclude_frozen: bool,
                 client_state: dict) -> dict:
    """mp_rank_00_model_states.pt (stages 0-2). `fp32`: the module's fp32 state (the masters); `optimizer_state`:
    the whole torch optimizer state dict by index, `names` its parameter names (None: a model-only engine)."""
    stage = engine.zero.stage
    module = engine.module
    trained = {name for group in group_names(optimizer_state, names) for name in group} if names else set()
    frozen = [name for name, param in module.named_parameters() if name not in trained]
    state = {name: value.detach().cpu() for name, value in module.state_dict().items()}
    if exclude_frozen:
        state = {name: value for name, value in state.items()
                 if name not in {n for n, p in module.named_parameters() if not p.requires_grad}}
    zero = stage >= 1 and optimizer_state is not None
    save_frozen = stage == 2 and not exclude_frozen and optimizer_state is not None
    params = dict(module.named_parameters())
    return {
        "module": state,
        "buffer_names": [name for name, _ in _persistent_buffers(module)],
        "optimizer": _stage0_optimizer(engine, fp32, optimizer_state, names) if not zero and optimizer_state
        is not None else None,
        "param_shapes": [OrderedDict((name, params[name].shape) for name in group)
                         for group in group_names(optimizer_state, names)] if zero else None,
        "frozen_param_shapes": OrderedDict((name, params[name].shape) for name in frozen) if save_frozen else None,
        "shared_params": shared_params(module) if zero else None,
        "frozen_param_fragments": OrderedDict((name, params[name].detach().cpu()) for name in frozen)
        if save_frozen else None,
        **common_keys(engine, client_state),
    }


def common_keys(engine, client_state: dict) -> dict:
    """The model states file's keys of every stage (engine.py _common_checkpoint_state), then client_state's."""
    out = {
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": engine.precision.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        **tensor_parallel.parallel_keys(engine),
        "ds_config": engine.crew_config.raw,
        "ds_version": DS_VERSION,
    }
    out.update({key: value for key, value in client_state.items() if key not in ENGINE_KEYS})
    return out


def with_universal_info(model: dict, info: dict) -> dict:
    """The model states dict with AutoTP's universal_checkpoint_info where DeepSpeed puts it: after its own keys,
    before client_state's."""
    own = {key: value for key, value in model.items() if key in ENGINE_KEYS}
    return {**own, "universal_checkpoint_info": info,
            **{key: value for key, value in model.items() if key not in own}}


def _persistent_buffers(module: torch.nn.Module):
    """engine.py _get_buffer_names: the buffers the state dict holds."""
    for prefix, child in module.named_modules():
        for name, buffer in child.named_buffers(recurse=False):
            if buffer is not None and name not in child._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def _stage0_optimizer(engine, fp32: dict, optimizer_state: dict, names: list[str]) -> dict:
    """Stage 0: the torch optimizer's state dict (fp32); under bf16 FP16_UnfusedOptimizer's state_dict
    (fp16/unfused_optimizer.py) around it with the fp32 copies by group, or for FusedAdam FP16_Optimizer's
    (fp16/fused_optimizer.py: engine.py _configure_fp16_optimizer): one flat fp32 tensor a group, the base
    optimizer's state over it."""
    if engine.precision.dtype == torch.float32:
        return optimizer_state
    groups = group_names(optimizer_state, names)
    if deepspeed_optimizer(engine) != "fused_adam":
        return {**_loss_scale_keys(engine), "optimizer_state_dict": optimizer_state,
                "fp32_groups": [[fp32[name] for name in group] for group in groups]}
    by_name = {names[index]: value for index, value in optimizer_state["state"].items()}
    flat = {"state": {}, "param_groups": []}
    for index, (group, saved) in enumerate(zip(groups, optimizer_state["param_groups"], strict=True)):
        flat["param_groups"].append({**{k: v for k, v in saved.items() if k != "params"}, "params": [index]})
        entries = _flat_state([by_name.get(name, {}) for name in group], [fp32[name] for name in group], 1,
                              alignment=1)
        if entries:
            flat["state"][index] = {key: value[0] if isinstance(value, list) else value
                                    for key, value in entries.items()}
    scale = _loss_scale_keys(engine) if engine.precision.dtype == torch.float16 else {}  # use_grad_scaling
    return {**scale, "optimizer_state_dict": flat,
            "fp32_groups_flat": [_partitions([fp32[name] for name in group], 1, alignment=1)[0][0]
                                 for group in groups],
            "clip_grad": float(engine.gradient_clipping())}


def _loss_scale_keys(engine) -> dict:
    """The loss scale as FP16_Optimizer's and FP16_UnfusedOptimizer's state_dict keep it (fp16/*.py): dynamic, the
    scale, the iteration, and a dynamic scale's overflow iteration, factor and window; bf16: a static 1."""
    scaler = getattr(engine.precision, "scaler", None)
    if engine.precision.dtype != torch.float16 or scaler is None:
        return {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": engine.global_steps}
    keys = {"dynamic_loss_scale": bool(getattr(scaler, "dynamic", False)), "cur_scale": float(scaler.cur_scale),
            "cur_iter": int(getattr(scaler, "cur_iter", engine.global_steps))}
    if keys["dynamic_loss_scale"]:
        keys.update(last_overflow_iter=scaler.last_overflow_iter, scale_factor=scaler.scale_factor,
                    scale_window=scaler.scale_window)
    return keys


def _partitions(tensors: list[torch.Tensor], world: int,
                alignment: int | None = None) -> tuple[list[torch.Tensor], int]:
    """A group's tensors flattened, padded to a multiple of ALIGNMENT_FACTOR x world and cut into `world`
    equal partitions (stage_1_and_2.py flatten_dense_tensors_aligned, get_data_parallel_partitions); and the
    padding, which the last rank holds."""
    flat = torch.cat([tensor.detach().reshape(-1).float().cpu() for tensor in tensors])
    alignment = alignment or ALIGNMENT_FACTOR * world
    padding = math.ceil(flat.numel() / alignment) * alignment - flat.numel()
    flat = torch.nn.functional.pad(flat, (0, padding))
    return [piece.clone() for piece in flat.split(flat.numel() // world)], padding


def _slice_mappings(shapes: list[torch.Size], group: list[str], rank: int, size: int) -> OrderedDict:
    """stage_1_and_2.py _create_param_mapping: where each parameter with elements in rank's partition lies."""
    mapping, offset = OrderedDict(), 0
    low, high = rank * size, (rank + 1) * size
    for name, shape in zip(group, shapes, strict=True):
        start, end = offset, offset + math.prod(shape)
        if start < high and end > low:
            mapping[name] = _attributes(FragmentAddress, numel=min(end, high) - max(start, low),
                                        start=max(start, low) - low)
        offset = end
    return mapping


def _loss_scaler(engine):
    scaler = getattr(engine.precision, "scaler", None)
    if scaler is None or not getattr(scaler, "dynamic", False):
        return _attributes(LossScaler, cur_scale=float(getattr(scaler, "cur_scale", 1.0)), dynamic=False)
    return _attributes(DynamicLossScaler, cur_scale=scaler.cur_scale, cur_iter=scaler.cur_iter,
                       last_overflow_iter=scaler.last_overflow_iter, scale_factor=scaler.scale_factor,
                       scale_window=scaler.scale_window, min_scale=scaler.min_scale,
                       delayed_shift=scaler.delayed_shift, cur_hysteresis=scaler.cur_hysteresis,
                       consecutive_hysteresis=scaler.consecutive_hysteresis, raise_error_at_min_scale=True,
                       dynamic=True, dtype=torch.float16)


def optim_states(engine, fp32: dict, optimizer_state: dict, names: list[str]) -> list[dict]:
    """Every rank's [bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt content (stages 1-2), in rank order:
    DeepSpeedZeroOptimizer.state_dict as that rank's optimizer returns it, in _save_zero_checkpoint's dict."""
    world = tensor_parallel.parallel_keys(engine)["dp_world_size"]
    groups = group_names(optimizer_state, names)
    state_by_name = {names[index]: value for index, value in optimizer_state["state"].items()}
    per_rank = [{"state": {}, "param_groups": []} for _ in range(world)]
    fp32_parts, paddings, mappings = [[] for _ in range(world)], [], [[] for _ in range(world)]
    for index, (group, saved) in enumerate(zip(groups, optimizer_state["param_groups"], strict=True)):
        pieces, padding = _partitions([fp32[name] for name in group], world)
        paddings.append(padding)
        hyper = {key: value for key, value in saved.items() if key != "params"}
        entries = _flat_state([state_by_name.get(name, {}) for name in group], [fp32[name] for name in group],
                              world)
        for rank in range(world):
            lean = pieces[rank].numel() - (padding if rank == world - 1 else 0)
            fp32_parts[rank].append(pieces[rank][:max(lean, 0)].clone())
            per_rank[rank]["param_groups"].append({**hyper, "params": [index]})
            if entries:
                per_rank[rank]["state"][index] = {key: value[rank] if isinstance(value, list) else _copy(value)
                                                  for key, value in entries.items()}
            mappings[rank].append(_slice_mappings([fp32[name].shape for name in group], group, rank,
                                                  pieces[0].numel()))
    stage = ZeroStageEnum(engine.zero.stage)
    files = []
    for rank in range(world):
        state_dict = {
            "loss_scaler": _loss_scaler(engine),
            "dynamic_loss_scale": engine.precision.dtype == torch.float16 and _loss_scaler(engine).dynamic,
            "overflow": False,
            "clip_grad": float(engine.gradient_clipping()),
            "base_optimizer_state": per_rank[rank],
            "single_partition_of_fp32_groups": fp32_parts[rank],
            "zero_stage": stage,
            "group_paddings": [padding if rank == world - 1 else 0 for padding in paddings],
            "param_alignment_paddings": [[0] * len(group) for group in groups],
            "partition_count": [world] * len(groups),
            "ds_version": DS_VERSION,
            "param_slice_mappings": mappings[rank],
        }
        files.append({"optimizer_state_dict": state_dict, "ds_config": engine.crew_config.raw,
                      "ds_version": DS_VERSION})
    return files


def _flat_state(states: list[dict], params: list[torch.Tensor], world: int, alignment: int | None = None) -> dict:
    """A group's per-parameter optimizer states as the base optimizer's state over the group's flat partition:
    each per-element tensor (exp_avg, ...) as the ranks' partitions, a scalar (step) as the first parameter's."""
    sample = next((state for state in states if state), None)
    if sample is None:
        return {}
    out = {}
    for key, value in sample.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            tensors = [state[key] if key in state else torch.zeros_like(param, dtype=value.dtype)
                       for state, param in zip(states, params, strict=True)]
            out[key] = _partitions(tensors, world, alignment)[0]
        else:
            out[key] = value
    return out


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
