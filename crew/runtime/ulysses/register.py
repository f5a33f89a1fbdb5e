"""register_with_transformers: put Ulysses attention where a Hugging Face model calls its core attention.

As DeepSpeed 0.19.8, the wrapper replaces transformers' ALL_ATTENTION_FUNCTIONS[core_attn_implementation] itself
(not a new "ulysses" key), so every branch transformers takes on `config._attn_implementation == "sdpa"` still
runs. The replacement is process-wide: every model of this process that uses that implementation goes through it.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from crew.errors import ConfigError, CrewError

logger = logging.getLogger(__name__)

UNSUPPORTED_ATTENTION = ("eager", "paged|eager")
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")  # e.g. kernels-community/flash-attn2


def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                               micro_batch_size, seq_length=None, seq_length_is_variable=True,
                               disable_in_eval=False, max_length=None):
    """UlyssesSPAttentionHF.register_with_transformers; returns the mpu module (parallel_state_sp)."""
    if sequence_parallel_size == 1:
        return None
    if max_length is not None:
        logger.warning("register_with_transformers(max_length=...) is deprecated and will be removed: pass "
                       "seq_length instead.")
        seq_length = max_length if seq_length is None else seq_length
    if not seq_length_is_variable and seq_length is None:
        raise ConfigError("register_with_transformers(seq_length_is_variable=False) needs seq_length=<the fixed "
                          "length of every batch>; or pass seq_length_is_variable=True.")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from crew.deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    model_config = _model_config(model_name_or_path, core_attn_implementation)
    core = _core_attention(core_attn_implementation, ALL_ATTENTION_FUNCTIONS)
    mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
    arch = model_config.get_text_config()
    attention = cls(
        attn=core, batch_size=micro_batch_size, attn_head_count=arch.num_attention_heads,
        attn_head_size=getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads,
        kv_head_count=getattr(arch, "num_key_value_heads", None) or arch.num_attention_heads,
        num_hidden_layers=arch.num_hidden_layers, process_group=mpu.get_sequence_parallel_group(),
        seq_length_is_variable=seq_length_is_variable,
        local_seq_length=None if seq_length_is_variable else seq_length // sequence_parallel_size,
        global_seq_length=None if seq_length_is_variable else seq_length, disable_in_eval=disable_in_eval)
    attention.core_attn_implementation = core_attn_implementation
    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = _wrapper(attention, core_attn_implementation)
    return mpu


def _model_config(model_name_or_path, core_attn_implementation):
    """The model's config; for a loaded model, checked against core_attn_implementation."""
    if isinstance(model_name_or_path, (str, os.PathLike)):
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(model_name_or_path)  # not loaded: its attn implementation is not resolved
    name = type(model_name_or_path).__name__
    config = getattr(model_name_or_path, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise CrewError(f"register_with_transformers(model_name_or_path={name}): Ulysses SP swaps the attention of a "
                        "Hugging Face transformers model (or a wrapper with its `.config`, as PEFT's), and this "
                        f"{name} has no transformers config. Pass a transformers PreTrainedModel, its hub name or "
                        "its local path.")
    loaded = getattr(config, "_attn_implementation", None)
    if loaded is None:
        raise CrewError(f"register_with_transformers(model_name_or_path={name}): its config has no "
                        "_attn_implementation, so its attention is not called through transformers' "
                        "ALL_ATTENTION_FUNCTIONS and Ulysses SP cannot take its place. Load the model with "
                        f"attn_implementation='{core_attn_implementation}'.")
    if loaded != core_attn_implementation:
        raise ConfigError(f"register_with_transformers(core_attn_implementation='{core_attn_implementation}'), but "
                          f"the {name} was loaded with attn_implementation='{loaded}': the wrapper would never be "
                          "called. Set both to the same value (load the model with attn_implementation="
                          f"'{core_attn_implementation}', or pass core_attn_implementation='{loaded}').")
    return config


def _core_attention(name, functions):
    if name in UNSUPPORTED_ATTENTION:
        raise ConfigError(f"register_with_transformers(core_attn_implementation='{name}'): {name} attention is not "
                          "supported by Ulysses sequence parallelism, as it needs a 4D attention_mask (memory "
                          "quadratic in the sequence length). Use 'sdpa', 'flex_attention', a flash attention "
                          "variant, or a hub kernel (e.g. 'kernels-community/flash-attn2'), and load the model "
                          "with the same attn_implementation.")
    if isinstance(name, str) and _HUB_KERNEL.search(name):
        try:
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
        except ImportError as error:
            raise CrewError(f"core_attn_implementation='{name}' is a hub kernel, which needs a transformers that has "
                            "modeling_flash_attention_utils.lazy_import_flash_attention: upgrade transformers."
                            ) from error
        lazy_import_flash_attention(name)  # hub kernels register on first use
    if name not in functions:
        raise ConfigError(f"register_with_transformers(core_attn_implementation='{name}'): not an attention "
                          f"implementation transformers knows; the choices are {functions.valid_keys()}.")
    return functions[name]


def _wrapper(attention, core_name):
    """What transformers calls in place of the core attention: the mask dropped (position_ids carry causality,
    and a mask built for the local tokens is wrong for the gathered ones), but a flex BlockMask, rebuilt later."""

    def ulysses_attention(module: torch.nn.Module, query, key, value, attention_mask, *args, **kwargs):
        if not _is_block_mask(attention_mask, core_name):
            attention_mask = None
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    return ulysses_attention


def _is_block_mask(mask, core_name) -> bool:
    if core_name != "flex_attention":
        return False
    from torch.nn.attention.flex_attention import BlockMask
    return isinstance(mask, BlockMask)
