"""AutoTP's layer specifications: `tensor_parallel.partition_config` and `tensor_parallel.preset_model`.

DeepSpeed 0.19.8 (module_inject/autotp_config.py, runtime/tensor_parallel/config.py): a partition_config is a list of
layer_specs, each a set of regular expressions `re.match`ed against the weight's name (`<module path>.weight`) and
what to do with a module they match: "column" (split the output rows), "row" (split the input columns, the outputs
all-reduced) or "skip" (whole on every rank). A `shape` views a fused weight as sub-parameters, each split on its
own along `partition_dim` (Phi-3's gate_up_proj as [2, -1]: each rank takes its share of gate and of up; a nested
list gives unequal sizes, [[q, k, v], -1]). `preset_model` names one of DeepSpeed's built-in lists (PRESETS); a
partition_config beside a preset is put in front of it when `use_default_specs` (its default) is true, and replaces
it otherwise. The first spec that matches wins; a module no spec matches stays whole (`strict_mode`: an error).

crew reads the same keys with the same meaning (`resolve`); what DeepSpeed would only find out at the first forward
(a pattern that is no regular expression, a shape of the wrong form) is a ConfigError naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from crew.errors import ConfigError
from crew.log import log_rank0

WHERE = "tensor_parallel.partition_config"
KINDS = ("column", "row", "skip")
_SPEC_KEYS = {"patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output",
              "grad_allreduce"}
_CONFIG_KEYS = {"layer_specs", "tp_size", "embedding_partition_dim", "lm_head_patterns", "use_default_specs",
                "strict_mode"}


@dataclass(frozen=True)
class LayerSpec:
    patterns: tuple[str, ...]
    partition_type: str = "column"
    shape: tuple | None = None
    partition_dim: int | None = None
    model_types: tuple[str, ...] | None = None
    gather_output: bool = False
    grad_allreduce: bool = False

    @property
    def dim(self) -> int:
        """The dim of `shape` (or of the 2-D weight) that is split: DeepSpeed's default 0 for column, 1 for row."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == "column" else 1

    def matches(self, name: str, model_type: str | None) -> bool:
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {str(t).lower() for t in self.model_types}:
                return False
        return any(re.match(pattern, name) for pattern in self.patterns)


@dataclass(frozen=True)
class PartitionConfig:
    layer_specs: tuple[LayerSpec, ...] = ()
    lm_head_patterns: tuple[str, ...] = ("lm_head", "embed_out")
    use_default_specs: bool = True
    strict_mode: bool = False
    embedding_partition_dim: int = 1
    source: str = WHERE  # what the specs came from, for messages
    scope: tuple[str, ...] | None = None  # the modules inside which head counts shrink; None: the whole model

    def find(self, name: str, model_type: str | None) -> LayerSpec | None:
        """The first spec matching the parameter name `name` (DeepSpeed's find_matching_spec)."""
        return next((spec for spec in self.layer_specs if spec.matches(name, model_type)), None)


def _column(*patterns, **extra) -> dict:
    return {"patterns": list(patterns), "partition_type": "column", **extra}


def _row(*patterns) -> dict:
    return {"patterns": list(patterns), "partition_type": "row"}


