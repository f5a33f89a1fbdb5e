"""`deepspeed.runtime.config`: DeepSpeedConfig (crew/runtime/config_view.py) and its error."""

from crew.errors import ConfigError as DeepSpeedConfigError
from crew.runtime.config_view import DeepSpeedConfig

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
