"""AutoTP's split for models with neither a layer spec nor a Hugging Face tp_plan (Falcon): DeepSpeed 0.19.8's
heuristic parser, as layer specs.

DeepSpeed (module_inject/auto_tp.py tp_parser and _replace, replace_module.py set_lm_head), in training:
- the layers are the first module of each class found in a torch.nn.ModuleList; in each, the linears are listed in
  order, a LayerNorm (or a child named LayerNorm, layer_norm, ln_1, ln_2) as a marker, each named by its parent's
  name and its own ("self_attention.dense", ".dense" for a direct child);
- split by row (all-reduced): the linear just before a norm marker, any out_proj / o_proj / down_proj, and by the
  model's class name Falcon's self_attention.dense, GPT-NeoX's attention.dense, Mixtral's w2, Phi's self_attn.dense,
  ChatGLM's self_attention.dense and dense_4h_to_h; whole: MoE gates (mlp.gate, block_sparse_moe.gate) and
  DeepSeek's low-rank q_a_proj / kv_a_proj_with_mqa; by column: every other linear of every such layer, a fused
  qkv (qkv_proj, query_key_value, attn.Wqkv, self_attn.W_pack, c_attn) by its model's layout (Bloom's and
  Falcon's: one block, split as any column), a gate_up_proj as two halves; lm_head whole (set_lm_head does nothing
  in training: measured, Falcon's untied lm_head stays whole on every rank);
- the attributes that count heads or widths (num_heads, hidden_size, ...) of the modules above a split linear
  inside a layer are divided by the TP size, so the attention runs on the rank's heads (spec_split.shrinkable).

`plan(model)` gives that split as exact-name layer specs, for spec_split to check and apply; a model DeepSpeed
refuses (GPT-2, ...) or a fused layout crew does not cut (CodeGen's, GPTBigCode's, GLM's) gives a ConfigError.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from crew.errors import ConfigError
from crew.runtime.tensor_parallel.specs import PartitionConfig, parse

_NORM_NAMES = ("LayerNorm", "layer_norm", "ln_1", "ln_2")
_UNSUPPORTED = ("deberta", "flaubert", "fsmt", "gpt2", "led", "longformer", "xlm", "xlnet")
_FUSED_QKV = ("qkv_proj", "query_key_value", "attn.Wqkv", "self_attn.W_pack", "c_attn")
_ONE_BLOCK = ("BloomBlock", "FalconDecoderLayer")  # fused qkv layouts split as one block (DeepSpeed's bloomtype)
_WHOLE = ("q_a_proj", "kv_a_proj_with_mqa")


def plan(model: torch.nn.Module, where: str) -> PartitionConfig | None:
    """The specs, their scope the layers (whose inner attributes shrink), or None when no layer has a linear to
    split by row (DeepSpeed: "Not able to determine model policy automatically")."""
    _refuse_unsupported(model, where)
    rows_by_class = {type(layer): _row_names(model, layer) for layer in _layer_kinds(model)}
    rows_by_class = {kind: rows for kind, rows in rows_by_class.items() if rows}
    if not rows_by_class:
        return None
    specs, layers = [], [n for n, m in model.named_modules() if type(m) in rows_by_class]
    for layer_path in layers:
        layer = model.get_submodule(layer_path)
        for name, kind, extra in _linears(layer, rows_by_class[type(layer)], where):
            specs.append({"patterns": [rf"^{re.escape(f'{layer_path}.{name}')}\.weight$"], "partition_type": kind,
                          **extra})
    found = parse({"layer_specs": specs}, f"DeepSpeed's AutoTP parser for {type(model).__name__}")
    return dataclasses.replace(found, scope=tuple(layers))


def _refuse_unsupported(model: torch.nn.Module, where: str) -> None:
    """DeepSpeed's AutoTP.supported: the model's kind from its repr (": GPT2Model(" -> gpt2)."""
    text = str(model)
    found = re.search(r": (.*?)Model", text) or re.search(r": (.*?)Stack", text) or re.match(r"(.*?)Model", text)
    if found is not None and found.group(1).lower() in _UNSUPPORTED:
        raise ConfigError(f"{where}: DeepSpeed 0.19.8's AutoTP does not support {type(model).__name__} (\"AutoTP not "
                          "supported for model\"), and it has no Hugging Face tp_plan. Describe its split in "
                          "tensor_parallel.partition_config.layer_specs, or remove tensor_parallel.autotp_size.")


def _layer_kinds(model: torch.nn.Module) -> list[torch.nn.Module]:
    """DeepSpeed's get_module_list: the first module of each class inside a ModuleList, depth first."""
    found: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            found += [m for m in child.children() if not any(type(m) is type(f) for f in found)]
        else:
            found += [m for m in _layer_kinds(child) if not any(type(m) is type(f) for f in found)]
    return found


