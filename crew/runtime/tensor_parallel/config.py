"""The DS config's `tensor_parallel` section (DeepSpeed 0.19.8's TPTrainingConfig): keys, defaults, checks.

Implemented: autotp_size (0 or 1: off), tp.tp_size (must equal autotp_size), dtype (checked against
tp_model_init's; the precision itself comes from bf16 / fp16, as in DeepSpeed), partition_config and preset_model
(every DeepSpeed preset; specs.py, checked here). Accepted with no effect: tp_overlap_comm, tp.tp_grain_size,
keep_module_on_host, injection_policy_tuple. Refused: vocab_parallel_lm_head true, vocab_parallel_ce_backend
"liger", kernel_inject true.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crew.errors import ConfigError
from crew.runtime.tensor_parallel import specs

SECTION = "tensor_parallel"
_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
PRESETS = tuple(specs.PRESETS)  # DeepSpeed 0.19.8's AutoTPPresets


class TPConfig(BaseModel):
    """`tensor_parallel.tp` (alias `tensor_parallel`)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)
    tp_size: int = Field(1, ge=1)
    tp_grain_size: int = Field(1, ge=1)
    mpu: Any = None
    tp_group: Any = None


class TPTrainingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)
    dtype: Any = torch.float16
    autotp_size: int = Field(0, ge=0)
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: bool | None = None
    vocab_parallel_ce_backend: str = "torch"
    tensor_parallel: TPConfig = Field(default_factory=TPConfig, alias="tp")
    injection_policy_tuple: Any = None
    partition_config: dict | None = None
    preset_model: str | None = None
    keep_module_on_host: bool = False
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")


IMPLEMENTED = frozenset({"autotp_size", "tp", "tensor_parallel", "dtype", "preset_model", "tp_overlap_comm",
                         "keep_module_on_host", "injection_policy_tuple", "vocab_parallel_lm_head",
                         "vocab_parallel_ce_backend", "partition_config", "kernel_inject",
                         "replace_with_kernel_inject"})
_NO_EFFECT = {"tp_overlap_comm": False, "keep_module_on_host": False, "injection_policy_tuple": None}


def parse(raw: Any, source: str = "<dict>") -> TPTrainingConfig:
    """The section, checked: an error names the key, the value and what to write instead."""
    if raw is None:
        return TPTrainingConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {SECTION} must be an object like {{\"autotp_size\": 2}}, got {raw!r}.")
    try:
        section = TPTrainingConfig.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            known = sorted(IMPLEMENTED) if len(error["loc"]) == 1 else sorted(TPConfig.model_fields)
            close = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{source}: {SECTION}.{where} is not a key DeepSpeed 0.19.8 knows; known: "
                              f"{', '.join(known)}.{hint}") from None
        raise ConfigError(f"{source}: {SECTION}.{where}: {error['msg']} (got {error.get('input')!r}).") from None
    section.dtype = to_dtype(section.dtype, f"{source}: {SECTION}.dtype")
    _refuse_unsupported(section, source)
    return section


def to_dtype(value: Any, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    raise ConfigError(f"{where} = {value!r}: expected one of \"fp16\", \"bf16\", \"fp32\" (or a torch dtype).")


def _refuse_unsupported(section: TPTrainingConfig, source: str) -> None:
    where = f"{source}: {SECTION}"
    size = section.autotp_size
    if section.tensor_parallel.tp_size not in (1, size) and size > 1:
        raise ConfigError(f"{where}.tp.tp_size ({section.tensor_parallel.tp_size}) does not match "
                          f"{SECTION}.autotp_size ({size}); drop tp.tp_size or set it to {size}.")
    specs.resolve(section.preset_model, section.partition_config, source)  # its errors name the key
    if section.vocab_parallel_lm_head:
        raise ConfigError(f"{where}.vocab_parallel_lm_head = true: a vocabulary-parallel head with a distributed "
                          "loss is not supported by crew; remove it (crew splits lm_head by column and gathers "
                          "its output, as DeepSpeed does without it).")
    if section.vocab_parallel_ce_backend != "torch":
        raise ConfigError(f"{where}.vocab_parallel_ce_backend = {section.vocab_parallel_ce_backend!r}: only "
                          "\"torch\" is supported by crew.")
    if section.replace_with_kernel_inject:
        raise ConfigError(f"{where}.kernel_inject = true: inference kernel injection is not part of training; "
                          "remove it.")


def no_effect_keys(raw: Any) -> list[str]:
    """Keys set to anything but their default that crew accepts but does not act on."""
    if not isinstance(raw, dict):
        return []
    keys = [f"{SECTION}.{key}" for key, default in _NO_EFFECT.items() if raw.get(key, default) != default]
    tp = raw.get("tp") or raw.get("tensor_parallel") or {}
    if isinstance(tp, dict) and tp.get("tp_grain_size", 1) != 1:
        keys.append(f"{SECTION}.tp.tp_grain_size")
    return keys


def autotp_size(raw: Any) -> int:
    """autotp_size of a raw config dict (0 when absent); checked by parse()."""
    section = raw.get(SECTION) if isinstance(raw, dict) else None
    return parse(section).autotp_size if section is not None else 0
