"""`GatheredParameters`: DeepSpeed's `with deepspeed.zero.GatheredParameters(params, modifier_rank=None):`.

Inside the block each partitioned parameter is whole on every rank, and the parameter object itself is the
whole tensor as far as the script can tell: `param.data`, `param.shape`, `param.cpu()`, a module's forward
and `_load_from_state_dict` all see the whole values. Two kinds are gathered:

    Init-built, before the engine   a placeholder whose values are the ranks' `ds_tensor` pieces: its
                                    `.data` becomes the whole tensor (as in DeepSpeed)
    FSDP2 shards, after the engine  a DTensor: for the block its class becomes a subclass whose every torch
                                    call (`.data` included) runs on the gathered whole tensor instead

On exit, with `modifier_rank=r`, rank r's values are broadcast and each rank keeps its part (and the fp32
master weights follow); with None, whatever was written is dropped. Under AutoTP r is a data-parallel rank, as in
DeepSpeed: each TP slice is broadcast within the ranks that hold it. Parameters that are not partitioned
(stages 0-2, or made outside zero.Init before the engine) are left alone, as DeepSpeed leaves them: a block
over only those does nothing. Every rank must enter with the same parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._pytree import tree_map_only

from crew.errors import CrewError
from crew.runtime import comm
from crew.runtime.registry import live_engines
from crew.runtime.zero import partition_parameters as pp
from crew.runtime.zero.partition_parameters import ZeroParamStatus

_WHOLE = "_crew_whole"
WHOLE = _WHOLE  # the attribute that holds a viewed shard's whole tensor (parameter_offload.py shares it)


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True) -> None:
        world = comm.get_world_size(_group())
        if modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world):
            raise CrewError(f"GatheredParameters(modifier_rank={modifier_rank!r}): give the rank whose "
                            f"changes are kept, 0..{world - 1}, or None to drop changes.")
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.params: list[torch.nn.Parameter] = []
        self._placeholders: list[torch.nn.Parameter] = []
        self._shards: list[torch.nn.Parameter] = []
        self._persistent: list[torch.nn.Parameter] = []
        if not enabled:
            return
        given = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self.params = pp.sorted_by_id(p for p in given if p is not None and pp.is_zero_param(p))
        self.enabled = bool(self.params)
        if fwd_module is not None:
            for param in self.params:
                pp.register_external_parameter(fwd_module, param)

    def __enter__(self) -> None:
        if not self.enabled:
            return
        # a parameter already whole (an enclosing block) is left to that block
        self._placeholders = [p for p in self.params if pp.is_partitioned(p)]
        self._shards = [p for p in self.params if is_shard(p)]
        # stage 3's small parameters are whole already (persistence.py); the modifier's changes are kept
        self._persistent = [p for p in self.params if getattr(p, "ds_persist", False) and not is_shard(p)
                            and not pp.is_partitioned(p)]
        pp.gather(self._placeholders)
        for param in self._shards:
            view_whole(param)

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        source = self.modifier_rank if exc[0] is None else None
        if source is None:
            pp.release(self._placeholders)
        else:
            pp.partition(self._placeholders, source=source)
        for param in self._shards:
            end_whole_view(param, source)
        if source is not None and comm.get_world_size(_group()) > 1:
            with torch.no_grad():
                for param in self._persistent:
                    comm.broadcast(param.data, _global(source), group=_group())
        self._placeholders, self._shards, self._persistent = [], [], []


# -- FSDP2 shards seen whole --------------------------------------------------------------------

def is_shard(param) -> bool:
    """An FSDP2-sharded parameter not being viewed whole already."""
    return hasattr(param, "device_mesh") and hasattr(param, "to_local") and _WHOLE not in param.__dict__


def view_whole(param: torch.nn.Parameter) -> None:
    """From now on the parameter object is its whole tensor (in the dtype the model computes in: the fp32
    shards are crew's master weights; DeepSpeed's parameters are 16-bit under fp16/bf16)."""
    with torch.no_grad():
        whole = _full_tensor(param).to(getattr(param, "ds_compute_dtype", param.dtype))
    param.__dict__[_WHOLE] = whole
    param.__class__ = _view_class(type(param))
    param.ds_status = ZeroParamStatus.AVAILABLE


def end_whole_view(param: torch.nn.Parameter, source: int | None) -> None:
    """Back to the shard; with `source`, that rank's whole values are written into every rank's shard."""
    whole = param.__dict__.pop(_WHOLE)
    param.__class__ = type(param).__bases__[0]
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    if source is None:
        return
    from torch.distributed.tensor import distribute_tensor
    with torch.no_grad():
        whole = whole.detach().to(param.device).contiguous()
        if comm.get_world_size(_group()) > 1:
            comm.broadcast(whole, _global(source), group=_group())
        mine = distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(mine.to_local())
        for master in _masters_of(param):
            master.copy_(param)


def _group():
    """The group a parameter is partitioned over: the world, or under AutoTP the data-parallel group (its ranks hold
    the same TP slice); `modifier_rank` is a rank of it, as DeepSpeed's (a data-parallel rank)."""
    from crew.runtime import parallel
    return parallel.data_parallel_group()


def _global(source: int) -> int:
    group = _group()
    return source if group is None else torch.distributed.get_global_rank(group, source)


def _full_tensor(param) -> torch.Tensor:
    if param.device.type == "cpu" and torch.distributed.get_backend() == "nccl":  # offloaded shards
        from torch.distributed.tensor import DTensor
        local = param.to_local().to(torch.device("cuda", torch.cuda.current_device()))
        on_gpu = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                    stride=param.stride())
        return on_gpu.full_tensor().cpu()
    return param.full_tensor().detach()


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(base: type) -> type:
    """A subclass of `base` (DTensor) whose torch calls run on the whole tensor kept in the instance."""
    if base not in _VIEW_CLASSES:
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            args, kwargs = tree_map_only(view, lambda t: t.__dict__[_WHOLE], (args, kwargs or {}))
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        view = type(f"Whole{base.__name__}", (base,), {"__torch_function__": classmethod(__torch_function__)})
        _VIEW_CLASSES[base] = view
    return _VIEW_CLASSES[base]


def _masters_of(param: torch.Tensor) -> Iterable[torch.Tensor]:
    for engine in live_engines():
        master = engine.precision.master_of(param)
        if master is not param:
            yield master
