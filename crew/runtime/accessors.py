"""DeepSpeed 0.19.8's engine accessors, as a mixin that crew's Engine inherits.

Same names, signatures and meaning as `deepspeed.runtime.engine.DeepSpeedEngine`: precision and
ZeRO queries (`fp16_enabled()`, `zero_optimization_stage()`, ...), config values
(`gradient_clipping()`, `steps_per_print()`, ...), optimizer names and hyperparameters
(`optimizer_name()`, `get_mom()`), step results (`get_global_grad_norm()`, `was_step_applied()`),
gradient-sync control (`no_sync()`, `set_gradient_accumulation_boundary()`), batch-size changes
(`set_train_batch_size()`, `set_train_micro_batch_size()`), `module_state_dict()`, `destroy()`,
`get_data_types()` and the `communication_data_type` property.

Where crew differs from DeepSpeed it says so in the method's docstring: errors are CrewError (with
the DeepSpeed text) rather than AssertionError, and `get_global_grad_norm()` has a value at every
stage and precision, a 0-dim tensor as under ZeRO (DeepSpeed leaves it None for stage-0 fp32).

The Engine calls `_init_accessors()` in its constructor, `_begin_step()` at the top of `step()`
and `_clip_and_record_norm()` / `_record_skipped_step()` at the accumulation boundary.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch

from crew.errors import ConfigError, CrewError
from crew.runtime import gradnorm, parallel, registry
from crew.runtime.casting import dtype_named
from crew.runtime.checkpoint import tensor_parallel as tensor_parallel_checkpoint
from crew.runtime.config_view import DeepSpeedConfig, deepspeed_optimizer_name
from crew.runtime.zero.stage3 import shards_visible

_MOMENTUM_OPTIMIZERS = ("SGD", "RMSprop")


class DeepSpeedAccessors:
    """Mixin for crew's Engine: needs `config`, `precision`, `zero`, `module`, `optimizer`,
    `world_size`, `micro_steps`, `balancer` and `_ddp` (see crew/runtime/engine.py)."""

    def _init_accessors(self, client_optimizer: Any) -> None:
        self._client_optimizer_name = None if client_optimizer is None else type(client_optimizer).__name__
        self._global_grad_norm: torch.Tensor | None = None
        self._step_applied = False
        self._in_no_sync = False
        self._boundary_override: bool | None = None
        self._communication_data_type: torch.dtype | None = None
        self._destroyed = False

    # -- precision and ZeRO -----------------------------------------------------------------------

    def fp16_enabled(self) -> bool:
        return self.crew_config.fp16.enabled

    def fp16_auto_cast(self) -> bool:
        """fp16.auto_cast: forward() casts floating-point positional inputs to fp16."""
        return self.crew_config.fp16.auto_cast

    def bfloat16_enabled(self) -> bool:
        return self.crew_config.bf16.enabled

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_stage(self) -> int:
        return self.crew_config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def dynamic_loss_scale(self) -> bool:
        """fp16.loss_scale == 0, as DeepSpeed (True by default, even with fp16 off)."""
        return self.crew_config.fp16.loss_scale == 0

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype): data_types.grad_accum_dtype when the config
        gives one, else the model dtype."""
        model_dtype = torch.float16 if self.fp16_enabled() else \
            torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        section = self.crew_config.raw.get("data_types") or {}
        accum = section.get("grad_accum_dtype") if isinstance(section, dict) else None
        return model_dtype, (model_dtype if accum is None else dtype_named(accum, "data_types.grad_accum_dtype"))

    @property
    def communication_data_type(self) -> torch.dtype:
        """The config's communication_data_type, else fp16/bf16 when enabled, else float32. Stage 3
        reduces gradients in it (set at initialize); stages 0-2 in the model's dtype."""
        if self._communication_data_type is not None:
            return self._communication_data_type
        given = self.crew_config.raw.get("communication_data_type")
        if given is not None:
            return dtype_named(given, "communication_data_type")
        if self.fp16_enabled():
            return torch.float16
        return torch.bfloat16 if self.bfloat16_enabled() else torch.float32

    @communication_data_type.setter
    def communication_data_type(self, value) -> None:
        self._communication_data_type = dtype_named(value, "communication_data_type")

    # -- parallel layout (crew/runtime/parallel/) ------------------------------------------------

    @property
    def sequence_parallel_size(self) -> int:
        """Ulysses SP size: 1 without SP."""
        return parallel.sequence_parallel_size()

    @property
    def seq_parallel_group(self):
        """This rank's SP group; None without SP (DeepSpeed sets it only under SP)."""
        return parallel.sequence_parallel_group()

    def get_sequence_parallel_group(self):
        return self.seq_parallel_group

    # -- config values ----------------------------------------------------------------------------

    @property
    def _config(self) -> DeepSpeedConfig:
        """DeepSpeed's config object for this engine's config (DeepSpeed keeps one as `_config`)."""
        return DeepSpeedConfig(self.crew_config)

    def gradient_clipping(self) -> float:
        """Max gradient norm; 0 = off. crew's default is 1.0, as DeepSpeed 0.19."""
        return self.crew_config.gradient_clipping

    def steps_per_print(self) -> int:
        """crew's default is 10 (DeepSpeed 0.19's is None)."""
        return self.crew_config.steps_per_print

    def dataloader_drop_last(self) -> bool:
        return self.crew_config.dataloader_drop_last

    def wall_clock_breakdown(self) -> bool:
        """The config's value (crew does not time forward/backward/step: listed as no effect)."""
        return self.crew_config.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        return bool(self.crew_config.raw.get("memory_breakdown", False))

    @property
    def is_compiled(self) -> bool:
        """Whether engine.compile() compiled the module (a property, as in DeepSpeed 0.19)."""
        return self.__dict__.get("_is_compiled", False)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's engine.compile: torch.compile the module in place (nn.Module.compile); once."""
        if schedule is not None:
            raise CrewError("engine.compile(schedule=...) is DeepCompile's; crew compiles with torch.compile "
                            "only. Drop schedule=.")
        if self.is_compiled:
            return
        self.module.compile(**{**(compile_kwargs or {}), "backend": backend})
        self.__dict__["_is_compiled"] = True

    def empty_partition_cache(self) -> None:
        """Release cached device memory (DeepSpeed frees offloaded ZeRO-3 parameters' buffers)."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name; else the config type, lower-cased for DeepSpeed's own
        names (adam, adamw, lamb, ...) and as given otherwise; None without an optimizer. For a
        client callable it is the class of the optimizer it built (DeepSpeed says 'function')."""
        if self._client_optimizer_name is not None:
            return self._client_optimizer_name
        section = self.crew_config.optimizer
        return deepspeed_optimizer_name(section.type) if section is not None else None

    def scheduler_name(self) -> str | None:
        section = self.crew_config.scheduler
        return section.type if section is not None else None

    def get_mom(self) -> list:
        """Per param group: `momentum` for SGD/RMSprop, else `betas` (as DeepSpeed); a group
        without that key gives the other one, or None."""
        first, second = ("momentum", "betas") if self.optimizer_name() in _MOMENTUM_OPTIMIZERS \
            else ("betas", "momentum")
        return [group.get(first, group.get(second)) for group in self.optimizer.param_groups]

    # -- step results -----------------------------------------------------------------------------

    def get_global_grad_norm(self) -> torch.Tensor | None:
        """The total L2 norm of the gradients before clipping at the last accumulation boundary,
        unscaled under fp16, the same on every rank; inf when fp16 overflowed; None before the
        first boundary step. A 0-dim CPU tensor (`float(norm)` and `norm.item()` both work), at every
        stage: fp32 as DeepSpeed's ZeRO 1-2 optimizers return it, fp64 at stage 3 as DeepSpeed 0.19.8's."""
        norm = self._global_grad_norm
        if norm is not None and (norm.device.type != "cpu" or hasattr(norm, "full_tensor")):
            if hasattr(norm, "full_tensor"):  # a DTensor
                norm = norm.full_tensor()
            norm = self._global_grad_norm = norm.detach().cpu()
        return norm

    def was_step_applied(self) -> bool:
        """True after a boundary step whose optimizer step ran (not skipped for fp16 overflow)."""
        return self._step_applied

    def _begin_step(self) -> None:
        if self._in_no_sync:
            raise CrewError("It is illegal to call Engine.step() inside no_sync context manager: "
                            "leave the `with engine.no_sync():` block (and run a backward outside it, "
                            "which averages the gradients) before engine.step().")
        self._step_applied = False

    def _clip_and_record_norm(self, params: list[torch.Tensor]) -> None:
        """Clip to gradient_clipping (when > 0) and keep the norm before clipping. The norm stays a
        tensor until get_global_grad_norm() asks: no device sync on the step."""
        max_norm = self.crew_config.gradient_clipping
        grads = [param.grad for param in params if param.grad is not None]
        # stage 2: each rank holds the gradients of the parameters it owns, summed across ranks
        norm = gradnorm.global_norm(grads, self.device, across_ranks=self.zero.partitioned and self.world_size > 1)
        if max_norm > 0:
            gradnorm.clip_(grads, max_norm, norm)
        self._global_grad_norm = norm if self.zero.shards_params else norm.float()
        self._step_applied = True

    def _record_skipped_step(self) -> None:
        self._global_grad_norm = torch.tensor(float("inf"))  # as DeepSpeed on an fp16 overflow

    # -- gradient sync and accumulation -----------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force is_gradient_accumulation_boundary() to `is_boundary` from now on (sticky, as in
        DeepSpeed: there is no way back to counting micro steps)."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not average gradients across ranks (stages 0-1); they
        accumulate locally until a backward outside the block. Run the forward inside the block
        too: DDP decides at the forward whether the backward reduces."""
        if self.zero_optimization_partition_gradients():
            stage = self.zero_optimization_stage()
            raise CrewError(
                f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                f"stage {stage}: stage {stage} reduces gradients on every backward. Call "
                f"backward() without no_sync (accumulation is handled by gradient_accumulation_steps), "
                f"or use zero_optimization.stage 0 or 1.")
        if self._in_no_sync:
            raise CrewError("no_sync context manager reentry is unsupported: you are already inside "
                            "`with engine.no_sync():`.")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def _sync_this_backward(self) -> bool:
        return self.is_gradient_accumulation_boundary() and not self._in_no_sync

    # -- batch sizes ------------------------------------------------------------------------------

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient_accumulation_steps (the micro batch stays);
        it must be a multiple of micro batch x world size. The loader is not changed (as DeepSpeed)."""
        self._refuse_per_rank("set_train_batch_size")
        micro = self.crew_config.train_micro_batch_size_per_gpu
        per_step = micro * self.world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or \
                train_batch_size < 1 or train_batch_size % per_step:
            raise ConfigError(
                f"Train batch size must be divisible by micro-batch data parallelism: "
                f"set_train_batch_size({train_batch_size!r}) is not a positive multiple of "
                f"train_micro_batch_size_per_gpu {micro} x {self.world_size} ranks = {per_step}; "
                f"pass a multiple of {per_step}.")
        self._update_batch(train_batch_size=train_batch_size,
                           gradient_accumulation_steps=train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch; gradient accumulation stays, so the global batch becomes
        micro x accumulation x world size. The loader is not changed (as DeepSpeed)."""
        self._refuse_per_rank("set_train_micro_batch_size")
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ConfigError(f"set_train_micro_batch_size({micro_batch_size!r}): the micro batch must "
                              "be a positive integer.")
        self._update_batch(
            train_micro_batch_size_per_gpu=micro_batch_size,
            train_batch_size=micro_batch_size * self.gradient_accumulation_steps() * self.world_size)

    def _refuse_per_rank(self, what: str) -> None:
        if self.crew_config.train_micro_batch_size_per_rank is not None:
            raise ConfigError(
                f"{what}() needs one micro batch for every rank, but this config sets "
                f"train_micro_batch_size_per_rank {list(self.crew_config.train_micro_batch_size_per_rank)}; "
                "change the sizes in the config instead, or use train_micro_batch_size_per_gpu.")

    def _update_batch(self, **values: int) -> None:
        # Config is frozen and its `raw` is the user's dict as given: a copy with new values.
        self.crew_config = self.crew_config.model_copy(update=values)

    # -- state and teardown -----------------------------------------------------------------------

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The module's state dict (in the training dtype). At ZeRO stage 3 the full tensors are
        gathered from the shards on every rank: a collective, every rank must call it."""
        if not self.zero.shards_params:
            state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            if exclude_frozen_parameters:
                for name, param in self.module.named_parameters():
                    if not param.requires_grad:
                        state.pop(prefix + name, None)
            return state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=exclude_frozen_parameters)
        with shards_visible():
            full = get_model_state_dict(self.module, options=options)
        dtype = self.precision.dtype
        state = destination if destination is not None else {}
        for name, value in full.items():
            state[prefix + name] = value.to(dtype) if value.is_floating_point() else value
        return state

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save (or its old fp16 name); False by default."""
        section = self.crew_config.raw.get("zero_optimization") or {}
        return bool(section.get("stage3_gather_16bit_weights_on_model_save", section.get(  # AutoTP: gathered
            "stage3_gather_fp16_weights_on_model_save", parallel.tensor_parallel_size() > 1)))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's: at stage 3 the whole state dict in the training dtype, on the CPU, on rank 0 (None on the
        other ranks); every rank must call it. Accelerate's get_state_dict and Trainer's save_model use it."""
        if not self.zero.shards_params:
            raise ValueError("this function requires ZeRO-3 mode")
        if parallel.tensor_parallel_size() > 1:  # AutoTP: whole over the data-parallel mesh, then the TP group
            return tensor_parallel_checkpoint.whole_state(self, self.precision.dtype, exclude_frozen_parameters)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        # gathered one parameter at a time onto rank 0's CPU: no rank holds the whole model on its device
        options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                   ignore_frozen_params=exclude_frozen_parameters)
        with shards_visible():
            full = get_model_state_dict(self.module, options=options)
        if self.global_rank != 0:
            return None
        dtype = self.precision.dtype
        state = {name: value.to(dtype) if value.is_floating_point() else value for name, value in full.items()}
        first_name: dict[int, str] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if exclude_frozen_parameters and not param.requires_grad:
                state.pop(name, None)  # a frozen tied weight can come back under its second name
            first = first_name.setdefault(id(param), name)
            if first != name and first in state and name in state:
                state[name] = state[first]  # tied weights: one tensor
        return state

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's: the ZeRO-3 one at stage 3, AutoTP's slices gathered whole under TP."""
        if self.zero.shards_params:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if parallel.tensor_parallel_size() > 1:  # AutoTP: the slices gathered (crew/runtime/checkpoint)
            return tensor_parallel_checkpoint.whole_state(self, self.precision.dtype, exclude_frozen_parameters)
        raise ValueError("consolidated_16bit_state_dict is only applicable to cases where weights are partitioned, "
                         "including Zero Stage 3 and tensor parallelism.")

    def destroy(self) -> None:
        """Release the DDP wrapper, the optimizer state and this engine's entry among the live
        engines. The engine cannot train afterwards; calling it again does nothing."""
        if self._destroyed:
            return
        self._destroyed = True
        destroy = getattr(self.optimizer, "destroy", None)
        if callable(destroy):
            destroy()
        for optimizer in (self.optimizer, getattr(self.optimizer, "optim", None)):
            state = getattr(optimizer, "state", None)
            if hasattr(state, "clear"):
                state.clear()
        self._ddp = None
        self.monitor.close()
        registry.unregister(self)
