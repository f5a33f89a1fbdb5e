"""ZeRO stages 0-3 on torch's own machinery, from DeepSpeed's `zero_optimization` section.

    stage 0   DistributedDataParallel: replicated parameters, gradients and optimizer state
    stage 1   DDP + ZeroRedundancyOptimizer: each rank keeps and steps 1/N of the optimizer state (under
              fp16/bf16 or offload_optimizer, stage 2's optimizer without its gradient hooks: the fp32
              masters too are kept only by their owner)
    stage 2   whole parameters on every rank, as in DeepSpeed; each parameter's gradient, fp32 master
              (fp16/bf16) and optimizer state kept only by the rank that owns it (ZeroRedundancyOptimizer's
              split); gradients averaged into the owners on every micro step (stage2.py)
    stage 3   FSDP2 fully_shard: parameters sharded too, gathered a group of wrapped units at a time and
              kept whole from forward to backward as DeepSpeed's stage3_* keys say (fetching.py), the small
              ones whole on every rank (persistence.py); with mics_shard_size / zero_hpz_partition_size G,
              sharded within groups of G ranks and replicated across them (HSDP, hsdp.py)

At stages 0-2 `model.parameters()` and `model.state_dict()` are the whole, equal tensors on every rank.

Stage 3's FSDP2 units ("wrap", a crew key in zero_optimization): "blocks" (default) wraps every member of a
repeated stack (the children of a ModuleList/Sequential that hold two or more modules of one class:
the transformer blocks), falling back to the model's top-level children; "children" wraps each
top-level child; a list of class names wraps every module of those classes. The root is always
wrapped last and holds whatever is left (embeddings, heads, tied weights).

Under fp16/bf16 at stage 3 the sharded parameters stay fp32 (they are the master weights) and FSDP2's
MixedPrecisionPolicy gathers them in the 16-bit dtype for compute; gradients are reduced in the communication
dtype (DeepSpeed's communication_data_type: by default the 16-bit one).
Gradients are reduce-scattered on every micro step, as DeepSpeed's stage 3 does, so accumulation
holds only the gradient shard.

DeepSpeed's stage-3 API is here too: `Init` (partition_parameters.py: a model built inside it is partitioned
module by module, never whole on a rank), `GatheredParameters` (gather.py), `register_external_parameter`;
stage3.py shards a model, stage2.py is stage 2's optimizer.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from crew.errors import ConfigError
from crew.log import log_rank0
from crew.runtime.zero import adopt, fetching, hsdp, partition_parameters, persistence, stage3
from crew.runtime.zero.gather import GatheredParameters
from crew.runtime.zero.partition_parameters import (Init, ZeroParamStatus, ZeroParamType,
                                                    register_external_parameter, unregister_external_parameter)
from crew.runtime.zero.stage3 import wrap_units

partition_parameters.GatheredParameters = GatheredParameters  # where DeepSpeed defines it

__all__ = ["GatheredParameters", "Init", "Zero", "ZeroParamStatus", "ZeroParamType", "partition_parameters",
           "register_external_parameter", "unregister_external_parameter", "wrap_units"]

WRAP_CHOICES = ("blocks", "children")
OFFLOAD_ON_CPU = False  # tests: take the offload path on a machine without GPU (masters are then CPU copies)
_BUCKET_KEYS = ("reduce_bucket_size",)  # stages 0-2: DDP's or stage 2's bucket size; FSDP2 buckets per unit


class Zero:
    """The `zero_optimization` section, checked, and the means to apply it to a model."""

    def __init__(self, section: Any, world_size: int, device: torch.device, group=None) -> None:
        self.stage = section.stage
        # under AutoTP, data parallelism (DDP, ZeRO's owners) is over `group`: the ranks holding one TP slice
        self.group = group
        self.world_size = world_size if group is None else torch.distributed.get_world_size(group)
        self.device = device
        extra = dict(section.model_extra or {})
        self.wrap_rule = _wrap_rule(extra.get("wrap", "blocks"))
        self.bucket_elements = _bucket_elements(extra.get("reduce_bucket_size"))
        self.reduce_to_owners = _reduce_to_owners(extra.get("use_multi_rank_bucket_allreduce", True), self.stage)
        self.offload = _offload(extra, self.stage, device)
        # stages 1-2: the fp32 masters, their gradients and the optimizer's state and step on the CPU
        self.offload_optimizer = bool(self.offload and self.stage in (1, 2))
        self.grads = None  # stage 2 on more than one rank: its stage2.GradientPartition
        self.partitioned = False  # the optimizer is stage2.py's (each rank holds its owned masters and grads)
        self.shard_group = hsdp.group_size(extra, world_size) if self.stage == 3 else None  # MiCS / hpZ
        if self.shard_group is not None and group is not None:
            raise ConfigError(f"{' and '.join(hsdp.no_effect(extra))} with "
                              "tensor_parallel.autotp_size: crew shards each TP slice over the whole data-parallel "
                              "group at stage 3, and does not split that group further. Remove the key (or "
                              "tensor_parallel.autotp_size).")
        self.fetch = fetching.policy(extra) if self.stage == 3 else None
        self.persistent_grads = None  # stage 3: the whole small parameters' gradients (persistence.py)
        # stage 3's own keys, set at stages 0-2 (where DeepSpeed ignores them too)
        self._stage3_keys_set = [] if self.stage == 3 else hsdp.no_effect(extra) + [
            f"zero_optimization.{key}" for key in fetching.DEFAULTS if key in extra]
        self._sharded: torch.nn.Module | None = None  # stage 3: the model shard() wrapped

    @property
    def shards_params(self) -> bool:
        """Stage 3: the model is wrapped by fully_shard and its parameters become DTensors."""
        return self.stage == 3

    def no_effect_keys(self) -> list[str]:
        """Implemented keys that do nothing at this stage (on top of config.ignored_keys)."""
        if self.stage == 3 and self.bucket_elements is not None:
            return [f"zero_optimization.{key}" for key in _BUCKET_KEYS]
        return self._stage3_keys_set

    # -- the model ---------------------------------------------------------------------------

    def wrap_ddp(self, model: torch.nn.Module):
        """Stages 0-1 on more than one rank: DDP, which also broadcasts rank 0's weights. Stage 2, stage 1
        reducing to the owners (stage2.py does) and a model with no trainable parameter have no DDP: rank 0's
        weights are broadcast here all the same."""
        if self.stage == 3 or self.world_size == 1:
            return None
        # a frozen model (TRL's reference/reward/teacher models at stage 0) has nothing for DDP to reduce
        if self.stage == 2 or self.reduce_to_owners or not any(p.requires_grad for p in model.parameters()):
            from crew.runtime.zero import stage2  # torch.distributed.optim: seconds to import, on use only
            stage2.broadcast_module(model, self.bucket_elements, self.group)
            return None
        from torch.nn.parallel import DistributedDataParallel
        ids = [self.device.index] if self.device.type == "cuda" else None
        # DeepSpeed's default bucket (5e8 elements) unless set: a model below it reduces in one call, as under
        # DeepSpeed. As bucket views the gradients are the buckets, so a larger bucket costs no memory; given a
        # size, DDP's first bucket is no smaller than the rest
        elements = self.bucket_elements or 500_000_000
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        size = torch.tensor([], dtype=dtype).element_size()
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True,
                                       bucket_cap_mb=elements * size / 2**20, process_group=self.group)

    def shard(self, model: torch.nn.Module, compute_dtype: torch.dtype | None,
              reduce_dtype: torch.dtype) -> dict[int, torch.nn.Parameter]:
        """Stage 3: fully_shard the model's units and its root, in place (stage3.py), gathering parameters in
        `compute_dtype` and reducing gradients in `reduce_dtype`. Returns {id(old param): new}, so that
        parameter lists taken before sharding can be pointed at the new ones."""
        self._sharded = model
        if adopt.is_sharded(model):  # an earlier engine's (Lightning's fit, then test): taken as it is
            adopt.restore_hooks(model)
            whole = [p for p in model.parameters() if getattr(p, "ds_persist", False)]
            self.persistent_grads = persistence.PersistentGrads(whole, reduce_dtype, self.group)
            return {}
        replaced, whole = stage3.shard(model, self._mesh(), self.device, self.wrap_rule, compute_dtype,
                                       reduce_dtype, self.offload, self.stage, self.fetch)
        self.persistent_grads = persistence.PersistentGrads(whole, reduce_dtype, self.group)
        adopt.remember_hooks(model)
        return replaced

    def _mesh(self):
        """FSDP2's mesh: under AutoTP the data-parallel group's (each TP slice sharded over the ranks that hold
        it, as DeepSpeed's stage 3 partitions over its data-parallel group); else the world's, or HSDP's."""
        if self.group is not None:
            from crew.runtime import parallel
            return parallel.data_parallel_mesh()
        return hsdp.mesh(self.device, self.world_size, self.shard_group)

    @staticmethod
    def refuse_meta(model: torch.nn.Module) -> None:
        meta = [name for name, p in model.named_parameters() if p.is_meta]
        if meta:
            raise ConfigError(
                f"the model's parameters {meta[:3]}{' ...' if len(meta) > 3 else ''} are on the meta device (no "
                "values). Build the model inside `with deepspeed.zero.Init():` to have it partitioned as it is "
                "built, or give it values first (model.to_empty(device=...) and its initialisation).")

    def make_whole(self, model: torch.nn.Module) -> None:
        """Stages 0-2 keep every parameter whole on every rank: gather what zero.Init partitioned."""
        gather_init_built(model, f"stage {self.stage} keeps whole parameters on every rank")

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, precision=None) -> torch.optim.Optimizer:
        """Stage 1: the same optimizer, its state split over the ranks by ZeroRedundancyOptimizer.
        Stage 2: the same split, and with it the fp32 masters (of `precision`) and the gradients."""
        if self.stage == 3 and self._sharded is not None:
            from crew.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
            optimizer.parameter_offload = DeepSpeedZeRoOffload(self._sharded)  # TRL's generation reads it
        if self.stage not in (1, 2):
            return optimizer
        from crew.runtime.zero.param_sync import GatheringZeroRedundancyOptimizer  # seconds to import: on use
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        # defaults can hold entries the constructor does not take (AdamW: decoupled_weight_decay)
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            if self.stage == 2 or self.reduce_to_owners or self.offload_optimizer or (
                    precision is not None and precision.master_pairs()):
                # stage 2, and stage 1 with fp32 masters (bf16/fp16: only the owner keeps its masters, as in
                # DeepSpeed; offload: masters on the CPU, which NCCL cannot send): every rank gathers the
                # model's parameters from their owners (param_sync.py); stage 1 reduces through DDP, or to the
                # owners at the accumulation boundary (use_multi_rank_bucket_allreduce false)
                from crew.runtime.zero import stage2
                partitioned = stage2.partition(optimizer, cls, defaults, precision, self.bucket_elements,
                                               self.device, reduce_gradients=self.stage == 2 or self.reduce_to_owners,
                                               to_owners=self.reduce_to_owners, stage=self.stage, group=self.group)
                self.grads, self.partitioned = partitioned.grads, True
                return _stepping_for(optimizer, partitioned)
            # The same group dicts: a scheduler built on `optimizer` still sets the lr that is used. Its owners'
            # parameters come back by all-gather (param_sync.py), not a broadcast per parameter
            return _stepping_for(optimizer, GatheringZeroRedundancyOptimizer(
                optimizer.param_groups, chunk_elements=self.bucket_elements or 500_000_000, optimizer_class=cls,
                process_group=self.group, **defaults))
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"zero_optimization.stage {self.stage} rebuilds the optimizer as ZeroRedundancyOptimizer("
                f"optimizer_class={cls.__name__}, ...), which failed: {exc}. Use a torch.optim "
                "optimizer, or stage 0 or 3.") from None

    def before_step(self) -> None:
        """Stage 3: a unit left whole by a forward that had no backward goes back to its shards before the
        optimizer changes them (else the next forward would use the stale whole copy)."""
        if self._sharded is not None:
            fetching.reshard_all(self._sharded)

    def reducing(self, boundary: bool) -> contextlib.AbstractContextManager:
        """Around a backward: at stage 2 its gradients are averaged into their owners, and on the
        accumulation boundary become the owned parameters' .grad; at stage 3 the whole parameters' gradients
        are averaged on the boundary."""
        if self.persistent_grads is not None:
            return self.persistent_grads.reducing(boundary)
        return self.grads.reducing(boundary) if self.grads is not None else contextlib.nullcontext()


