"""`import deepspeed` means crew: a finder that answers `deepspeed` and `deepspeed.X` with crew's modules.

Installed in every rank by `crew run --as_deepspeed` (through shim/deepspeed/__init__.py on the ranks'
PYTHONPATH). Each alias is the crew module itself, not a copy, so `deepspeed.comm is crew.comm`. A
DeepSpeed module crew does not provide raises UnsupportedModule naming the feature.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from crew.deepspeed.errors import UnsupportedModule, unsupported

# deepspeed.X -> the crew module that answers it; anything else maps to crew.deepspeed.X when that exists.
ALIASES = {
    "deepspeed": "crew.deepspeed",
    "deepspeed.comm": "crew.runtime.comm",
    "deepspeed.zero": "crew.runtime.zero",
    "deepspeed.runtime.zero": "crew.runtime.zero",
    "deepspeed.runtime.zero.config": "crew.deepspeed.runtime.zero_config",  # ZeroStageEnum, for unpickling
}


def crew_module_for(name: str) -> str:
    """The crew module that stands for the DeepSpeed module `name`; UnsupportedModule when none does."""
    if name in ALIASES:
        return ALIASES[name]
    inner = name.removeprefix("deepspeed.")
    for alias, target in ALIASES.items():
        if alias != "deepspeed" and name.startswith(f"{alias}."):  # deepspeed.runtime.zero.partition_parameters
            candidate = target + name.removeprefix(alias)
            if importlib.util.find_spec(candidate):
                return candidate
            raise UnsupportedModule(unsupported(inner), name=name)
    candidate = f"crew.deepspeed.{inner}"
    if importlib.util.find_spec(candidate.rpartition(".")[0]) and importlib.util.find_spec(candidate):
        return candidate  # e.g. deepspeed.moe.utils, which scripts import even without MoE
    raise UnsupportedModule(unsupported(inner), name=name)


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass  # the crew module ran when it was imported under its own name


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed" and not name.startswith("deepspeed."):
            return None
        return importlib.util.spec_from_loader(name, _Alias(crew_module_for(name)))


def install() -> None:
    """From now on `import deepspeed...` in this process resolves to crew (idempotent)."""
    if not any(isinstance(finder, DeepSpeedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedFinder())
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        if not sys.modules[name].__name__.startswith("crew."):
            del sys.modules[name]  # the shim itself: replaced by crew.deepspeed below
    sys.modules["deepspeed"] = importlib.import_module("crew.deepspeed")
