"""`deepspeed.runtime`: what scripts import from it (`deepspeed.runtime.utils`), and `lr_schedules` and `zero`,
which scripts read as attributes right after `import deepspeed` (Accelerate; DeepSpeed-Chat's
`deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`)."""

from crew.deepspeed.runtime import lr_schedules
from crew.runtime import zero

__all__ = ["lr_schedules", "zero"]
