"""A model an earlier stage-3 engine sharded, given to a new engine (Lightning: trainer.fit(model), then
trainer.test(model): a second deepspeed.initialize on the same module, which DeepSpeed re-partitions).
FSDP2 shards a module once, so the new engine takes the sharded model as it is. Lightning strips every
module hook before that second initialize (its remove_module_hooks, written for DeepSpeed's hooks), FSDP2's
and crew's among them: the hooks each module had once sharded are remembered and put back."""

from __future__ import annotations

import torch

# the Module attributes that hold hooks (dicts keyed by handle id)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)  # crew's stage 3 always shards the root


def remember_hooks(model: torch.nn.Module) -> None:
    """After sharding: each module's hooks as they are now."""
    for module in model.modules():
        module._crew_stage3_hooks = {name: dict(getattr(module, name)) for name in _HOOK_DICTS
                                     if hasattr(module, name)}


def restore_hooks(model: torch.nn.Module) -> None:
    """The remembered hooks that are gone, back in their order (the others were not touched)."""
    for module in model.modules():
        for name, saved in getattr(module, "_crew_stage3_hooks", {}).items():
            current = getattr(module, name)
            if all(key in current for key in saved):
                continue
            others = {key: hook for key, hook in current.items() if key not in saved}
            current.clear()
            current.update(saved)
            current.update(others)
