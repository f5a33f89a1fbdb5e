"""DeepSpeed JSON config -> typed, resolved models.

`Config.from_dict(d, world_size=N)` validates a DeepSpeed config dict and resolves the batch triple
the way DeepSpeed 0.19 does (`DeepSpeedConfig._set_batch_related_parameters` and `_batch_assertion`
in deepspeed/runtime/config.py): any one or two of `train_batch_size`,
`train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` may be omitted; with only one
of the first two given, gradient accumulation defaults to 1; with neither given it is an error.
Unlike DeepSpeed, an inconsistent triple is a `ConfigError` that says which values would agree.

`"auto"` counts as omitted for the batch keys: Hugging Face integrations write "auto" and fill it in
before DeepSpeed sees the config. Elsewhere crew drops an "auto" it cannot fill, keeps DeepSpeed's
default and warns.

Types are strict where a DeepSpeed user would want an error: "16" is not 16 and "yes" is not true.
Unknown keys warn (with "did you mean"); DeepSpeed keys crew does not act on are accepted quietly
and listed by `ignored_keys(config)` for the engine to log once. The user's dict is never mutated;
`Config.raw` is a deep copy of it. Files are strict JSON (DeepSpeed also reads hjson comments).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crew.errors import ConfigError
from crew.log import warn_once
from crew.runtime.config_file import _json_type, read_json
from crew.runtime.batch import (PER_RANK_KEY, BatchSizeError, resolve_after_world_change, resolve_batch_sizes,
                                resolve_per_rank)
from crew.runtime.tensor_parallel import config as tp_config

__all__ = ["ActivationCheckpointingConfig", "BF16Config", "BatchSizeError", "Config", "ConfigWarning",
           "FP16Config", "OptimizerConfig", "SchedulerConfig", "ZeroConfig", "ignored_keys", "load_config",
           "resolve_batch_sizes"]

logger = logging.getLogger(__name__)

_SECTION = ConfigDict(strict=True, extra="ignore", frozen=True)


class ConfigWarning(UserWarning):
    """A config key crew does not know (probably a typo), or a value crew replaced with a default."""


# crew's logger prints each of these; Python's own display of the same warning would print it a second time.
# Appended: a filter the user or pytest sets (-W error::crew.runtime.config.ConfigWarning) still wins.
warnings.filterwarnings("ignore", category=ConfigWarning, append=True)


class OptimizerConfig(BaseModel):
    model_config = _SECTION
    type: str = Field(description="Optimizer name as DeepSpeed spells it ('Adam', 'AdamW', 'SGD', ...).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the optimizer.")


class SchedulerConfig(BaseModel):
    model_config = _SECTION
    type: str = Field(description="LR scheduler name as DeepSpeed spells it ('WarmupLR', 'WarmupDecayLR', ...).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the scheduler.")


class FP16Config(BaseModel):
    """Defaults from DeepSpeed's DeepSpeedFP16Config (deepspeed/runtime/precision_config.py)."""

    model_config = _SECTION
    enabled: bool = Field(False, description="Train in fp16 with loss scaling.")
    auto_cast: bool = Field(False, description="Cast floating-point inputs to fp16.")
    loss_scale: float = Field(0, ge=0, allow_inf_nan=False, description="Static loss scale; 0 = dynamic.")
    initial_scale_power: int = Field(16, ge=0, description="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: int = Field(1000, ge=1, description="Overflow-free steps before the scale grows.")
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale shrinks.")
    consecutive_hysteresis: bool = Field(False, description="Refill hysteresis after a step without overflow.")
    min_loss_scale: float = Field(1, gt=0, allow_inf_nan=False, description="Floor for the dynamic scale.")


class BF16Config(BaseModel):
    model_config = _SECTION
    enabled: bool = Field(False, description="Train in bf16 (no loss scaling). Legacy section name: 'bfloat16'.")


class CheckpointConfig(BaseModel):
    """DeepSpeed's `checkpoint` section plus crew's own `keep_last` and `resume_data_position`."""

    model_config = _SECTION
    keep_last: int | None = Field(None, ge=1, description="crew: keep only the newest N checkpoints "
                                  "in save_dir (older tag folders are deleted after a save); None keeps all.")
    resume_data_position: bool = Field(False, description="crew: load_checkpoint also puts the loader "
                                       "initialize() returned where it stopped. Off, as in DeepSpeed: the "
                                       "script skips the batches it consumed itself.")


class PreemptionConfig(BaseModel):
    """crew's own section (DeepSpeed has none): on SIGTERM or SIGUSR1, finish the step, save, exit 75
    (crew/runtime/preemption.py)."""

    model_config = _SECTION
    enabled: bool = Field(False, description="crew: on SIGTERM or SIGUSR1 the ranks finish the optimizer step "
                          "they are in, save a checkpoint and exit with 75 (preempted, resumable).")
    save_dir: str | None = Field(None, description="crew: where that checkpoint goes; null = the folder of the "
                                 "script's last engine.save_checkpoint call.")

    @field_validator("save_dir")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"preemption.save_dir {value!r} names no folder: give one, or null for the folder "
                             "of the script's last engine.save_checkpoint call")
        return value


