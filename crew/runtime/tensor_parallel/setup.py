"""AutoTP at initialize (DeepSpeed 0.19.8's engine._configure_tensor_parallel and tp_model_init).

    record(...)            deepspeed.tp_model_init: record-only; the split happens in initialize
    merged_config(raw)     the config with what tp_model_init recorded filled in (a copy; conflicts refused)
    apply(model, section)  check, make the model whole-equal within each TP group, split it, and arm the
                           first-batch check that the TP group got identical inputs
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from crew.errors import ConfigError
from crew.log import log_rank0
from crew.runtime import parallel
from crew.runtime.tensor_parallel import autotp
from crew.runtime.tensor_parallel.config import SECTION, TPTrainingConfig, parse, to_dtype

_recorded: dict | None = None
DATA_MISMATCH = ("Data inconsistency within the TP group. Please check the Dataloader implementation to ensure "
                 "consistency.")


def record(model: torch.nn.Module, tp_size: int, dtype: Any, tp_group=None) -> torch.nn.Module:
    """deepspeed.tp_model_init's bookkeeping: the same arguments on every call, or an error."""
    global _recorded
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_model_init(tp_size={tp_size!r}): expected a whole number >= 1.")
    if tp_group is not None:
        raise ConfigError("tp_model_init(tp_group=...): crew builds the TP groups itself (contiguous ranks, as "
                          "DeepSpeed's default); drop tp_group.")
    new = {"tp_size": tp_size, "dtype": to_dtype(dtype, "tp_model_init(dtype=...)")}
    if _recorded is not None and _recorded != new:
        raise ConfigError(f"tp_model_init called twice with different arguments: {_recorded} then {new}.")
    _recorded = new
    return model


def reset() -> None:
    global _recorded
    _recorded = None


def merged_config(raw: Any) -> Any:
    """`raw` with tp_model_init's tp_size filled into tensor_parallel.autotp_size (a copy: the caller's dict is
    left as it is). The config wins where both say something, and must agree with tp_model_init."""
    if _recorded is None or not isinstance(raw, dict):
        return raw
    size, dtype = _recorded["tp_size"], _recorded["dtype"]
    work = copy.copy(raw)
    section = dict(work.get(SECTION) or {})
    given = section.get("autotp_size")
    if given is not None and given != size:
        raise ConfigError(f"Conflicting {SECTION}.autotp_size in config ({given}) and tp_model_init ({size}); "
                          "set them equal or drop one.")
    section.setdefault("autotp_size", size)
    precision = _config_dtype(work)
    if precision is not None and precision != dtype:
        raise ConfigError(f"Conflicting dtype: config uses {precision} but tp_model_init requested {dtype}; make "
                          "the bf16 / fp16 section and tp_model_init(dtype=...) agree.")
    if section.get("dtype") is not None and to_dtype(section["dtype"], f"{SECTION}.dtype") != dtype:
        raise ConfigError(f"Conflicting {SECTION}.dtype in config ({section['dtype']}) and tp_model_init ({dtype}).")
    work[SECTION] = section
    return work


def _config_dtype(raw: dict) -> torch.dtype | None:
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if isinstance(raw.get(key), dict) and raw[key].get("enabled", False) is True:
            return dtype
    return None


def section_of(raw: Any, source: str) -> TPTrainingConfig:
    return parse(raw.get(SECTION) if isinstance(raw, dict) else None, source)


def apply(model: torch.nn.Module, section: TPTrainingConfig) -> dict[int, torch.nn.Parameter]:
    """Split `model` over the TP groups; {id(whole param): slice}. A no-op below autotp_size 2 or when the
    model was split already (an earlier engine's)."""
    size = section.autotp_size
    if size <= 1:
        return {}
    parallel.init_tensor_parallel(size)  # at stage 3 its data-parallel mesh is FSDP2's (crew/runtime/zero)
    if getattr(model, "ds_autotp_parsed", False):  # split by an earlier engine (Lightning's fit, then test)
        return {}
    _whole_weights(model)
    autotp.check_model(model, size, section)
    group = parallel.tensor_parallel_group()
    _broadcast_whole(model, group)
    replaced = autotp.replace(model, group, size, section)
    _arm_input_check(model, group)
    return replaced


def _whole_weights(model: torch.nn.Module) -> None:
    """AutoTP cuts its slices from the whole weights, so they must be there: not on the meta device (refused), and a
    model built under zero.Init is gathered whole first (DeepSpeed's AutoTP takes one too); stage 3 then shards the
    slices again."""
    from crew.runtime.zero import Zero, gather_init_built
    Zero.refuse_meta(model)
    gather_init_built(model, f"{SECTION}.autotp_size cuts its slices from the whole weights")


