"""DeepSpeed's stage-3 hook object, `engine.optimizer.parameter_offload`, with its meaning on FSDP2.

TRL's `unwrap_model_for_generation` (GRPO, RLOO, PPO, GKD at ZeRO-3) generates inside
`GatheredParameters(model.parameters())` and, around the generation, removes the ZeRO-3 hooks
(`param.ds_active_sub_modules.clear()`, `hook.remove()` for each of `forward_hooks` and `backward_hooks`)
and adds them back (`param_coordinator._invalidate_trace()`, `_register_deepspeed_module(module)`), so that
the whole model stays gathered through every forward of the generation instead of being fetched and
released module by module. On FSDP2 those hooks are the units' unshard-before / reshard-after forward:
removing them unshards every unit and keeps it whole (no forward reshards it, fetching.py); registering them
again reshards every unit and gives each back its reshard-after-forward. While the units are whole,
GatheredParameters' copies of the shards share the units' tensors, so the model is whole once on a rank, not
twice. The names are DeepSpeed 0.19.8's (runtime/zero/parameter_offload.py, partitioned_param_coordinator.py).
"""

from __future__ import annotations

from enum import Enum

import torch

from crew.runtime.zero import fetching, gather, stage3


class ZeRoTraceMode(Enum):
    RECORD = 1
    COMPLETE = 2
    INVALID = 3


class PartitionedParameterCoordinator:
    """DeepSpeed's prefetch coordinator; FSDP2 prefetches by itself, so only its trace state is kept."""

    def __init__(self) -> None:
        self._trace_mode = ZeRoTraceMode.RECORD

    def is_invalid_trace(self) -> bool:
        return self._trace_mode is ZeRoTraceMode.INVALID

    def is_record_trace(self) -> bool:
        return self._trace_mode is ZeRoTraceMode.RECORD

    def is_complete_trace(self) -> bool:
        return self._trace_mode is ZeRoTraceMode.COMPLETE

    def _invalidate_trace(self) -> None:
        if self.is_invalid_trace():
            raise RuntimeError("attempted to invalidate already invalid trace")
        self._trace_mode = ZeRoTraceMode.INVALID

    def reset_step(self) -> None:
        if self.is_invalid_trace():
            self._trace_mode = ZeRoTraceMode.RECORD


class _UnitHooks:
    """A removable handle, as `module.register_forward_pre_hook` returns: removing it keeps every FSDP2
    unit of the model whole (gathered once, no resharding after forward) until hooks are registered again."""

    def __init__(self, owner: DeepSpeedZeRoOffload) -> None:
        self.owner = owner

    def remove(self) -> None:
        self.owner._keep_whole()


class DeepSpeedZeRoOffload:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.param_coordinator = PartitionedParameterCoordinator()
        self.forward_hooks: list = [_UnitHooks(self)]
        self.backward_hooks: list = []
        self._whole = False

    def get_param_coordinator(self) -> PartitionedParameterCoordinator:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: torch.nn.Module, count=None) -> None:
        """Hooks back on `module`'s units: each is resharded now and after every forward from now on."""
        if module is self.module and not self.param_coordinator.is_invalid_trace():
            self.param_coordinator._invalidate_trace()
        if module is self.module:
            fetching.state(module).held = False
        for unit in _units(module):
            _own_copies(unit)
            unit.set_reshard_after_forward(fetching.reshards_after_forward(self.module, unit), recurse=False)
            unit.reshard()
        if module is self.module:
            self._whole = False
            self.forward_hooks = [_UnitHooks(self)]

    def _keep_whole(self) -> None:
        if self._whole:
            return
        self._whole = True
        fetching.state(self.module).held = True
        root = getattr(self.module, "_get_fsdp_state", None)
        if root is not None:
            root()._lazy_init()  # generation can come before the first forward, which would do it
        with torch.no_grad():
            for unit in _units(self.module):
                unit.unshard()
                unit.set_reshard_after_forward(False, recurse=False)
                _share_unsharded(unit)


def _share_unsharded(unit: torch.nn.Module) -> None:
    """Inside GatheredParameters (as TRL removes the hooks) each shard is seen whole through a copy made on
    entering it: once the unit is unsharded, that copy gives way to the unit's own whole tensor (the same
    values), so a rank holds the model whole once while generating, as under DeepSpeed, not twice."""
    for fsdp_param in stage3.fsdp_params(unit):
        shard, whole = fsdp_param.sharded_param, getattr(fsdp_param, "_unsharded_param", None)
        copy = shard.__dict__.get(gather.WHOLE)
        if whole is not None and copy is not None and (copy.shape, copy.dtype, copy.device) == (
                whole.shape, whole.dtype, whole.device):
            shard.__dict__[gather.WHOLE] = whole.detach()
            shard.__dict__[_SHARED] = True


def _own_copies(unit: torch.nn.Module) -> None:
    """Before the unit reshards (which frees its whole tensors): a view still open gets its own copy back."""
    for fsdp_param in stage3.fsdp_params(unit):
        shard = fsdp_param.sharded_param
        if shard.__dict__.pop(_SHARED, False) and gather.WHOLE in shard.__dict__:
            shard.__dict__[gather.WHOLE] = shard.__dict__[gather.WHOLE].clone()


_SHARED = "_crew_whole_is_the_units"


def _units(module: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in module.modules() if isinstance(m, FSDPModule)]
