"""`deepspeed.runtime.engine`: DeepSpeedEngine is crew's Engine (for `isinstance` checks)."""

from crew.runtime.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
