"""DeepSpeed's names on crew's engine: what `import deepspeed` is under `crew run --as_deepspeed`.

Each name is crew's own object (`deepspeed.comm` is crew.comm, `deepspeed.initialize` is
crew.initialize). A DeepSpeed name crew does not provide raises an error that names the feature.
"""

from __future__ import annotations

from crew import __version__ as _crew_version
from crew.deepspeed import accelerator, checkpointing, ops
from crew.deepspeed.accelerator import get_accelerator
from crew.deepspeed.errors import UnsupportedAttribute, unsupported
from crew.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from crew.deepspeed.runtime.engine import DeepSpeedEngine
from crew.deepspeed.utils import log_dist, logger
from crew.errors import ConfigError, CrewError
from crew.runtime import comm, zero
from crew.runtime.api import add_config_arguments, initialize
from crew.runtime.comm import init_distributed

# The DeepSpeed API crew serves, with crew's own version as the local label: passes the HF libraries' version
# gates (deepspeed>=0.9.3, ...) and says it is crew. The same string is the shim's distribution record
# (shim/deepspeed-<version>.dist-info), which importlib.metadata reads before `import deepspeed`.
DEEPSPEED_API_VERSION = "0.19.8"
__version__ = f"{DEEPSPEED_API_VERSION}+crew.{_crew_version}"
__version_major__, __version_minor__, __version_patch__ = map(int, DEEPSPEED_API_VERSION.split("."))
__git_hash__ = __git_branch__ = "[none]"  # DeepSpeed's value when it was not built from a git checkout
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

__all__ = ["ConfigError", "CrewError", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedEngine",
           "TORCH_DISTRIBUTED_DEFAULT_PORT", "__version__", "accelerator", "add_config_arguments", "checkpointing",
           "comm", "get_accelerator", "init_distributed", "initialize", "log_dist", "logger", "ops", "tp_model_init",
           "zero"]


def tp_model_init(model, tp_size: int, dtype, config=None, **kwargs):
    """DeepSpeed 0.19.8's: record-only (the model is split in initialize, from the merged config); returns
    `model` itself. `config` is not read here, as in DeepSpeed."""
    from crew.runtime.tensor_parallel import setup
    if hasattr(model, "ds_autotp_parsed"):
        logger.warning("ds_autotp_parsed' attribute already exists in the model; tp_model_init is now record-only.")
    return setup.record(model, tp_size, dtype, kwargs.get("tp_group"))


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(name), name=name, obj=None)