def _broadcast_whole(model: torch.nn.Module, group) -> None:
    """The TP group's first rank's whole weights to the others, before each cuts its slice from them: slices cut
    from different initialisations would not make one model."""
    source, wire = dist.get_global_rank(group, 0), _wire_device(group)
    with torch.no_grad():
        for tensor in list(dict.fromkeys(model.parameters())) + list(model.buffers()):
            sent = tensor.data.to(wire)  # NCCL sends GPU tensors only; the model may still be on the CPU
            dist.broadcast(sent, source, group=group)
            if sent is not tensor.data:
                tensor.data.copy_(sent)


def _arm_input_check(model: torch.nn.Module, group) -> None:
    """DeepSpeed's first-batch check: every rank of a TP group must be given the same inputs (the TP ranks
    compute one sample together). Runs on the first forward, then removes itself."""
    handle = None

    def check(module, args, kwargs):
        same = _same_across(args, group) and _same_across(kwargs, group)
        handle.remove()
        if not same:
            raise ConfigError(f"{DATA_MISMATCH} Under {SECTION}.autotp_size the ranks of one TP group (ranks "
                              f"{dist.get_process_group_ranks(group)}) must get the same batch: shard the data by "
                              "data-parallel rank (deepspeed.utils.groups.get_data_parallel_rank()), or pass "
                              "initialize(training_data=...) and use the loader it returns.")
        log_rank0("The Dataloader has passed the TP group consistency check.")

    handle = model.register_forward_pre_hook(check, prepend=True, with_kwargs=True)


def _same_across(value: Any, group) -> bool:
    """Whether every rank of `group` holds the tensors its first rank holds in `value` (DeepSpeed compares
    tensors only)."""
    mine = _tensors(value)
    theirs = [mine] if dist.get_rank(group) == 0 else [None]
    dist.broadcast_object_list(theirs, src=dist.get_global_rank(group, 0), group=group, device=_wire_device(group))
    same = len(mine) == len(theirs[0]) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(mine, theirs[0]))
    equal = torch.tensor([float(same)], device=_wire_device(group))
    dist.all_reduce(equal, op=dist.ReduceOp.MIN, group=group)
    return bool(equal.item())


def _wire_device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in (nested lists, tuples, dicts of) `value`, on the CPU, in order."""
    if isinstance(value, torch.Tensor):
        return [value.detach().cpu()]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in _tensors(value[key])]
    return []


def prepare(model: torch.nn.Module, config) -> tuple[TPTrainingConfig, dict[int, torch.nn.Parameter]]:
    """The engine's first act: the `tensor_parallel` section and, under autotp_size > 1, the split."""
    section = section_of(config.raw, config.source)
    if section.autotp_size > 1 and config.train_micro_batch_size_per_rank is not None:
        raise ConfigError(f"{config.source}: train_micro_batch_size_per_rank with {SECTION}.autotp_size: the "
                          "ranks of a TP group share every batch, so their micro batches cannot differ. Remove "
                          "train_micro_batch_size_per_rank.")
    return section, apply(model, section)


def chained(split: dict[int, torch.nn.Parameter], sharded: dict[int, torch.nn.Parameter]) -> dict:
    """{id(parameter before initialize): the one trained}: AutoTP's whole -> slice map (`split`) followed by
    stage 3's slice -> FSDP2 shard map (`sharded`), so an optimizer built on the whole model steps the shards."""
    return {**sharded, **{key: sharded.get(id(piece), piece) for key, piece in split.items()}}


def mark_masters(precision) -> None:
    """fp32 masters (bf16 / fp16) carry their model parameter's crew_tp_dim: the gradient norm reads it."""
    from crew.runtime.tensor_parallel.layers import TP_DIM
    for param, master in precision.master_pairs():
        if hasattr(param, TP_DIM):
            setattr(master, TP_DIM, getattr(param, TP_DIM))


def grad_norm(params: list[torch.Tensor], device: torch.device, across_dp: bool) -> torch.Tensor:
    """The float64 L2 norm of the whole model's gradient under TP: each slice's squares summed over the TP
    group, each replicated gradient (equal on the TP ranks) counted once; `across_dp`: ZeRO 2, each dp rank
    holding its owned part. At ZeRO 3 a sharded parameter's gradient is this rank's piece of its TP slice (an
    FSDP2 DTensor over the data-parallel group): those are summed over that group, the whole ones not."""
    from crew.runtime.gradnorm import _square_sum
    from crew.runtime.tensor_parallel.layers import is_sharded
    size = parallel.tensor_parallel_size()
    local = torch.zeros((), dtype=torch.float64, device=device)
    pieces = torch.zeros_like(local)
    zero3 = False
    for param in params:
        zero3 = zero3 or hasattr(param, "device_mesh")  # the same parameters on every rank: one decision
        if param.grad is None:
            continue
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        square = _square_sum(grad).to(device)
        square = square if is_sharded(param) else square / size
        if hasattr(param, "device_mesh"):
            pieces += square
        else:
            local += square
    if across_dp:
        dist.all_reduce(local, group=parallel.data_parallel_group())
    if zero3:
        dist.all_reduce(pieces, group=parallel.data_parallel_group())
    local += pieces
    dist.all_reduce(local, group=parallel.tensor_parallel_group())
    return local.sqrt()
