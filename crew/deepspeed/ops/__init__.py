"""`deepspeed.ops`: the Adam optimizers (`deepspeed.ops.adam`) on torch's own implementations."""

from crew.deepspeed.ops import adam

__all__ = ["adam"]
