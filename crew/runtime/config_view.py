"""DeepSpeed's `DeepSpeedConfig`: a crew Config's resolved values under DeepSpeed 0.19.8's attribute
names (deepspeed/runtime/config.py, `DeepSpeedConfig._initialize_params`), for scripts that build one
(`deepspeed.DeepSpeedConfig(path_or_dict)`) or read `engine._config`."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from crew.runtime import comm
from crew.runtime.config import Config, load_config

__all__ = ["DeepSpeedConfig", "deepspeed_optimizer_name"]

logger = logging.getLogger(__name__)

# DeepSpeed lower-cases its own optimizer names (runtime/config.py DEEPSPEED_OPTIMIZERS)
_DEEPSPEED_OPTIMIZERS = frozenset({"adagrad", "adam", "adamw", "lamb", "onebitadam", "zerooneadam",
                                   "onebitlamb", "muadam", "muadamw", "musgd", "lion", "muon"})


def deepspeed_optimizer_name(type_name: str | None) -> str | None:
    """The config's optimizer type as DeepSpeed reports it: lower-cased for its own names."""
    if type_name is not None and type_name.lower() in _DEEPSPEED_OPTIMIZERS:
        return type_name.lower()
    return type_name


class DeepSpeedConfig:
    """`DeepSpeedConfig(config, mpu=None, mesh_device=None)`: a path or a dict, the batch triple
    resolved for the current world (1 before the process group exists); errors are crew's
    ConfigError. `crew_config` is crew's own Config."""

    def __init__(self, config: str | os.PathLike | Mapping[str, Any] | Config, mpu=None, mesh_device=None):
        initialized = comm.is_initialized()
        self.global_rank = comm.get_rank() if initialized else 0
        world_size = comm.get_world_size() if initialized else 1
        resolved = config if isinstance(config, Config) else load_config(config, world_size)
        self.world_size = resolved.world_size
        self.crew_config = resolved
        self._param_dict = resolved.raw
        self.train_batch_size = resolved.train_batch_size
        self.train_micro_batch_size_per_gpu = resolved.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = resolved.gradient_accumulation_steps
        self.steps_per_print = resolved.steps_per_print
        self.gradient_clipping = resolved.gradient_clipping
        self.prescale_gradients = resolved.prescale_gradients
        self.gradient_predivide_factor = resolved.gradient_predivide_factor
        self.wall_clock_breakdown = resolved.wall_clock_breakdown
        self.zero_config = resolved.zero_optimization
        self.zero_optimization_stage = resolved.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config = resolved.fp16
        self.bfloat16_config = resolved.bf16
        self.activation_checkpointing_config = resolved.activation_checkpointing
        optimizer, scheduler = resolved.optimizer, resolved.scheduler
        self.optimizer_name = deepspeed_optimizer_name(optimizer.type if optimizer else None)
        self.optimizer_params = optimizer.params if optimizer else None
        self.scheduler_name = scheduler.type if scheduler else None
        self.scheduler_params = scheduler.params if scheduler else None

    def print(self, name: str) -> None:
        logger.info("%s:", name)
        for key in sorted(vars(self)):
            if key not in ("_param_dict", "crew_config"):
                logger.info("  %s %s %s", key, "." * (29 - len(key)), getattr(self, key))
        logger.info("  json = %s", self._param_dict)
