"""`deepspeed.runtime.zero.config.ZeroStageEnum` as pickled in a checkpoint's optimizer files ("zero_stage"):
crew's stand-in, for tools that torch.load those files with weights_only=False (Lightning's converter)."""

from crew.runtime.checkpoint.deepspeed_files import ZeroStageEnum

__all__ = ["ZeroStageEnum"]
