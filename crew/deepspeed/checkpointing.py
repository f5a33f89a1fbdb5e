"""`deepspeed.checkpointing`: activation checkpointing on torch.utils.checkpoint (non-reentrant).

`checkpoint(function, *args)` recomputes `function`'s activations in backward, with or without
`configure()`. As in DeepSpeed, the config's `activation_checkpointing` section takes effect when the
script calls `configure(mpu, deepspeed_config=...)` (the engine does not read it):

    cpu_checkpointing                 the checkpointed inputs wait for backward in CPU memory
    synchronize_checkpoint_boundary   the device is synchronized before and after each call
    profile                           each call's forward and recompute time is logged (rank 0)

`partition_activations` and `contiguous_memory_optimization` split checkpoints across model-parallel
ranks, which crew does not have: they log once that they have no effect.
"""

from __future__ import annotations

import time

import torch.utils.checkpoint

from crew.deepspeed.accelerator import get_accelerator
from crew.log import log_rank0, warn_once
from crew.runtime.config import ActivationCheckpointingConfig

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

_NO_EFFECT = ("partition_activations", "contiguous_memory_optimization")
_settings = ActivationCheckpointingConfig()
_configured = False


def checkpoint(function, *args, **kwargs):
    """function(*args, **kwargs), its activations recomputed in backward instead of kept."""
    settings = _settings
    if settings.profile:
        function = _timed(function)
    if settings.synchronize_checkpoint_boundary:
        get_accelerator().synchronize()
    # torch stops a recompute once it has the tensors backward needs; profiled, it runs whole
    with torch.utils.checkpoint.set_checkpoint_early_stop(not settings.profile):
        if settings.cpu_checkpointing and torch.is_grad_enabled():
            outputs = _checkpoint_with_inputs_on_cpu(function, args, kwargs)
        else:
            outputs = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    if settings.synchronize_checkpoint_boundary:
        get_accelerator().synchronize()
    return outputs


def non_reentrant_checkpoint(function, *args, **kwargs):
    """DeepSpeed's non-reentrant variant; crew's checkpoint() is non-reentrant already."""
    return checkpoint(function, *args, **kwargs)


def _checkpoint_with_inputs_on_cpu(function, args: tuple, kwargs: dict):
    """Checkpoint a CPU copy of each device tensor argument (the copy is what waits for backward)
    and move it back for the forward and the recompute; gradients flow through both copies."""
    devices = [arg.device if _offloadable(arg) else None for arg in args]
    on_cpu = tuple(arg.to("cpu") if device is not None else arg for arg, device in zip(args, devices))

    def on_device(*inputs):
        moved = (x.to(device) if device is not None else x for x, device in zip(inputs, devices))
        return function(*moved, **kwargs)

    return torch.utils.checkpoint.checkpoint(on_device, *on_cpu, use_reentrant=False)


def _offloadable(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _timed(function):
    """`function`, logging each call's time: the first is the forward, later ones recomputes."""
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        started = time.perf_counter()
        outputs = function(*args, **kwargs)
        get_accelerator().synchronize()
        what = "forward" if calls == 1 else "recompute in backward"
        log_rank0("checkpoint %s of %s: %.2f ms", what, getattr(function, "__name__", "function"),
                  1e3 * (time.perf_counter() - started))
        return outputs

    return run


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's signature: the config's section (a dict or a JSON file's path), then the explicit
    arguments over it; mpu_ (model parallelism) is not used."""
    global _settings, _configured
    settings = ActivationCheckpointingConfig() if deepspeed_config is None else \
        ActivationCheckpointingConfig.from_config(deepspeed_config)
    explicit = {"partition_activations": partition_activations,
                "contiguous_memory_optimization": contiguous_checkpointing,
                "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    settings = settings.model_copy(update={k: v for k, v in explicit.items() if v is not None})
    if settings.contiguous_memory_optimization:
        assert settings.partition_activations, (
            "Contiguous Checkpointing is only available with partitioned activations. Set partitioned "
            "activations to true in deepspeed config")
        assert settings.number_checkpoints is not None, (
            "Must specify the number of layers with contiguous memory checkpointing")
    for key in _NO_EFFECT:
        if getattr(settings, key):
            warn_once(f"activation_checkpointing.{key} has no effect in crew: it splits checkpoints "
                      "across model-parallel ranks, and crew trains data-parallel only")
    _settings, _configured = settings, True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed's reset() frees the contiguous checkpoint buffers, which crew does not keep: nothing
    to do (the settings stay, as in DeepSpeed)."""
