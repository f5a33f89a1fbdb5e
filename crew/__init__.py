"""crew: train PyTorch models on many processes across many machines, DeepSpeed-compatible.

    import crew as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model, ...)

The training API loads on first use, so that `import crew` (and the `crew` command line) does not
import torch.
"""

import importlib

__version__ = "0.1.0"

__all__ = ["ConfigError", "__version__", "accelerator", "add_config_arguments", "comm", "get_accelerator",
           "init_distributed", "initialize", "zero"]

_LAZY = {
    "initialize": ("crew.runtime.api", "initialize"),
    "add_config_arguments": ("crew.runtime.api", "add_config_arguments"),
    "init_distributed": ("crew.runtime.comm", "init_distributed"),
    "comm": ("crew.runtime.comm", None),
    "zero": ("crew.runtime.zero", None),
    "ConfigError": ("crew.errors", "ConfigError"),
    "accelerator": ("crew.deepspeed.accelerator", None),
    "get_accelerator": ("crew.deepspeed.accelerator", "get_accelerator"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'crew' has no attribute '{name}'")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
