"""AutoTP's module replacement: what splits a model, and the split by name for LLaMA-style decoders.

What DeepSpeed 0.19.8 splits a model by, in training (runtime/engine.py _apply_autotp_partitioning), and crew too
(`partitioning`): the config's preset_model / partition_config (specs.py); else the model's Hugging Face tp_plan
(spec_split.py); else its heuristic parser (heuristic.py: Falcon). crew keeps its split by name for the decoders
whose names it knows (the same split as their tp_plan gives) and takes the tp_plan, or the parser, for others.

The split by name, as DeepSpeed's AutoTP (module_inject/auto_tp.py):
    q_proj k_proj v_proj gate_proj up_proj    LinearLayer (column)
    o_proj down_proj                          LinearAllreduce (row, all-reduced)
    lm_head / embed_out                       LinearLayer(gather_output=True): the vocabulary split, the logits
                                              gathered whole; kept whole when tied to the embedding or when the
                                              vocabulary does not split evenly
Embeddings, norms and any other linear stay whole on every rank. Qwen3's q_norm / k_norm are whole but act on
this rank's heads only, so their gradients are summed over the TP group (DeepSpeed's grad_allreduce hooks).
"""

from __future__ import annotations

import torch

from crew.errors import ConfigError
from crew.log import log_rank0
from crew.runtime.tensor_parallel import heuristic, spec_split, specs
from crew.runtime.tensor_parallel.layers import LinearAllreduce, LinearLayer

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW = frozenset({"o_proj", "down_proj"})
HEAD = frozenset({"lm_head", "embed_out"})
PER_HEAD_NORMS = frozenset({"q_norm", "k_norm"})
_SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def partitioning(model: torch.nn.Module, section=None,
                 where: str = "tensor_parallel.autotp_size") -> specs.PartitionConfig | None:
    """The specs `model` is split by (the config's, else its tp_plan's), or None: by name."""
    if section is not None:
        config = specs.resolve(section.preset_model, section.partition_config)
        if config is not None:
            return config
    plan = spec_split.hf_plan(model)
    if plan:
        converted = spec_split.from_hf_plan(model, plan, where)  # refused where DeepSpeed refuses
        return None if _knows(model) else converted
    return None if _knows(model) else heuristic.plan(model, where)


def _knows(model: torch.nn.Module) -> bool:
    """Whether the split by name applies: a q/k/v or gate/up beside each o_proj / down_proj."""
    named = False
    for _, module in model.named_modules():
        children = {child for child, sub in module.named_children() if isinstance(sub, torch.nn.Linear)}
        for row, feeds in _FEEDS.items():
            if row in children:
                named = True
                if not feeds <= children:
                    return False
    return named


def check_model(model: torch.nn.Module, size: int, section=None, where: str = "tensor_parallel.autotp_size") -> None:
    """Before anything is split: the model is one AutoTP knows and its sizes divide by `size`."""
    config = partitioning(model, section, where)
    if config is not None:  # what the specs split is checked there (head counts: only above a split linear)
        spec_split.check(model, config, size, where)
        return
    _check_sizes(model, size, where)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if not any(_leaf(name) in COLUMN | ROW for name, _ in linears):
        first = next(((name, type(m).__name__) for name, m in linears), None)
        seen = f"its first linear is '{first[0]}' ({first[1]})" if first else "it has no torch.nn.Linear"
        raise ConfigError(
            f"{where} = {size}: AutoTP does not know the architecture of {type(model).__name__}: {seen}, and no "
            f"linear is named one of {sorted(COLUMN | ROW)} (LLaMA/Qwen2/Qwen3/Mistral-style decoders) and it has no "
            "Hugging Face tp_plan. Describe its split in tensor_parallel.partition_config.layer_specs (or pick a "
            f"preset_model: {', '.join(specs.PRESETS)}), or remove tensor_parallel.autotp_size to train it with data "
            "parallelism.")
    _refuse_unpaired_rows(model, size, where)
    for name, module in linears:
        leaf = _leaf(name)
        dim = module.out_features if leaf in COLUMN else module.in_features if leaf in ROW else None
        if dim is not None and dim % size:
            raise ConfigError(f"{where} = {size} does not divide '{name}' ({type(module).__name__}, "
                              f"{module.in_features} -> {module.out_features}) along the dimension it is split on "
                              f"({dim}). Set autotp_size to a divisor of {dim}.")