class ActivationCheckpointingConfig(BaseModel):
    """DeepSpeed's `activation_checkpointing` section, read by `deepspeed.checkpointing.configure()`
    (crew/deepspeed/checkpointing.py), as in DeepSpeed: the engine itself does not read it."""

    model_config = _SECTION
    partition_activations: bool = Field(False, description="Split checkpoints across model-parallel "
                                        "ranks (no effect: crew has no model parallelism).")
    contiguous_memory_optimization: bool = Field(False, description="Copy partitioned checkpoints into "
                                                 "one buffer (no effect in crew).")
    cpu_checkpointing: bool = Field(False, description="Keep the checkpointed inputs in CPU memory "
                                    "between forward and backward.")
    number_checkpoints: int | None = Field(None, ge=1, description="Checkpoints per forward (for the "
                                           "contiguous buffer).")
    synchronize_checkpoint_boundary: bool = Field(False, description="Synchronize the device before and "
                                                  "after each checkpointed call.")
    profile: bool = Field(False, description="Log the time of each checkpointed forward and recompute.")

    @classmethod
    def from_config(cls, config: str | os.PathLike | Mapping[str, Any]) -> ActivationCheckpointingConfig:
        """The section of a DeepSpeed config (a dict or a JSON file's path); defaults when absent."""
        source = "<dict>" if isinstance(config, Mapping) else str(config)
        data = config if isinstance(config, Mapping) else read_json(Path(config))
        section = data.get("activation_checkpointing") or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"{source}: activation_checkpointing must be an object {{...}}, "
                              f"got {_json_type(section)}.")
        return _validate(cls, dict(section), source, prefix="activation_checkpointing.")


class _MonitorFolder(BaseModel):
    """DeepSpeed's tensorboard / csv_monitor sections (deepspeed/monitor/config.py): rank 0 writes
    into output_path/job_name (crew/runtime/monitor.py)."""

    model_config = _SECTION
    enabled: bool = Field(False, description="Write the engine's events.")
    output_path: str = Field("", description="Folder for the job's folder ('' = the working directory).")
    job_name: str = Field("DeepSpeedJobName", description="The job's folder inside output_path.")


class TensorBoardConfig(_MonitorFolder):
    pass


class CSVConfig(_MonitorFolder):
    pass


class WandbConfig(BaseModel):
    model_config = _SECTION
    enabled: bool = Field(False, description="Log the engine's events to Weights & Biases.")
    group: str | None = Field(None, description="wandb.init(group=...).")
    team: str | None = Field(None, description="wandb.init(entity=...).")
    project: str = Field("deepspeed", description="wandb.init(project=...).")


