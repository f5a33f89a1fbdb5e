"""`deepspeed.runtime`: what scripts import from it (`deepspeed.runtime.utils`), and `lr_schedules`,
which Accelerate reads as an attribute right after `import deepspeed` (as DeepSpeed's engine imports it)."""

from crew.deepspeed.runtime import lr_schedules

__all__ = ["lr_schedules"]