def _listing(parent: str, module: torch.nn.Module) -> list[str]:
    """DeepSpeed's get_layers: each linear as "<parent>.<name>", a norm as "ln"."""
    names = []
    for key, sub in module._modules.items():
        if isinstance(sub, torch.nn.Linear):
            names.append(f"{parent}.{key}")
        elif isinstance(sub, torch.nn.LayerNorm) or key in ("LayerNorm", "layer_norm"):
            names.append("ln")
        elif sub is not None:
            names += _listing(key, sub)
    return names


def _row_names(model: torch.nn.Module, layer: torch.nn.Module) -> set[str]:
    """DeepSpeed's tp_parser for one layer class: the names of its linears split by row."""
    names = []
    for key, sub in layer._modules.items():
        if isinstance(sub, torch.nn.Linear):
            names.append(f".{key}")
        elif isinstance(sub, torch.nn.LayerNorm) or key in _NORM_NAMES:
            names.append("ln")
        elif sub is not None:
            names += _listing(key, sub)
    model_name, layer_class = type(model).__name__, str(type(layer))
    rows = set()
    for i, name in enumerate(names):
        if name == "ln":
            if names[i - 1] != "ln":  # i - 1 = -1 at the start, as DeepSpeed's
                rows.add(names[i - 1])
        elif any(word in name for word in ("out_proj", "o_proj", "down_proj")) or \
                ("attention.dense" in name and "GPTNeoX" in model_name) or \
                ("self_attention.dense" in name and "falcon" in layer_class) or \
                ("w2" in name and "Mixtral" in layer_class) or ("self_attn.dense" in name and "Phi" in layer_class) or \
                (("self_attention.dense" in name or "dense_4h_to_h" in name) and "ChatGLM" in model_name):
            rows.add(name)
    return rows


def _linears(layer: torch.nn.Module, rows: set[str], where: str):
    """(path inside the layer, partition_type, extra spec keys) of each linear of one layer, by DeepSpeed's
    _replace, named as it names them (the parent's name and the linear's)."""
    for path, module in layer.named_modules():
        if not isinstance(module, torch.nn.Linear) or not path:
            continue
        parts = path.split(".")
        name = f"{parts[-2]}.{parts[-1]}" if len(parts) > 1 else f".{parts[-1]}"
        if name in ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate") or \
                any(word in name for word in _WHOLE):
            continue
        if "gate_up_proj" in name:
            yield path, "column", {"shape": [2, -1], "partition_dim": 0}
        elif name in rows or "down_proj" in name:
            yield path, "row", {}
        elif any(word in name for word in _FUSED_QKV):
            if type(layer).__name__ not in _ONE_BLOCK:
                raise ConfigError(f"{where}: '{path}' of {type(layer).__name__} is a fused q/k/v projection whose "
                                  "layout crew does not cut by itself (it knows Bloom's and Falcon's). Describe it in "
                                  "tensor_parallel.partition_config.layer_specs (a \"shape\" such as [3, -1]).")
            # one sub-parameter: cut as any column, recorded in checkpoints as DeepSpeed's fused_LinearLayer does
            yield path, "column", {"shape": [[module.out_features], module.in_features], "partition_dim": 0}
        else:
            yield path, "column", {}
