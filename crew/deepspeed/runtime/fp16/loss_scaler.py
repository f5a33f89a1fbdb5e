"""`deepspeed.runtime.fp16.loss_scaler.LossScaler` and `DynamicLossScaler` as pickled in a checkpoint's optimizer
files: crew's stand-ins (their attributes, nothing runs), the classes crew's own weights_only reader allows."""

from crew.runtime.checkpoint.deepspeed_files import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