def gather_init_built(model: torch.nn.Module, why: str) -> None:
    """The parameters zero.Init partitioned, made whole plain parameters on every rank (a collective)."""
    split = [p for p in dict.fromkeys(model.parameters()) if partition_parameters.is_partitioned(p)]
    if not split:
        return
    partition_parameters.gather(split)
    for param in split:
        for name in ("ds_tensor", "ds_id", "ds_shape", "ds_numel", "ds_status", "ds_persist",
                     "ds_active_sub_modules"):
            param.__dict__.pop(name, None)
    log_rank0("zero.Init: %s, so the model built partitioned is gathered whole", why)


def _stepping_for(client: torch.optim.Optimizer, replacement: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Each step of `replacement` counts as one of `client` for the schedulers built on it: DeepSpeed's ZeRO
    optimizer steps the client's, so torch warns of no "lr_scheduler.step() before optimizer.step()" when
    the script or a library (Lightning) steps the scheduler."""
    replacement.register_step_post_hook(lambda *_: setattr(client, "_opt_called", True))
    return replacement


# -- config values ----------------------------------------------------------------------------

def _wrap_rule(value: Any) -> str | tuple[str, ...]:
    if value in WRAP_CHOICES:
        return value
    if isinstance(value, list) and value and all(isinstance(name, str) for name in value):
        return tuple(value)
    raise ConfigError(
        f"zero_optimization.wrap is {value!r}; use \"blocks\" (each member of a repeated stack of "
        "modules, e.g. transformer blocks), \"children\" (each top-level child module) or a list of "
        "module class names, e.g. [\"LlamaDecoderLayer\"].")


def _bucket_elements(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise ConfigError(f"zero_optimization.reduce_bucket_size must be a number of elements >= 1 "
                          f"(DeepSpeed's default is 5e8), got {value!r}.")
    return int(value)


def _reduce_to_owners(value: Any, stage: int) -> bool:
    """use_multi_rank_bucket_allreduce false: stages 1-2 reduce each bucket's slices into their owners only."""
    if not isinstance(value, bool):
        raise ConfigError(f"zero_optimization.use_multi_rank_bucket_allreduce must be true (all-reduce each "
                          f"gradient bucket, DeepSpeed's default) or false (reduce each owner's part of it to "
                          f"that owner), got {value!r}.")
    if not value and stage not in (1, 2):
        log_rank0("zero_optimization.use_multi_rank_bucket_allreduce false has no effect at stage %d: crew "
                  "reduces to the owners at stages 1-2 only (stage 0 all-reduces through DDP, stage 3 "
                  "reduce-scatters through FSDP2)", stage)
    return not value and stage in (1, 2)


def _offload(extra: dict, stage: int, device: torch.device) -> dict | None:
    """The offload settings that take effect: None when off (or nothing to do on a CPU run)."""
    wanted = {}
    for key in ("offload_optimizer", "offload_param"):
        section = extra.get(key)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"zero_optimization.{key} must be an object like "
                              f'{{"device": "cpu"}}, got {section!r}.')
        where = section.get("device", "none")
        if where in ("none", None):
            continue
        if where != "cpu":
            raise ConfigError(f"zero_optimization.{key}.device is {where!r}; crew offloads to "
                              "\"cpu\" only (torch's CPUOffloadPolicy). Use \"cpu\" or \"none\".")
        wanted[key] = bool(section.get("pin_memory", True))
    if not wanted:
        return None
    if device.type == "cpu" and not OFFLOAD_ON_CPU:
        log_rank0("zero_optimization: %s to cpu has no effect, training already runs on the CPU",
                  " and ".join(wanted))
        return None
    if stage == 0:  # DeepSpeed builds no ZeRO optimizer at stage 0, and with it no offload
        log_rank0("zero_optimization: %s has no effect at stage 0 (as in DeepSpeed): offloading needs ZeRO "
                  "stage 1, 2 or 3", " and ".join(wanted))
        return None
    if stage < 3:
        if "offload_param" in wanted:
            log_rank0("zero_optimization.offload_param has no effect below stage 3 (as in DeepSpeed): "
                      "the parameters stay on the GPU")
        if "offload_optimizer" not in wanted:
            return None
        log_rank0("zero_optimization.offload_optimizer: the fp32 master weights, gradients and optimizer "
                  "state of this rank's partition live on the CPU, where the optimizer steps")
        return {"pin_memory": wanted["offload_optimizer"]}
    if "offload_param" not in wanted:
        log_rank0("zero_optimization.offload_optimizer: torch's CPUOffloadPolicy keeps parameters, "
                  "gradients and optimizer state on the CPU together (as offload_param would)")
    return {"pin_memory": all(wanted.values())}
