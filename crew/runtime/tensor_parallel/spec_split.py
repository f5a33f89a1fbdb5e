"""AutoTP's split by layer specs: a preset / partition_config (specs.py), or the model's Hugging Face tp_plan.

DeepSpeed 0.19.8 (runtime/engine.py _apply_autotp_partitioning, module_inject/auto_tp.py _replace_module with a
partition_config, module_inject/tp_plan_converter.py), in training:
- the specs come from the config's preset_model / partition_config; without those, from the model's tp_plan
  (config.base_model_tp_plan, the class's and the instance's _tp_plan), each entry a spec: "colwise" column,
  "colwise_rep" / "colwise_gather_output" column with the output gathered, "rowwise" row, "embedding_rowwise"
  skip, "replicated_with_grad_allreduce" skip with the gradient summed over the TP group. Any other style
  (Phi-3's "rowwise_split_input", Mixtral's "packed_colwise") makes DeepSpeed refuse the whole plan;
- every module with a 2-D weight is looked up by `<path>.weight` and split as its first matching spec says (and
  not descended into); a module no spec matches stays whole;
- a gathered column layer tied to an embedding stays whole, with the embedding.

crew does the same with its layers (layers.py, subparams.py). What DeepSpeed would split but crew does not (an
embedding, a row-parallel output head, a module that is not a torch.nn.Linear) is a ConfigError naming it; so is a
split that does not divide evenly (DeepSpeed splits unevenly, crew never does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from crew.errors import ConfigError
from crew.log import log_rank0
from crew.runtime.tensor_parallel.layers import LinearAllreduce, LinearLayer
from crew.runtime.tensor_parallel.specs import LayerSpec, PartitionConfig, parse
from crew.runtime.tensor_parallel.subparams import bias_layout, weight_layout

# (module class, child): a split of the child breaks the module's forward, in DeepSpeed 0.19.8 too (it fails in the
# first forward); crew says so before anything is split
_CANNOT_SPLIT = {("Phi3Attention", "qkv_proj"): "slices q, k and v out of its output at the whole model's widths "
                                                 "(config.num_attention_heads x head_dim), so it cannot run on a "
                                                 "rank's share of the heads",
                 ("BloomAttention", "query_key_value"): "adds an ALiBi bias that BloomModel builds for all the heads, "
                                                        "so it cannot run on a rank's share of them"}
# what a module says about its heads and widths: divided by the TP size above a split linear (DeepSpeed's
# update_mp_params), so that an attention reading self.num_heads runs on this rank's heads
_COUNTS = ("n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads", "all_head_size",
           "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads", "kv_n_heads", "d_model",
           "num_attention_heads_per_partition", "num_multi_query_groups_per_partition", "hidden_size_per_partition")
SUMMED = "crew_tp_grad_summed"  # a whole parameter whose gradient is summed over the TP group (hooked once)
_STYLES = {"colwise": ("column", False), "colwise_rep": ("column", True), "colwise_gather_output": ("column", True),
           "rowwise": ("row", False), "embedding_rowwise": ("skip", False),
           "replicated_with_grad_allreduce": ("skip", False)}


def hf_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """The model's merged Hugging Face tp_plan (DeepSpeed's _get_hf_tp_plan), or None."""
    config = getattr(model, "config", None)
    merged, seen = {}, set()
    for plan in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
                 vars(model).get("_tp_plan")):
        for pattern, style in (plan or {}).items() if isinstance(plan, dict) else ():
            short = pattern.removeprefix("model.")
            if pattern.startswith("model.") and short in seen:
                continue
            merged[pattern] = style
            seen.add(short)
    return merged or None


def from_hf_plan(model: torch.nn.Module, plan: dict[str, str], where: str) -> PartitionConfig:
    """TPPlanConverter.convert: one spec per entry, `*` any text, `.weight$` appended."""
    unknown = sorted({style for style in plan.values() if style.lower() not in _STYLES})
    if unknown:
        raise ConfigError(
            f"{where}: {type(model).__name__}'s Hugging Face tp_plan uses {unknown}, which DeepSpeed 0.19.8's AutoTP "
            "does not convert (it refuses the model too). Describe the split in "
            "tensor_parallel.partition_config.layer_specs, or remove tensor_parallel.autotp_size.")
    specs = []
    for pattern, style in plan.items():
        kind, gather = _STYLES[style.lower()]
        regex = ".*" + pattern.replace(".", r"\.").replace("*", ".*")
        regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
        specs.append({"patterns": [regex], "partition_type": kind, "gather_output": gather,
                      "grad_allreduce": style.lower() == "replicated_with_grad_allreduce"})
    return parse({"layer_specs": specs}, f"{type(model).__name__}'s Hugging Face tp_plan")


def targets(model: torch.nn.Module, config: PartitionConfig) -> list[tuple[str, torch.nn.Module, LayerSpec]]:
    """(module path, module, spec) of each module the specs split, in DeepSpeed's walk: a module with a 2-D weight
    is looked up and not descended into."""
    found, kind = [], _model_type(model)
    tied = _tied_gathered(model, config, kind)

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            weight = getattr(child, "weight", None)
            if path in tied or not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
                if path not in tied:
                    walk(child, path)
                continue
            spec = config.find(f"{path}.weight", kind)
            if spec is None and config.strict_mode and not isinstance(child, torch.nn.Embedding):
                raise ConfigError(f"{config.source}.strict_mode: no layer spec matches '{path}.weight' "
                                  f"({type(child).__name__}); add a spec for it (partition_type \"skip\" keeps it "
                                  "whole), or set strict_mode false.")
            if spec is not None and spec.partition_type != "skip":
                found.append((path, child, spec))
    walk(model, "")
    return found


def check(model: torch.nn.Module, config: PartitionConfig, size: int, where: str) -> None:
    """Before anything is split: each matched module is one crew splits, evenly."""
    heads = set(config.lm_head_patterns)
    found = targets(model, config)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for path, name, value in shrinkable(model, config, {path for path, _, _ in found}):
        _divides(value, size, f"{where}: {type(model.get_submodule(path)).__name__} '{path}'.{name} ({value}), "
                              "which DeepSpeed divides by the TP size above a split linear,")
    for path, module, spec in found:
        what = f"{where}: '{path}' ({type(module).__name__}, matched by {config.source} {list(spec.patterns)})"
        if isinstance(module, torch.nn.Embedding):
            raise ConfigError(f"{what} is an embedding, which crew does not split; give it partition_type \"skip\".")
        if not isinstance(module, torch.nn.Linear):
            raise ConfigError(f"{what}: crew splits torch.nn.Linear layers only; give it partition_type \"skip\".")
        parent, _, leaf = path.rpartition(".")
        broken = _CANNOT_SPLIT.get((type(model.get_submodule(parent)).__name__, leaf))
        if broken:
            raise ConfigError(f"{what}: {type(model.get_submodule(parent)).__name__} {broken}. Keep '{leaf}' and its "
                              "attention whole (a layer spec with partition_type \"skip\" before the others), as "
                              "DeepSpeed 0.19.8 fails there too.")
        if id(module.weight) in tied and spec.partition_type != "skip" and not spec.gather_output:
            raise ConfigError(f"{what} shares its weight with an embedding, which stays whole; give it gather_output "
                              "true (a tied head is then kept whole with its embedding, as DeepSpeed keeps it) or "
                              "partition_type \"skip\".")
        if spec.partition_type == "row" and leaf in heads:
            raise ConfigError(f"{what}: a row-parallel output head is not supported by crew; split it by column "
                              "with gather_output true, or skip it.")
        if spec.shape is None:  # the layers cut rows (column) or columns (row); partition_dim needs a shape,
            cut = 0 if spec.partition_type == "column" else 1  # as in DeepSpeed's, which ignores it otherwise
            length = module.weight.shape[cut]
            _divides(length, size, f"{what} along dim {cut} ({length})")
            continue
        layout = weight_layout(tuple(module.weight.shape), spec.shape, spec.dim, what)
        last = len(layout.logical) - 1
        if (spec.partition_type == "row") != (layout.dim == last):
            side = "its last (input) dim" if spec.partition_type == "row" else "an output dim, not the last"
            raise ConfigError(f"{what}: a {spec.partition_type} split of shape {list(layout.logical)} must cut "
                              f"{side}; fix partition_dim ({layout.dim}).")
        if spec.gather_output:
            raise ConfigError(f"{what}: gather_output with a shape is not supported (DeepSpeed 0.19.8 refuses it too); "
                              "drop one of them.")
        for length in layout.sizes:
            _divides(length, size, f"{what}: a sub-parameter of {length} along dim {layout.dim}")


def shrinkable(model: torch.nn.Module, config: PartitionConfig, split: set[str]) -> list[tuple[str, str, int]]:
    """(module path, attribute, value) of each head count / width DeepSpeed divides by the TP size: on each module
    above a split linear (inside config.scope, the root excluded) that holds no weight of 3 or more dims."""
    found = []
    for path, module in model.named_modules():
        inside = config.scope is None or any(path.startswith(f"{root}.") for root in config.scope)
        if not path or path in split or not inside or not any(s.startswith(f"{path}.") for s in split):
            continue
        mine = list(module.parameters(recurse=False)) + [p for c in module.children() for p in c.parameters(False)]
        if any(param.dim() >= 3 for param in mine):
            continue
        found += [(path, name, getattr(module, name)) for name in _COUNTS
                  if isinstance(getattr(module, name, None), int) and not isinstance(getattr(module, name), bool)]
    return found


def replace(model: torch.nn.Module, config: PartitionConfig, group) -> dict[int, torch.nn.Parameter]:
    """Swap the matched linears for their TP slices, in place; {id(whole param): its slice}."""
    replaced: dict[int, torch.nn.Parameter] = {}
    split = targets(model, config)
    for path, module, spec in split:
        new = _layer(module, spec, group, path)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        replaced[id(module.weight)] = new.weight
        if module.bias is not None:
            replaced[id(module.bias)] = new.bias
    size = dist.get_world_size(group)
    for path, name, value in shrinkable(model, config, {path for path, _, _ in split}):
        setattr(model.get_submodule(path), name, value // size)
    _sum_grads(model, config, group)
    log_rank0("AutoTP: %d linears split over %d ranks by %s", len(split), dist.get_world_size(group), config.source)
    if not split:
        log_rank0("AutoTP: no layer spec of %s matches a module of %s: nothing is split", config.source,
                  type(model).__name__)
    return replaced


def _layer(module: torch.nn.Linear, spec: LayerSpec, group, path: str) -> torch.nn.Module:
    layout = None if spec.shape is None else weight_layout(tuple(module.weight.shape), spec.shape, spec.dim, path)
    if spec.partition_type == "row":
        return LinearAllreduce(module, group, name=path, layout=layout)
    bias = None if layout is None or module.bias is None else bias_layout(layout, tuple(module.bias.shape))
    return LinearLayer(module, group, gather_output=spec.gather_output, name=path, layout=layout, bias_layout=bias)


def _sum_grads(model: torch.nn.Module, config: PartitionConfig, group) -> None:
    """grad_allreduce specs: whole parameters that act on this rank's share (Qwen3's q_norm), so their gradients
    are summed over the TP group (DeepSpeed's register_replicated_grad_hooks)."""
    kind = _model_type(model)
    for name, param in model.named_parameters():
        spec = config.find(name, kind)
        if spec is not None and spec.grad_allreduce and param.requires_grad:
            sum_grad_over(param, group)


def sum_grad_over(param: torch.nn.Parameter, group) -> None:
    """Sum `param`'s gradient over `group` in its backward, once (marked SUMMED)."""
    if getattr(param, SUMMED, False):
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)
    setattr(param, SUMMED, True)


def _tied_gathered(model: torch.nn.Module, config: PartitionConfig, kind: str | None) -> set[str]:
    """Gathered column layers tied to an embedding, and those embeddings: whole (DeepSpeed's
    _configure_gathered_column_tie_fallbacks)."""
    embeddings = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    whole = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not name or isinstance(module, torch.nn.Embedding) or id(weight) not in embeddings:
            continue
        spec = config.find(f"{name}.weight", kind)
        if spec is not None and spec.partition_type == "column" and spec.gather_output:
            whole |= {name, embeddings[id(weight)]}
    return whole


def _model_type(model: torch.nn.Module) -> str | None:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return str(kind).lower() if kind else None


def _divides(length: int, size: int, what: str) -> None:
    if length % size:
        raise ConfigError(f"{what} does not divide by tensor_parallel.autotp_size = {size}: crew splits evenly "
                          "(DeepSpeed would give the ranks unequal parts). Set autotp_size to a divisor of "
                          f"{length}.")
