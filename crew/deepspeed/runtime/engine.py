"""`deepspeed.runtime.engine`: DeepSpeedEngine is crew's engine class itself (crew.runtime.engine.Engine is the
same class), so `isinstance` checks and `type(engine).__name__ == "DeepSpeedEngine"` both hold."""

from crew.runtime.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
