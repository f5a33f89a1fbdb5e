"""What crew makes reachable under a DeepSpeed name answers to that name: `type(engine).__name__ ==
"DeepSpeedEngine"` and the like (scripts and libraries test class names). Every public class and function of
crew's `deepspeed` package, and of the crew modules `deepspeed.comm` / `deepspeed.zero` / `deepspeed.runtime.zero.*`
stand for, must have `__name__` and `__qualname__` equal to the name it is reached by.

That name is DeepSpeed's own for each of them: walking DeepSpeed 0.19.8's modules for the same names
(/opt/dsvenv, DS_ACCELERATOR=cpu) found `__name__ == __qualname__ == attribute name` for every one, except
deepspeed.comm's collectives (DeepSpeed wraps them: `timed_op.<locals>.log_wrapper`) and the op builders,
which DeepSpeed's CPU accelerator answers with NotImplementedBuilder.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import crew.deepspeed
import crew.runtime.zero
from crew.deepspeed.alias import ALIASES

# crew.ConfigError is raised everywhere and DeepSpeed code catches DeepSpeedConfigError: one class serves both
# (`except deepspeed.runtime.config.DeepSpeedConfigError` must catch what crew raises), under crew's name.
SAME_CLASS_AS_CREWS = {"DeepSpeedConfigError"}
# DeepSpeed's own aliases (parallel_state_sp.py: "we can just alias MP with SP"): its names are the SP functions'
DEEPSPEEDS_ALIASES = {"deepspeed.runtime.sequence_parallel.parallel_state_sp": {
    "get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group"}}


def _modules() -> dict[str, object]:
    """{DeepSpeed module name: the crew module that answers it}."""
    found = {"deepspeed": crew.deepspeed}
    for info in pkgutil.walk_packages(crew.deepspeed.__path__, "crew.deepspeed."):
        if ".shim" not in info.name:
            found[info.name.replace("crew.deepspeed", "deepspeed", 1)] = importlib.import_module(info.name)
    for name, target in ALIASES.items():
        found[name] = importlib.import_module(target)
    for info in pkgutil.iter_modules(crew.runtime.zero.__path__):
        found[f"deepspeed.runtime.zero.{info.name}"] = importlib.import_module(f"crew.runtime.zero.{info.name}")
    return found


def test_every_public_class_and_function_answers_to_the_name_it_is_reached_by():
    wrong, checked = [], 0
    for module_name, module in _modules().items():
        for attribute, value in vars(module).items():
            if attribute.startswith("_") or attribute in SAME_CLASS_AS_CREWS:
                continue
            if attribute in DEEPSPEEDS_ALIASES.get(module_name, ()):
                continue
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            if not (getattr(value, "__module__", "") or "").startswith("crew"):
                continue  # torch's, typing's: imported, not exported as DeepSpeed's
            checked += 1
            if (value.__name__, value.__qualname__) != (attribute, attribute):
                wrong.append(f"{module_name}.{attribute} is {value.__qualname__}")
    assert checked > 80
    assert not wrong, "\n".join(wrong)


def test_the_engine_is_deepspeeds_class_and_crews():
    from crew.deepspeed.runtime.engine import DeepSpeedEngine
    from crew.runtime.engine import Engine

    assert Engine is DeepSpeedEngine and crew.deepspeed.DeepSpeedEngine is Engine
    assert (Engine.__name__, Engine.__qualname__) == ("DeepSpeedEngine", "DeepSpeedEngine")
    assert Engine.__module__ == "crew.runtime.engine"  # crew's code; Accelerate's tests read it
