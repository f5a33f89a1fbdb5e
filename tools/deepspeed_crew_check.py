"""What crew does for each DeepSpeed name of the census (tools/deepspeed_census.py): provided or refused.

Module and name entries are imported as a script would, through crew's `deepspeed` alias. Attribute entries
are looked up on real crew engines, one per ZeRO stage, in one process group (a world of one is enough:
the attributes do not depend on the world size). Shared by the census script and tests/deepspeed/test_census.py.
"""

from __future__ import annotations

import importlib
import os
import socket
import types

# The DeepSpeed-specific attributes the libraries read on DeepSpeed's objects, each checked against
# DeepSpeed 0.19.8's source: owner (where it lives, reached from the engine), the ZeRO stages at which
# DeepSpeed has it, and engine_receiver for generic names that count only on an engine-like receiver.
_ENGINE = {"owner": "engine", "stages": [0, 1, 2, 3]}
_ENGINE_GENERIC = {**_ENGINE, "engine_receiver": True}
_PARAM3 = {"owner": "parameter", "stages": [3]}
_OFFLOAD3 = {"owner": "engine.optimizer.parameter_offload", "stages": [3]}
ATTRIBUTES = {
    # runtime/engine.py DeepSpeedEngine
    **{name: _ENGINE_GENERIC for name in (
        "module", "optimizer", "lr_scheduler", "backward", "step", "save_checkpoint", "load_checkpoint",
        "destroy", "get_lr", "train_batch_size", "gradient_accumulation_steps", "local_rank", "global_rank",
        "world_size", "global_steps", "global_samples", "train_micro_batch_size_per_gpu")},
    **{name: _ENGINE for name in (
        "set_gradient_accumulation_boundary", "is_gradient_accumulation_boundary", "get_global_grad_norm",
        "zero_optimization_stage", "zero_optimization", "zero_gather_16bit_weights_on_model_save",
        "save_16bit_model", "empty_partition_cache", "bfloat16_enabled", "fp16_enabled")},
    "_zero3_consolidated_16bit_state_dict": {"owner": "engine", "stages": [3]},
    # only on AutoTP's path (accelerate calls it when tensor_parallel.autotp_size > 1)
    "_consolidated_16bit_state_dict": {"owner": "engine", "stages": [0, 1, 2, 3]},
    # runtime/zero/stage_1_and_2.py, stage3.py; at stage 0 only FP16_Optimizer (bf16/fp16) has it, not a bare fp32
    # optimizer (Accelerate checks hasattr(optimizer, "overflow") first)
    "overflow": {"owner": "engine.optimizer", "stages": [1, 2, 3]},
    "parameter_offload": {"owner": "engine.optimizer", "stages": [3]},
    # runtime/zero/parameter_offload.py DeepSpeedZeRoOffload
    "param_coordinator": _OFFLOAD3, "forward_hooks": _OFFLOAD3, "backward_hooks": _OFFLOAD3,
    "_register_deepspeed_module": _OFFLOAD3,
    # runtime/zero/partition_parameters.py: a ZeRO-3 parameter, and a module's external parameters
    "ds_numel": _PARAM3, "ds_shape": _PARAM3, "ds_status": _PARAM3, "ds_id": _PARAM3, "ds_tensor": _PARAM3,
    "ds_active_sub_modules": _PARAM3, "partition_numel": _PARAM3,
    "ds_external_parameters": {"owner": "module", "stages": [3]},
}

# DeepSpeed names crew refuses on purpose (a key covers the names under it), with what the error crew raises
# says besides the name. None is on a path a ZeRO 0-3 data-parallel run takes.
REFUSED = {
    # not in DeepSpeed 0.19.8 either: ESMFold catches the AttributeError (crew's is one) and goes on
    "deepspeed.utils.is_initialized": "is not supported by crew",
}

def check_all(names: list[dict]) -> dict[str, tuple[str, str]]:
    """name -> (verdict, detail) for every census entry; joins a one-process group for the engines."""
    verdicts = {e["name"]: check_import(e["name"]) for e in names if e["kind"] != "attribute"}
    attributes = [e["name"] for e in names if e["kind"] == "attribute"]
    if attributes:
        _join_world_of_one()
        verdicts.update(check_attributes(attributes))
    return verdicts


def refusal_for(name: str) -> str | None:
    """What REFUSED says crew's error for `name` contains; None when crew should not refuse it."""
    keys = [key for key in REFUSED if name == key or name.startswith(key + ".")]
    return REFUSED[max(keys, key=len)] if keys else None


def describe(verdict: tuple[str, str]) -> str:
    kind, detail = verdict
    text = {"provided": "provided", "refused": "refused", "missing": "**missing**"}[kind]
    return f"{text}: {detail}".replace("|", "\\|").replace("\n", " ") if detail else text


# ---- modules and names ---------------------------------------------------------------------------------


def check_import(dotted: str) -> tuple[str, str]:
    """Resolve `deepspeed.a.b.C.D` as `import`/`from ... import`/attribute access would under crew."""
    from crew.deepspeed import alias
    from crew.errors import CrewError

    alias.install()
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        prefix = ".".join(parts[:index + 1])
        try:
            obj = getattr(obj, part)
            continue
        except AttributeError as error:
            refused = error if isinstance(error, CrewError) else None
            if not isinstance(obj, types.ModuleType):
                return _refused_or_missing(refused, f"{prefix}: {error}")
        try:
            obj = importlib.import_module(prefix)
        except CrewError as error:
            return "refused", str(error)
        except ImportError as error:
            return _refused_or_missing(refused, f"{prefix}: {error}")
    return "provided", ""


def _refused_or_missing(refused: Exception | None, detail: str) -> tuple[str, str]:
    return ("refused", str(refused)) if refused else ("missing", detail)


# ---- attributes on real engines ------------------------------------------------------------------------


def _join_world_of_one() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")


def tiny_engine(stage: int, **extra):
    import torch

    import crew

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}, **extra}
    engine, *_ = crew.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.ones(2, 4)).sum()  # one step: ZeRO-3 parameters have been gathered and released
    engine.backward(loss)
    engine.step()
    return engine


def _owner(engine, owner: str):
    if owner == "parameter":
        return next(engine.module.parameters())
    if owner == "module":
        return next(m for m in engine.module.modules() if list(m.parameters(recurse=False)))
    obj = engine
    for part in owner.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def check_attributes(attributes: list[str], engines: dict | None = None) -> dict[str, tuple[str, str]]:
    """`.name` -> verdict: present on its owner in a real crew engine at every stage DeepSpeed has it
    (`engines`: stage -> engine, built here and destroyed after when not given)."""
    built = engines is None
    engines = engines or {stage: tiny_engine(stage) for stage in range(4)}
    verdicts = {}
    for name in attributes:
        spec = ATTRIBUTES[name[1:]]
        absent = []
        for stage in spec["stages"]:
            try:
                if not hasattr(_owner(engines[stage], spec["owner"]), name[1:]):
                    absent.append(f"ZeRO {stage}")
            except (AttributeError, StopIteration) as error:
                absent.append(f"ZeRO {stage} ({spec['owner']}: {error})")
        verdicts[name] = ("missing", f"not on {spec['owner']} at {', '.join(absent)}") if absent else (
            "provided", "")
    for engine in engines.values() if built else ():
        engine.destroy()
    return verdicts