_ATTN_O, _ATTN_QKV = r".*\.self_attn\.o_proj\.weight$", r".*\.self_attn\.[qkv]_proj\.weight$"
_MLP_DOWN, _MLP_UP = r".*\.mlp\.down_proj\.weight$", r".*\.mlp\.(up|gate)_proj\.weight$"
_LLAMA = [_row(_ATTN_O), _column(_ATTN_QKV), _row(_MLP_DOWN), _column(_MLP_UP)]
# DeepSpeed 0.19.8's AutoTPPresets, spec for spec
PRESETS = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "bloom": [_row(r".*\.self_attention\.dense\.weight$"), _column(r".*\.self_attention\.query_key_value\.weight$"),
              _row(r".*\.mlp\.dense_4h_to_h\.weight$"), _column(r".*\.mlp\.dense_h_to_4h\.weight$")],
    "chatglm": [_row(r".*\.self_attention\.dense\.weight$"),
                _column(r".*\.self_attention\.query_key_value\.weight$", shape=[3, -1], partition_dim=0),
                _row(r".*\.mlp\.dense_4h_to_h\.weight$"),
                _column(r".*\.mlp\.dense_h_to_4h\.weight$", shape=[2, -1], partition_dim=0)],
    "mixtral": [_row(_ATTN_O), _column(_ATTN_QKV), _row(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
                _column(r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
                {"patterns": [r".*\.block_sparse_moe\.gate\.weight$"], "partition_type": "skip"}],
    "deepseek_v2": [_row(_ATTN_O),
                    {"patterns": [r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"], "partition_type": "skip"},
                    _column(r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"),
                    _row(r".*\.mlp\.experts\.\d+\.down_proj\.weight$"),
                    _column(r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"),
                    {"patterns": [r".*\.mlp\.gate\.weight$"], "partition_type": "skip"},
                    _row(r".*\.mlp\.shared_experts\.down_proj\.weight$"),
                    _column(r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$")],
    "phi3": [_row(_ATTN_O), _column(r".*\.self_attn\.qkv_proj\.weight$", shape=[3, -1], partition_dim=0),
             _row(_MLP_DOWN), _column(r".*\.mlp\.gate_up_proj\.weight$", shape=[2, -1], partition_dim=0)],
}


def resolve(preset: str | None, partition_config: dict | None, source: str = "<dict>") -> PartitionConfig | None:
    """DeepSpeed's TPTrainingConfig.get_partition_config_object: the preset, the partition_config, or the
    partition_config's specs in front of the preset's; None when neither is set (the automatic split)."""
    base = None
    if preset:
        if preset.lower() not in PRESETS:
            raise ConfigError(f"{source}: tensor_parallel.preset_model = {preset!r} is not one of DeepSpeed's presets "
                              f"({', '.join(PRESETS)}); pick one, or describe the layers in "
                              "tensor_parallel.partition_config.layer_specs.")
        base = parse({"layer_specs": PRESETS[preset.lower()]}, f"tensor_parallel.preset_model {preset!r}")
    if partition_config is None or partition_config == {}:  # DeepSpeed's `if self.partition_config:`
        return base
    custom = parse(partition_config, f"{source}: {WHERE}")
    if base is None or not custom.use_default_specs:
        return custom
    return PartitionConfig(layer_specs=custom.layer_specs + base.layer_specs,
                           lm_head_patterns=custom.lm_head_patterns or base.lm_head_patterns,
                           use_default_specs=True, strict_mode=custom.strict_mode,
                           embedding_partition_dim=custom.embedding_partition_dim,
                           source=f"{WHERE} with preset_model {preset!r}")


def parse(raw, where: str = WHERE) -> PartitionConfig:
    """AutoTPConfig.from_dict, checked: each error names the key (`where`.layer_specs[i].shape, ...)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object like {{\"layer_specs\": [{{\"patterns\": [\".*\\\\.o_proj\\\\."
                          f"weight$\"], \"partition_type\": \"row\"}}]}}, got {raw!r}.")
    _note_unknown(raw, _CONFIG_KEYS, where)
    specs = raw.get("layer_specs", [])
    if not isinstance(specs, list):
        raise ConfigError(f"{where}.layer_specs must be a list of objects, got {specs!r}.")
    heads = raw.get("lm_head_patterns", ["lm_head", "embed_out"])
    if not isinstance(heads, list) or not all(isinstance(h, str) for h in heads):
        raise ConfigError(f"{where}.lm_head_patterns must be a list of module names, got {heads!r}.")
    return PartitionConfig(layer_specs=tuple(_spec(spec, f"{where}.layer_specs[{i}]") for i, spec in enumerate(specs)),
                           lm_head_patterns=tuple(heads),
                           use_default_specs=_flag(raw, "use_default_specs", True, where),
                           strict_mode=_flag(raw, "strict_mode", False, where),
                           embedding_partition_dim=raw.get("embedding_partition_dim", 1), source=where)


def _spec(raw, where: str) -> LayerSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object with \"patterns\" and \"partition_type\", got {raw!r}.")
    _note_unknown(raw, _SPEC_KEYS, where)
    patterns = raw.get("patterns", [])
    if isinstance(patterns, str) or not isinstance(patterns, list) or \
            not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"{where}.patterns must be a list of regular expressions over parameter names (e.g. "
                          f"[\".*\\\\.o_proj\\\\.weight$\"]), got {patterns!r}.")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{where}.patterns: {pattern!r} is not a regular expression ({exc}); escape literal "
                              "dots as \\\\. in JSON.") from None
    kind = raw.get("partition_type", "column")
    if not isinstance(kind, str) or kind.lower() not in KINDS:
        raise ConfigError(f"{where}.partition_type = {kind!r}: expected one of {', '.join(KINDS)}.")
    spec = LayerSpec(patterns=tuple(patterns), partition_type=kind.lower(), shape=_shape(raw.get("shape"), where),
                     partition_dim=raw.get("partition_dim"), model_types=_model_types(raw.get("model_types"), where),
                     gather_output=_flag(raw, "gather_output", False, where),
                     grad_allreduce=_flag(raw, "grad_allreduce", False, where))
    _check_dim(spec, where)
    return spec


def _shape(shape, where: str) -> tuple | None:
    """[2, -1] -> (2, -1); [[16, 8, 8], -1] -> ((16, 8, 8), -1). Checked as TPLayerSpec._validate_shape_format."""
    if shape is None:
        return None
    hint = "a list of positive whole numbers and -1 (inferred), with at most one nested list of sizes, e.g. [2, -1]"
    if not isinstance(shape, (list, tuple)) or not shape:
        raise ConfigError(f"{where}.shape = {shape!r}: expected {hint}.")
    out = []
    for dim in shape:
        if isinstance(dim, (list, tuple)):
            if not dim or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in dim):
                raise ConfigError(f"{where}.shape = {shape!r}: a nested list holds the sub-parameters' sizes, "
                                  "positive whole numbers.")
            out.append(tuple(dim))
        elif isinstance(dim, int) and not isinstance(dim, bool) and (dim > 0 or dim == -1):
            out.append(dim)
        else:
            raise ConfigError(f"{where}.shape = {shape!r}: expected {hint}.")
    return tuple(out)


def _check_dim(spec: LayerSpec, where: str) -> None:
    dim = spec.partition_dim
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise ConfigError(f"{where}.partition_dim = {dim!r}: expected a whole number (a dim of shape).")
    if spec.shape is None:
        if dim is not None and dim not in (0, 1):
            raise ConfigError(f"{where}.partition_dim = {dim}: without a shape the weight is 2-D, so 0 or 1.")
        return
    if not 0 <= spec.dim < len(spec.shape):
        raise ConfigError(f"{where}.partition_dim = {spec.dim} is out of range for shape {list(spec.shape)} "
                          f"(0 to {len(spec.shape) - 1}).")
    nested = [i for i, d in enumerate(spec.shape) if isinstance(d, tuple)]
    if nested and nested != [spec.dim]:
        raise ConfigError(f"{where}.shape = {list(spec.shape)}: a nested list of sizes is only allowed at "
                          f"partition_dim ({spec.dim}).")


def _model_types(value, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list):
        raise ConfigError(f"{where}.model_types must be a list of model types (config.model_type), got {value!r}.")
    return tuple(str(v) for v in value)


def _flag(raw: dict, key: str, default: bool, where: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key} = {value!r}: expected true or false.")
    return value


def _note_unknown(raw: dict, known: set[str], where: str) -> None:
    """DeepSpeed reads the keys it knows and ignores the rest; crew too, but says so."""
    unknown = sorted(set(raw) - known)
    if unknown:
        log_rank0("%s: %s ignored (DeepSpeed 0.19.8 reads only %s)", where, ", ".join(map(repr, unknown)),
                  ", ".join(sorted(known)))
