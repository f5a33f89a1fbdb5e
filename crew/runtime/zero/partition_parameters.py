"""`zero.Init`: a model built inside it never sits whole on any rank, as under DeepSpeed.

At the end of each module's `__init__` (the most derived class's, so a subclass can still adjust what its
parents made), every parameter the module owns directly is broadcast from rank 0 (every rank gets rank 0's
initial values), split into equal flat pieces, and replaced by an empty placeholder: rank r keeps piece r as
`param.ds_tensor`. So a rank holds one module's parameters whole at a time, plus its pieces of the rest.
The parameters carry DeepSpeed's attributes (`ds_id`, `ds_shape`, `ds_numel`, `ds_status`, `ds_tensor`),
which Hugging Face, PEFT and DeepSpeed-Chat read; `GatheredParameters` (gather.py) makes them whole for a
while, and the engine turns them into FSDP2 shards one unit at a time (stage3.py) or whole tensors (0-2).

`Module.apply(fn)` inside the block gathers each module's parameters around `fn` and keeps rank 0's result,
as DeepSpeed's does. Buffers are left whole. The names transformers reads from DeepSpeed's module of this
name (`ZeroParamStatus`, `zero_wrapper_for_fp_tensor_constructor`, `_orig_torch_arange`, ...) are here.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from collections.abc import Callable, Iterable
from enum import Enum

import torch

from crew.errors import ConfigError
from crew.runtime import comm

__all__ = ["Init", "ZeroParamStatus", "ZeroParamType", "is_zero_param", "register_external_parameter",
           "unregister_external_parameter"]


class ZeroParamType(Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # whole on every rank
    NOT_AVAILABLE = 2  # partitioned
    INFLIGHT = 3


# DeepSpeed's names for the constructors its Init wraps (crew's does not: tensors are made as the script asks)
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None) -> Callable:
    """DeepSpeed's wrapper: `fn` with a default device and floating point results cast to `target_fp_dtype`."""
    def wrapped_fn(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor
    return wrapped_fn


_next_id = itertools.count()


def is_zero_param(param) -> bool:
    return hasattr(param, "ds_id")


def is_partitioned(param) -> bool:
    """An Init-built parameter that is a placeholder now (its values are the ranks' ds_tensor pieces)."""
    return hasattr(param, "ds_tensor") and getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE \
        and not hasattr(param, "device_mesh")


# -- partitioning ---------------------------------------------------------------------------------

def home_device() -> torch.device:
    """Where the collectives run: this rank's GPU under NCCL, else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def partition(params: list[torch.nn.Parameter], source: int | None = 0,
              keep_on: torch.device | None = None) -> None:
    """Keep this rank's piece of each whole parameter: `source`'s piece for this rank (scattered), or with
    None, the piece of this rank's own values. The piece stays where it was (new: on `keep_on`, by
    default where the collectives run)."""
    world, rank = comm.get_world_size(), comm.get_rank()
    device = home_device()
    for param in params:
        where = param.ds_tensor.device if hasattr(param, "ds_tensor") else keep_on or device
        whole = param.data.to(device)
        piece = _ceil_div(whole.numel(), world)
        flat = whole.reshape(-1)
        if piece * world != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(piece * world - flat.numel())])
        if world > 1 and source is not None:
            mine = torch.empty(piece, dtype=whole.dtype, device=device)
            pieces = list(flat.chunk(world)) if rank == source else None
            torch.distributed.scatter(mine, pieces, src=source)
        else:
            mine = flat[rank * piece:(rank + 1) * piece].clone()
        if not is_zero_param(param):
            param.ds_id = next(_next_id)
            param.ds_persist = False
            param.ds_active_sub_modules = set()
        param.ds_shape, param.ds_numel = whole.shape, whole.numel()
        param.ds_tensor = mine.to(where)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        param.data = torch.empty(0, dtype=whole.dtype, device=param.device)
        del whole, flat


def gather(params: list[torch.nn.Parameter]) -> None:
    """Make Init-built placeholders whole again on every rank (one all-gather per dtype)."""
    for dtype in dict.fromkeys(p.ds_tensor.dtype for p in params):
        _gather_same_dtype([p for p in params if p.ds_tensor.dtype == dtype])


def _gather_same_dtype(params: list[torch.nn.Parameter]) -> None:
    world = comm.get_world_size()
    local = torch.cat([p.ds_tensor.reshape(-1).to(home_device()) for p in params])
    if world > 1:
        everyone = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(everyone, local)
        everyone = everyone.view(world, -1)
    else:
        everyone = local.view(1, -1)
    offset = 0
    for param in params:
        piece = param.ds_tensor.numel()
        whole = everyone[:, offset:offset + piece].reshape(-1)[:param.ds_numel].reshape(param.ds_shape)
        param.data = whole.to(param.ds_tensor.device).clone(memory_format=torch.contiguous_format)
        param.ds_status = ZeroParamStatus.AVAILABLE
        offset += piece


def release(params: list[torch.nn.Parameter]) -> None:
    """Back to placeholders, dropping whatever was written while whole (the pieces are unchanged)."""
    for param in params:
        param.data = torch.empty(0, dtype=param.ds_tensor.dtype, device=param.device)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def forget(param: torch.nn.Parameter) -> None:
    """The engine sharded this parameter anew: free its whole values and pieces."""
    param.__dict__.pop("ds_tensor", None)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- external parameters -------------------------------------------------------------------------

def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's: `module`'s forward uses `parameter`, which another module owns. crew keeps the owner of
    such a parameter in the root FSDP2 unit, whose parameters are whole through the whole forward."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    if not hasattr(module, "_external_params"):
        module._external_params = {}
    module._external_params[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    if id(parameter) not in getattr(module, "_external_params", {}):
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del module._external_params[id(parameter)]


def external_parameters(model: torch.nn.Module) -> set[int]:
    """ids of every parameter registered as external on any module of `model`."""
    return {key for module in model.modules() for key in getattr(module, "_external_params", {})}


# -- the context -----------------------------------------------------------------------------

class Init:
    """`with deepspeed.zero.Init(config_dict_or_path=...): model = Model()`: see the module docstring.
    `Init(module=model)` partitions a model built before. DeepSpeed's other arguments are accepted; crew
    keeps the pieces on the GPU (the CPU with `remote_device="cpu"` or offload_param) in the dtype the model
    was built in (the engine keeps fp32 masters and computes in fp16/bf16 when the config says so)."""

    _depth = 0  # nested Init blocks patch once
    _active: Init | None = None  # the outermost block

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs) -> None:
        self.enabled = enabled
        self.keep_on = _piece_device(remote_device, config_dict_or_path or config)
        self._patches: list[tuple[object, str, object]] = []
        if enabled and not torch.distributed.is_initialized():
            comm.init_distributed()  # as DeepSpeed's Init: the launcher's group, or a world of one
        if module is not None and enabled:
            partition([p for p in module.parameters() if not is_zero_param(p) and not p.is_meta],
                      keep_on=self.keep_on)

    def __enter__(self) -> Init:
        if self.enabled:
            Init._depth += 1
            if Init._depth == 1:
                Init._active = self
                self._patch()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            Init._depth -= 1
            if Init._depth == 0:
                self._unpatch()
                Init._active = None

    def _patch(self) -> None:
        for cls in _module_classes():
            if "__init__" in cls.__dict__:
                self._replace(cls, "__init__", _partition_after(cls.__dict__["__init__"]))
        self._replace(torch.nn.Module, "__init_subclass__", classmethod(_wrap_new_subclass))
        self._replace(torch.nn.Module, "apply", _apply_with_gather(torch.nn.Module.apply))

    def _replace(self, owner, name: str, value) -> None:
        self._patches.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)

    def _unpatch(self) -> None:
        for owner, name, original in reversed(self._patches):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        for cls in _module_classes():  # classes defined inside the block
            wrapped = cls.__dict__.get("__init__")
            if getattr(wrapped, "__crew_unwrapped__", None) is not None:
                cls.__init__ = wrapped.__crew_unwrapped__
        self._patches = []


def _piece_device(remote_device, config) -> torch.device | None:
    """The CPU when asked (remote_device="cpu", or the config's zero_optimization.offload_param), else
    None: where the collectives run."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as file:
                config = json.load(file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"zero.Init(config_dict_or_path={str(config)!r}): cannot read it as a JSON "
                              f"config ({exc}). Give the path of your DeepSpeed config, or the dict.") from None
    section = config.get("zero_optimization") if isinstance(config, dict) else None
    offload = (section or {}).get("offload_param") or {}
    wanted = remote_device or (offload.get("device") if isinstance(offload, dict) else None)
    return torch.device("cpu") if wanted == "cpu" else None


def _module_classes() -> list[type]:
    seen, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return seen


_constructing: set[int] = set()  # ids of the modules whose outermost __init__ is running


def _partition_after(init: Callable) -> Callable:
    if hasattr(init, "__crew_unwrapped__"):
        return init

    @functools.wraps(init)
    def wrapper(module, *args, **kwargs):
        outermost = id(module) not in _constructing
        _constructing.add(id(module))
        try:
            init(module, *args, **kwargs)
        finally:
            if outermost:
                _constructing.discard(id(module))
        if outermost and Init._active is not None:
            partition([p for p in module.parameters(recurse=False) if not is_zero_param(p) and not p.is_meta],
                      keep_on=Init._active.keep_on)

    wrapper.__crew_unwrapped__ = init
    return wrapper


def _wrap_new_subclass(cls, **kwargs) -> None:
    super(torch.nn.Module, cls).__init_subclass__(**kwargs)
    if "__init__" in cls.__dict__:
        cls.__init__ = _partition_after(cls.__dict__["__init__"])


def _apply_with_gather(apply: Callable) -> Callable:
    @functools.wraps(apply)
    def wrapped(module: torch.nn.Module, fn: Callable):
        return apply(module, fn if getattr(fn, "__crew_gathers__", False) else _gathering(fn))
    return wrapped


def _gathering(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def on_module(module: torch.nn.Module):
        params = [p for p in module.parameters(recurse=False) if is_partitioned(p)]
        gather(params)
        try:
            return fn(module)
        finally:
            partition(params, source=0)  # rank 0's result, as DeepSpeed's
    on_module.__crew_gathers__ = True
    return on_module


def shutdown_init_context() -> None:
    """DeepSpeed's: stop partitioning new modules for a while, inside an Init block (initialize does)."""
    if Init._active is not None:
        Init._active._unpatch()


def restore_init_context() -> None:
    if Init._active is not None:
        Init._active._patch()


def sorted_by_id(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Each parameter once, in ds_id order: every rank issues the same collectives in the same order."""
    unique = {id(p): p for p in params}
    return sorted(unique.values(), key=lambda p: p.ds_id)


def get_accelerator():
    """DeepSpeed's module has it imported (transformers' prevent_arange_dtype_change reads pp.get_accelerator)."""
    from crew.deepspeed.accelerator import get_accelerator as current
    return current()
