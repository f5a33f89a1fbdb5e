"""What becomes of a model's tensors under bf16/fp16 training, as in DeepSpeed 0.19.8's engine
(`_cast_module_mixed_precision`, deepspeed/runtime/keep_in_fp32.py):

- floating-point parameters take the training dtype;
- buffers keep the dtype they were loaded with (a rotary embedding's fp32 `inv_freq`, whose bf16 rounding
  would blur positions), unless the config's `data_types.buffer_dtype` names one. One exception, where
  DeepSpeed fails: the running statistics of torch's BatchNorm and InstanceNorm layers, which torch wants
  in their weights' dtype ("expected scalar type BFloat16 but found Float"), take the training dtype;
- buffers named by `data_types.keep_in_fp32_modules` stay in (or are brought back to) fp32. Its default
  "auto" takes a transformers model's own lists: `_keep_in_fp32_modules_strict`, and under fp16 also
  `_keep_in_fp32_modules` (an MoE router's `e_score_correction_bias`, whose values bf16 cannot tell apart);
  a list gives name patterns (`*` for any characters, matched anywhere in the full name); `[]` keeps none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from crew.errors import ConfigError

CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPES = {**dict.fromkeys(("fp32", "float32", "float", "torch.float32"), torch.float32),  # DeepSpeed's DtypeEnum
           **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), torch.float16),
           **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), torch.bfloat16)}


def dtype_named(value: Any, key: str) -> torch.dtype:
    """A config value naming a dtype in any of DeepSpeed's spellings ("bf16", "bfloat16", ...), or a torch dtype;
    a ConfigError naming `key` otherwise."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ConfigError(f"{key} is {value!r}; use one of \"fp32\", \"fp16\" or \"bf16\".")


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter (tied ones once) to `dtype`; buffers are `cast_buffers`' business."""
    for param in module.parameters():
        if param.dtype in CASTABLE and param.dtype != dtype:
            param.data = param.data.to(dtype)


def cast_buffers(module: torch.nn.Module, dtype: torch.dtype, data_types: Mapping[str, Any] | None) -> None:
    """The buffers of a model training in `dtype`, by the config's `data_types` section (checked at any dtype;
    under fp32 nothing changes)."""
    section = data_types if isinstance(data_types, Mapping) else {}
    pattern = keep_in_fp32_pattern(module, section.get("keep_in_fp32_modules", "auto"), dtype)
    value = section.get("buffer_dtype")
    target = None if value is None else dtype_named(value, "data_types.buffer_dtype")
    if dtype == torch.float32:
        return
    kept = buffers_matching(module, pattern) if pattern is not None else []
    for buffer in kept:
        if buffer.dtype != torch.float32:
            buffer.data = buffer.data.float()
    keep = {id(buffer) for buffer in kept}
    for buffer in module.buffers() if target is not None else _norm_statistics(module):
        if id(buffer) not in keep and buffer.dtype in CASTABLE and buffer.dtype != (target or dtype):
            buffer.data = buffer.data.to(target or dtype)


def _norm_statistics(module: torch.nn.Module) -> list[torch.Tensor]:
    """The floating-point running statistics of the BatchNorm/InstanceNorm layers in `module`."""
    return [buffer for child in module.modules() if isinstance(child, torch.nn.modules.batchnorm._NormBase)
            for buffer in child.buffers(recurse=False) if buffer.is_floating_point()]


def keep_in_fp32_pattern(module: torch.nn.Module, setting: Any, dtype: torch.dtype) -> re.Pattern | None:
    """The names of the buffers to keep in fp32, as one pattern; None when there are none (always under fp32)."""
    if setting == "auto" or setting is None:
        patterns = set()
        for name, child in module.named_modules():
            listed = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                listed |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            patterns |= {rf"^{re.escape(name)}\..*{item.replace('*', '.*')}" if name else item.replace("*", ".*")
                         for item in listed}
    elif isinstance(setting, list) and all(isinstance(item, str) for item in setting):
        patterns = {item.replace("*", ".*") for item in setting}
    else:
        raise ConfigError(f"data_types.keep_in_fp32_modules is {setting!r}: it must be \"auto\" (a transformers "
                          "model's own lists) or a list of name patterns, e.g. [\"e_score_correction_bias\"].")
    if not patterns or dtype not in (torch.float16, torch.bfloat16):
        return None
    return re.compile("|".join(sorted(patterns)))


def buffers_matching(module: torch.nn.Module, pattern: re.Pattern) -> list[torch.Tensor]:
    """The floating-point buffers whose full names `pattern` finds."""
    return [buffer for name, buffer in module.named_buffers()
            if buffer is not None and buffer.is_floating_point() and pattern.search(name)]
