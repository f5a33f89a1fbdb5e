"""`deepspeed.ops.lion`: DeepSpeedCPULion and FusedLion with DeepSpeed 0.19.8's signatures and updates, on torch.

The classes live in crew/runtime/optim/lion.py, where the config type "Lion" builds them too (crew.runtime does not
import crew.deepspeed).
"""

from __future__ import annotations

from crew.runtime.optim.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