def _check_sizes(model: torch.nn.Module, size: int, where: str) -> None:
    config = _text_config(getattr(model, "config", None))
    for attribute in _SPLIT_SIZES:
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value % size:
            raise ConfigError(
                f"{where} = {size} does not divide the model's {attribute} ({value}, "
                f"{type(model).__name__}.config.{attribute}): each TP rank takes an equal share. Set autotp_size "
                f"to a divisor of {value}.")


_FEEDS = {"o_proj": {"q_proj", "k_proj", "v_proj"}, "down_proj": {"up_proj"}}  # row split <- column splits


def _refuse_unpaired_rows(model: torch.nn.Module, size: int, where: str) -> None:
    """A row-split linear takes the column-split outputs of its siblings; without them (fused qkv_proj or
    gate_up_proj, as Phi-3's) its input would be whole, so the model is one AutoTP does not know."""
    for name, module in model.named_modules():
        children = {child for child, sub in module.named_children() if isinstance(sub, torch.nn.Linear)}
        for row, feeds in _FEEDS.items():
            if row in children and not feeds <= children:
                others = sorted(children - {row}) or ["none"]
                raise ConfigError(
                    f"{where} = {size}: AutoTP does not know '{name}' ({type(module).__name__}): its '{row}' is "
                    f"split by row, which needs {sorted(feeds)} beside it to split by column, but its linears are "
                    f"{others} (fused projections are split by a partition_config's layer spec with a \"shape\", "
                    "not by name). Describe the split in tensor_parallel.partition_config.layer_specs, or remove "
                    f"{where} to train this model with data parallelism.")


def replace(model: torch.nn.Module, group, size: int, section=None) -> dict[int, torch.nn.Parameter]:
    """Swap the model's linears for their TP slices, in place. Returns {id(whole param): its slice}, for
    optimizers and parameter lists taken before the split."""
    config = partitioning(model, section)
    if config is not None:
        replaced = spec_split.replace(model, config, group)
        _sum_per_head_norm_grads(model, group)
        model.ds_autotp_parsed = True
        return replaced
    replaced: dict[int, torch.nn.Parameter] = {}
    tied = _tied_head(model)
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = _leaf(name)
        if leaf in COLUMN:
            new = LinearLayer(module, group, name=name)
        elif leaf in ROW:
            new = LinearAllreduce(module, group, name=name)
        elif leaf in HEAD and not tied and module.out_features % size == 0:
            new = LinearLayer(module, group, gather_output=True, name=name)
        else:
            continue
        _set(model, name, new)
        replaced[id(module.weight)] = new.weight
        if module.bias is not None:
            replaced[id(module.bias)] = new.bias
    _sum_per_head_norm_grads(model, group)
    model.ds_autotp_parsed = True
    log_rank0("AutoTP: %d linears split over %d ranks%s", sum(isinstance(m, (LinearLayer, LinearAllreduce))
              for m in model.modules()), size, " (lm_head kept whole: tied to the embedding)" if tied else "")
    return replaced


def _sum_per_head_norm_grads(model: torch.nn.Module, group) -> None:
    """q_norm / k_norm beside a column-split q_proj / k_proj, unless a grad_allreduce spec sums them already
    (DeepSpeed's presets do not: its Qwen3 ranks drift apart under preset_model "qwen2")."""
    for name, param in model.named_parameters():
        parts = name.split(".")
        if len(parts) < 3 or parts[-2] not in PER_HEAD_NORMS or not param.requires_grad:
            continue
        projection = getattr(model.get_submodule(".".join(parts[:-2])), parts[-2][0] + "_proj", None)
        if isinstance(projection, LinearLayer) and not projection.gather_output:
            spec_split.sum_grad_over(param, group)


def _tied_head(model: torch.nn.Module) -> bool:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return any(isinstance(m, torch.nn.Linear) and _leaf(n) in HEAD and id(m.weight) in embeddings
               for n, m in model.named_modules())


def _text_config(config):
    text = getattr(config, "text_config", None) if config is not None else None
    return text if text is not None else config


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _set(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