class ZeroConfig(BaseModel):
    """Only `stage` is typed; the other keys are kept in `model_extra` and read by crew/runtime/zero/."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    stage: int = Field(0, ge=0, le=3, description="0 off, 1 optimizer state, 2 +gradients, 3 +parameters.")


class Config(BaseModel):
    """A DeepSpeed config with the batch triple resolved for `world_size` data-parallel ranks."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    train_batch_size: int = Field(gt=0, description="Samples per optimizer step, over all ranks.")
    train_micro_batch_size_per_gpu: int | None = Field(gt=0, description="Samples per rank per "
                                                       "forward/backward; None when each rank has its own.")
    gradient_accumulation_steps: int = Field(gt=0, description="Micro batches per optimizer step.")
    # crew's key: a list by global rank, or "auto" (crew/runtime/batch.py); resolved to the sizes to start with
    train_micro_batch_size_per_rank: tuple[int, ...] | None = Field(None, description="Each global rank's "
                                                                    "micro batch; None = DeepSpeed's even split.")
    auto_balance: bool = Field(False, description="train_micro_batch_size_per_rank was \"auto\".")
    # DeepSpeed 0.19 defaults to None (never print); crew keeps 10, the documented DeepSpeed default.
    # Infinity (what Accelerate writes, "steps_per_print": float("inf")) or null never prints, as in DeepSpeed
    steps_per_print: float = Field(10, ge=1, description="Log progress every N optimizer steps.")
    gradient_clipping: float = Field(1.0, ge=0, allow_inf_nan=False, description="Max grad norm; 0 = off.")
    prescale_gradients: bool = Field(False, description="Scale gradients before the all-reduce.")
    gradient_predivide_factor: float = Field(1.0, gt=0, description="Divide gradients by this before reducing.")
    wall_clock_breakdown: bool = Field(False, description="Time forward/backward/step.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch.")
    dataloader_reshuffle_each_epoch: bool = Field(False, description="crew: shuffle each epoch of the "
                                                  "training_data loader anew; off, as in DeepSpeed, every "
                                                  "epoch repeats the order the sampler's epoch gives.")
    optimizer: OptimizerConfig | None = Field(None, description="Optimizer to build; None = client's own.")
    scheduler: SchedulerConfig | None = Field(None, description="LR scheduler to build; None = client's own.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16"),
                             description="bf16 mixed precision.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO sharding.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig, description="crew: save and exit "
                                         "on a preemption notice.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard events.")
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig, description="One CSV file per event tag.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="deepspeed.checkpointing's settings.")
    world_size: int = Field(gt=0, description="Data-parallel ranks the batch triple was resolved for.")
    source: str = Field(description="Where the config came from (a path or '<dict>'), for messages.")
    raw: dict[str, Any] = Field(description="Deep copy of the user's dict, as given.")

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _null_is_never(cls, value: Any) -> Any:
        return math.inf if value is None else value  # DeepSpeed 0.19: None, never print

    @field_validator("steps_per_print")
    @classmethod
    def _whole_or_infinity(cls, value: float) -> int | float:
        if value == math.inf:
            return value
        if not float(value).is_integer():
            raise ValueError(f"steps_per_print {value}: expected an integer (or Infinity: never print)")
        return int(value)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable one of them")
        per_rank = self.train_micro_batch_size_per_rank
        if per_rank is not None:
            total = sum(per_rank) * self.gradient_accumulation_steps
            if len(per_rank) != self.world_size or self.train_batch_size != total:
                raise ValueError(f"train_micro_batch_size_per_rank {list(per_rank)} does not fit train_batch_size "
                                 f"{self.train_batch_size} on {self.world_size} ranks")
            return self
        product = (self.train_micro_batch_size_per_gpu or 0) * self.gradient_accumulation_steps * self.world_size
        if self.train_batch_size != product:
            raise ValueError(f"train_batch_size {self.train_batch_size} != {product} "
                             "(train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size)")
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], world_size: int, source: str = "<dict>",
                  start_world_size: int | None = None) -> Config:
        """Validate `data` (not modified) and resolve the batch triple; raises ConfigError.

        `start_world_size`: the world an elastic job started on (default: CREW_START_WORLD_SIZE, which
        `crew run --min_nodes` sets); when it differs, the batch follows `resolve_after_world_change`."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: a config must be a JSON object (dict), got {type(data).__name__}.")
        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"{source}: world_size must be a positive integer, got {world_size!r}.")
        raw = copy.deepcopy(dict(data))
        work = _normalise_legacy(copy.deepcopy(raw), source)
        _warn_unknown(work, source)
        auto = _drop_auto(work, source)
        given = _validate(_BatchKeys, {k: work.get(k) for k in _BATCH_KEYS}, source)
        per_rank = work.pop(PER_RANK_KEY, None)
        start_world_size = start_world_size or _start_world_size()
        if per_rank is None and start_world_size not in (None, world_size):
            batch, note = resolve_after_world_change(
                given.train_batch_size, given.train_micro_batch_size_per_gpu, given.gradient_accumulation_steps,
                world_size, start_world_size, source, auto)
            warn_once(f"crew run --min_nodes: {note}")
            work.update(zip(_BATCH_KEYS, batch))
        elif per_rank is None:
            batch = resolve_batch_sizes(given.train_batch_size, given.train_micro_batch_size_per_gpu,
                                        given.gradient_accumulation_steps, world_size, source, auto)
            work.update(zip(_BATCH_KEYS, batch))
        else:
            total, steps, sizes = resolve_per_rank(per_rank, given.train_batch_size,
                                                   given.train_micro_batch_size_per_gpu,
                                                   given.gradient_accumulation_steps, world_size, source)
            micro = sizes[0] if per_rank == "auto" and len(set(sizes)) == 1 else None
            work.update(zip(_BATCH_KEYS, (total, micro, steps)), auto_balance=per_rank == "auto")
            work[PER_RANK_KEY] = sizes
        fields = {k: v for k, v in work.items() if k in _TOP_KEYS | {"auto_balance"}}
        return _validate(cls, {**fields, "world_size": world_size, "source": source, "raw": raw}, source)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
START_WORLD_ENV = "CREW_START_WORLD_SIZE"  # set by `crew run --min_nodes` on every attempt


def _start_world_size() -> int | None:
    value = os.environ.get(START_WORLD_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


class _BatchKeys(BaseModel):
    model_config = _SECTION
    train_batch_size: int | None = Field(None, gt=0)
    train_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    gradient_accumulation_steps: int | None = Field(None, gt=0)


# Known keys, per level: (what crew implements, what only DeepSpeed reads). The second set is accepted
# without a warning and reported by ignored_keys(); move a key across when crew starts using it.
# data_types is read from the raw config (crew/runtime/casting.py, the engine's get_data_types), and
# communication_data_type (the engine's property; stage 3 reduces in it)
_TOP_KEYS = (frozenset(Config.model_fields) - {"world_size", "source", "raw", "auto_balance"}
             | {"bfloat16", "data_types", "communication_data_type", "sequence_parallel_size", "tensor_parallel"})
_DEEPSPEED_ONLY = frozenset({
    "aio", "allgather_size", "amp", "autotuning", "comet",
    "comms_logger", "compile", "compression_training",
    "curriculum_learning", "data_efficiency", "data_parallel_size", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity", "expert_parallel",
    "flops_profiler", "gradient_allreduce_op", "graph_harvesting", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "pipeline", "progressive_layer_drop",
    "quantize_training", "seq_parallel_communication_data_type",
    "sparse_attention", "sparse_gradients", "timers", "torch_autocast",
    "trackio", "use_data_before_expert_parallelism", "vocabulary_size", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"})
_ZERO_DEEPSPEED_ONLY = frozenset({
    "allgather_bucket_size", "allgather_partitions", "contiguous_gradients", "cpu_offload",
    "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint", "enable_sanity_checks",
    "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "leaf_module", "legacy_stage1",
    "load_from_fp32_weights", "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance",
    "memory_efficient_linear", "mics_hierarchical_params_gather", "mics_shard_size",
    "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer", "offload_param",
    "overlap_comm", "param_persistence_threshold", "partition_stream_chunk_size",
    "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
    "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage3_allgather_sequential",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_param_persistence_threshold",
    "stage3_partition_stream_chunk_size", "stage3_prefetch_bucket_size",
    "stage3_use_all_reduce_for_fetch_params", "sub_group_size", "use_all_reduce_for_fetch_params",
    "zenflow", "zero_hpz_partition_size", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights", "zeropp_loco_param"})
# Typed (so a wrong value is an error) but not acted on: listed when set to anything but the default.
# Pre-dividing is a guard against fp16 overflow in the all-reduce; crew averages in one division.
_TYPED_NO_EFFECT = {"prescale_gradients": False, "gradient_predivide_factor": 1.0, "wall_clock_breakdown": False}
# crew/runtime/zero/ reads these (and "wrap", crew's own), the engine the stage3_gather_* ones (Accelerate and
# Trainer ask it, at stage 3); the rest of DeepSpeed's ZeRO keys have no effect.
_ZERO_IMPLEMENTED = frozenset({"stage", "reduce_bucket_size", "use_multi_rank_bucket_allreduce", "offload_optimizer",
                               "offload_param", "wrap",
                               "mics_shard_size", "zero_hpz_partition_size",
                               "stage3_max_live_parameters", "stage3_max_reuse_distance",
                               "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                               "stage3_model_persistence_threshold",
                               "stage3_gather_16bit_weights_on_model_save",
                               "stage3_gather_fp16_weights_on_model_save"})
_BF16_KEYS = (frozenset(BF16Config.model_fields), frozenset({
    "bf16_master_weights_and_grads", "bf16_optimizer_states", "check_grad_overflow", "check_overflow",
    "immediate_grad_update"}))
_SECTIONS = {
    "fp16": (frozenset(FP16Config.model_fields), frozenset({"fp16_master_weights_and_grads", "fused_mode"})),
    "bf16": _BF16_KEYS,
    "bfloat16": _BF16_KEYS,
    "zero_optimization": (_ZERO_IMPLEMENTED, _ZERO_DEEPSPEED_ONLY - _ZERO_IMPLEMENTED),
    "optimizer": (frozenset({"type", "params"}), frozenset({"legacy_fusion"})),
    "scheduler": (frozenset({"type", "params"}), frozenset()),
    "tensorboard": (frozenset(TensorBoardConfig.model_fields), frozenset()),
    "csv_monitor": (frozenset(CSVConfig.model_fields), frozenset()),
    "wandb": (frozenset(WandbConfig.model_fields), frozenset()),
    "activation_checkpointing": (frozenset(ActivationCheckpointingConfig.model_fields), frozenset({
        "partition_activations", "contiguous_memory_optimization"})),
    "preemption": (frozenset(PreemptionConfig.model_fields), frozenset()),
    "data_types": (frozenset({"buffer_dtype", "keep_in_fp32_modules", "grad_accum_dtype"}), frozenset({"param_dtype"})),
    "checkpoint": (frozenset(CheckpointConfig.model_fields), frozenset({
        "load_universal", "parallel_write", "tag_validation", "use_node_local_storage"})),
    "tensor_parallel": (tp_config.IMPLEMENTED, frozenset()),  # checked by crew/runtime/tensor_parallel/config.py
}


_LOGGED: set[str] = set()  # each warning once per process, however many engines a script builds (TRL: several)


def _warn(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)
    frame, level = sys._getframe(0), 1  # point the warning at the first caller outside this module
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, ConfigWarning, stacklevel=level)


def _normalise_legacy(work: dict[str, Any], source: str) -> dict[str, Any]:
    """Old DeepSpeed spellings: `"zero_optimization": true` (stage 1) and `bfloat16` beside `bf16`."""
    if isinstance(work.get("zero_optimization"), bool):
        stage = int(work["zero_optimization"])
        _warn(f"{source}: \"zero_optimization\": {json.dumps(work['zero_optimization'])} is deprecated; "
              f"crew reads it as {{\"stage\": {stage}}} like DeepSpeed. Write that instead.")
        work["zero_optimization"] = {"stage": stage}
    if "bf16" in work and "bfloat16" in work:
        _warn(f"{source}: both 'bf16' and its legacy name 'bfloat16' are given; crew uses 'bf16' "
              "like DeepSpeed. Remove 'bfloat16'.")
    return work


def _levels(data: Mapping[str, Any]):
    """(section dict, key prefix, keys crew implements, keys only DeepSpeed reads) for each known level."""
    yield data, "", _TOP_KEYS, _DEEPSPEED_ONLY
    for name, (implemented, deepspeed_only) in _SECTIONS.items():
        if isinstance(data.get(name), Mapping):
            yield data[name], f"{name}.", implemented, deepspeed_only


def _warn_unknown(work: Mapping[str, Any], source: str) -> None:
    for section, prefix, implemented, deepspeed_only in _levels(work):
        known = implemented | deepspeed_only
        for key in section:
            if not prefix and _dotted_section_key(key):
                continue  # TRL's prepare_deepspeed writes these; DeepSpeed ignores them without a word
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"; did you mean '{prefix}{close[0]}'?" if close else " (not a DeepSpeed key crew knows)."
                _warn(f"{source}: unknown key '{prefix}{key}' is ignored{hint}")


def _dotted_section_key(key: Any) -> bool:
    """A top-level key spelled "section.key" (e.g. "zero_optimization.reduce_bucket_size")."""
    return isinstance(key, str) and key.split(".", 1)[0] in _SECTIONS and "." in key


_AUTO_IS_A_VALUE = frozenset({PER_RANK_KEY, "keep_in_fp32_modules"})  # "auto" is theirs, not Hugging Face's


def _drop_auto(work: dict[str, Any], source: str) -> list[str]:
    """Remove "auto" values from the keys crew implements; return the batch keys that were "auto"."""
    auto_batch = [key for key in _BATCH_KEYS if work.get(key) == "auto"]
    for section, prefix, implemented, _ in list(_levels(work)):
        for key in [k for k in section if k in implemented - _AUTO_IS_A_VALUE and section[k] == "auto"]:
            del section[key]
            if prefix or key not in _BATCH_KEYS:
                _warn(f"{source}: {prefix}{key} is \"auto\", which only a Hugging Face integration fills "
                      "in; crew uses DeepSpeed's default. Set a value to silence this.")
    return auto_batch


def ignored_keys(config: Config) -> list[str]:
    """Dotted DeepSpeed keys in `config` that crew accepts but does not act on, in the user's order.

    The engine logs them once: "accepted, has no effect in crew: activation_checkpointing, ...".
    """
    found = ["bfloat16"] if "bf16" in config.raw and "bfloat16" in config.raw else []
    for section, prefix, _, deepspeed_only in _levels(config.raw):
        found += [f"{prefix}{key}" for key in section if key in deepspeed_only]
        if not prefix:
            found += [key for key in section if key in _TYPED_NO_EFFECT and section[key] != _TYPED_NO_EFFECT[key]]
    return found


# --- pydantic errors -> one ConfigError line per problem -------------------------------------------

_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "dict_type": "an object {...}", "model_type": "an object {...}",
             "finite_number": "a finite number"}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}


def _validate(model: type[BaseModel], data: dict[str, Any], source: str, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(_describe(error, prefix) for error in err.errors())
        raise ConfigError(f"{source}: {problems}.") from None


def _describe(error: Mapping[str, Any], prefix: str = "") -> str:
    key = prefix + ".".join(str(part) for part in error["loc"])
    kind, value = error["type"], error.get("input")
    shown = json.dumps(value, default=repr)
    if kind == "missing":
        return f"{key} is required but missing"
    if kind in _EXPECTED:
        return f"{key} {shown}: expected {_EXPECTED[kind]}, got {_json_type(value)}{_hint(value, kind)}"
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        return f"{key} {shown} is out of range: it must be {op} {error['ctx'][name]}"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    return f"{key} {shown}: {error['msg']}"


def _hint(value: Any, kind: str) -> str:
    """How to write the value the way the key wants it, when that is obvious."""
    if isinstance(value, float) and value.is_integer() and kind == "int_type":
        return f" (write {int(value)})"
    if isinstance(value, str):
        try:
            parsed = json.loads(value.strip().lower())
        except ValueError:
            return ""
        fits = {"int_type": int, "float_type": (int, float), "bool_type": bool}.get(kind)
        if fits and isinstance(parsed, fits) and (kind == "bool_type") == isinstance(parsed, bool):
            return f" (write {json.dumps(parsed)} without quotes)"
    return ""


# --- loading --------------------------------------------------------------------------------------


def load_config(config: str | os.PathLike | Mapping[str, Any] | Config | None = None, world_size: int = 1,
                args: Any = None, config_params: Mapping[str, Any] | None = None,
                sequence_parallel: int = 1) -> Config:
    """Pick the config the way deepspeed.initialize does, load it and resolve it for `world_size`.

    `config` (path or dict), else `config_params`, else `args.deepspeed_config` (or the legacy
    `args.deepscale_config`). A config given both ways is an error, as in DeepSpeed.
    """
    argument = "config" if config is not None else "config_params"
    chosen = config if config is not None else config_params
    from_args = _config_from_args(args)
    if from_args is not None and chosen is not None:
        raise ConfigError(
            f"got two configs: --deepspeed_config {from_args} (args.deepspeed_config) and {argument}= "
            f"passed to initialize(). Drop one: remove --deepspeed_config from the command line or "
            f"the {argument}= argument.")
    chosen = from_args if chosen is None else chosen
    if chosen is None:
        raise ConfigError(
            "no DeepSpeed config given. Pass --deepspeed_config ds.json on the command line (add the flag "
            "with crew.add_config_arguments(parser)) or config=<path or dict> to crew.initialize().")
    if isinstance(chosen, Config):
        raw, source = chosen.raw, chosen.source
    elif isinstance(chosen, Mapping):
        raw, source = chosen, "<dict>"
    elif isinstance(chosen, (str, os.PathLike)):
        raw, source = read_json(Path(chosen)), str(chosen)
    else:
        raise ConfigError(f"{argument} must be a path or a dict, got {type(chosen).__name__}.")
    world_size = _data_parallel_world(raw, world_size, sequence_parallel, source)
    if isinstance(chosen, Config) and chosen.world_size == world_size:
        return chosen
    return Config.from_dict(raw, world_size, source)


def _data_parallel_world(raw: Mapping[str, Any], world_size: int, sequence_parallel: int, source: str) -> int:
    """The ranks DeepSpeed's batch math counts (its config.py): world / the sequence-parallel size, from the SP
    groups (initialize(mpu=...)) or else the config's sequence_parallel_size; both given, they must agree."""
    declared = raw.get("sequence_parallel_size") if isinstance(raw, Mapping) else None
    if declared is None:
        return world_size // sequence_parallel
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise ConfigError(f"{source}: sequence_parallel_size = {declared!r}: expected a whole number >= 1.")
    if sequence_parallel != 1 and declared != sequence_parallel:
        raise ConfigError(f"{source}: sequence_parallel_size = {declared}, but the sequence-parallel groups have "
                          f"{sequence_parallel} ranks (UlyssesSPAttentionHF.register_with_transformers("
                          f"sequence_parallel_size={sequence_parallel})); set both to the same size.")
    if world_size % declared:
        raise ConfigError(f"{source}: sequence_parallel_size = {declared} does not divide the {world_size} ranks "
                          "of this job: run a multiple of it, or set it to a divisor of the world size.")
    return world_size // declared


def _config_from_args(args: Any) -> str | None:
    legacy = getattr(args, "deepscale_config", None)
    current = getattr(args, "deepspeed_config", None)
    if legacy is None:
        return current
    if current is not None:
        raise ConfigError(f"got both --deepscale_config {legacy} and --deepspeed_config {current}; "
                          "drop --deepscale_config (its old name).")
    _warn("--deepscale_config is deprecated; use --deepspeed_config.")
    return legacy
