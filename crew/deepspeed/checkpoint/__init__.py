"""`deepspeed.checkpoint`: only `deepspeed.checkpoint.utils` (clone_tensors_for_torch_save, which Accelerate and
Trainer call to save a model at ZeRO stages 0-2, and the names of a tag folder's files). crew writes DeepSpeed's
layout, so DeepSpeed's own reshaping tools (DeepSpeedCheckpoint, ds_to_universal.py) read crew's checkpoints where
DeepSpeed is installed; under crew they are refused by name."""

from __future__ import annotations

from crew.deepspeed.errors import UnsupportedAttribute, unsupported


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(f"checkpoint.{name}"), name=name, obj=None)
