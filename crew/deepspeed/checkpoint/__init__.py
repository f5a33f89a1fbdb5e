"""`deepspeed.checkpoint`: only `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`, which Accelerate
and Trainer call to save a model at ZeRO stages 0-2. DeepSpeed's checkpoint reshaping (DeepSpeedCheckpoint,
universal checkpoints) reads DeepSpeed's own file layout, which crew does not write: refused by name."""

from __future__ import annotations

from crew.deepspeed.errors import UnsupportedAttribute, unsupported


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(f"checkpoint.{name}"), name=name, obj=None)
