"""`deepspeed.checkpointing`: activation checkpointing on torch.utils.checkpoint (non-reentrant).

`checkpoint(function, *args)` recomputes `function`'s activations in backward, with or without
`configure()`. DeepSpeed's partitioning across model-parallel ranks, contiguous buffers and CPU
offload of the checkpoints do not exist in crew: asking for them logs once that they have no effect.
"""

from __future__ import annotations

from pathlib import Path

import torch.utils.checkpoint

from crew.log import warn_once

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

_DEFAULTS = {"partition_activations": False, "contiguous_memory_optimization": False,
             "cpu_checkpointing": False, "number_checkpoints": None,
             "synchronize_checkpoint_boundary": False, "profile": False}
_IGNORED = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing")
_settings = dict(_DEFAULTS)
_configured = False


def checkpoint(function, *args, **kwargs):
    """function(*args, **kwargs), its activations recomputed in backward instead of kept."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint


def _from_config(deepspeed_config) -> dict:
    """The config's `activation_checkpointing` section (a dict, or a JSON file's path)."""
    if deepspeed_config is None:
        return {}
    if not isinstance(deepspeed_config, dict):
        from crew.runtime.config import _read_json  # crew's reader: clear errors, no duplicate keys
        deepspeed_config = _read_json(Path(deepspeed_config))
    section = deepspeed_config.get("activation_checkpointing") or {}
    return {key: section[key] for key in _DEFAULTS if key in section}


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's signature: the config's section, then the explicit arguments (mpu_ is unused)."""
    global _configured
    reset()
    _settings.update(_from_config(deepspeed_config))
    explicit = {"partition_activations": partition_activations,
                "contiguous_memory_optimization": contiguous_checkpointing,
                "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    _settings.update({key: value for key, value in explicit.items() if value is not None})
    if _settings["contiguous_memory_optimization"]:
        assert _settings["partition_activations"], (
            "Contiguous Checkpointing is only available with partitioned activations. Set partitioned "
            "activations to true in deepspeed config")
        assert _settings["number_checkpoints"] is not None, (
            "Must specify the number of layers with contiguous memory checkpointing")
    for key in _IGNORED:
        if _settings[key]:
            warn_once(f"activation_checkpointing.{key} has no effect in crew: activations are "
                      "recomputed by torch.utils.checkpoint, kept whole on each rank's device")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    global _configured
    _settings.clear()
    _settings.update(_DEFAULTS)
    _configured = False
