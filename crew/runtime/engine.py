"""Engine: sequences a DeepSpeed training step and delegates every concern to a module of its own.

    loss = engine(batch)        forward (gradient sync armed only on the accumulation boundary)
    engine.backward(loss)       loss / gradient_accumulation_steps, scaled for fp16
    engine.step()               boundary only: unscale, clip, optimizer and scheduler step, zero,
                                count; every other micro step just counts

At ZeRO stages 0-1 gradients are averaged across ranks by DistributedDataParallel's bucketed
all-reduce, which runs during the boundary micro step's backward; non-boundary micro steps skip it
(DDP `no_sync`). Stage 1 steps the optimizer through ZeroRedundancyOptimizer. Stage 2 keeps whole
parameters too, and averages each micro step's gradients into the rank that owns each parameter
(hooks, crew/runtime/zero/stage2.py); stage 3 shards the model with FSDP2, which reduce-scatters on
every micro step (crew/runtime/zero/).

Under AutoTP (tensor_parallel.autotp_size > 1, crew/runtime/tensor_parallel/) the model is split first, and
"across ranks" above means across the data-parallel group: the ranks that hold the same slices.
"""

from __future__ import annotations

import atexit
import gc
import time
import warnings
import weakref
from collections.abc import Iterable

import torch

from crew.errors import ConfigError
from crew.log import log_rank0, warn_once
from crew.runtime import (balance, casting, checkpoint, comm, gradnorm, parallel, preemption, registry,
                          tensor_parallel, zero)
from crew.runtime.accessors import DeepSpeedAccessors
from crew.runtime.config import Config
from crew.runtime.monitor import Monitor, step_events
from crew.runtime.optim import build_optimizer, build_scheduler
from crew.runtime.precision import Precision, make_precision
from crew.runtime.progress import ThroughputTimer, show_step

# deepspeed/runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS: torch's by type, DeepSpeed's ops by crew's classes
# (crew.runtime.optim.adam's Adam/AdamW stand for FusedAdam with bias_correction=False)
_ZERO_TESTED_TORCH = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
_ZERO_TESTED_OPS = frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "ZenFlowCPUAdam",
                              "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "FusedLion", "MuonWithAuxAdam"})


@atexit.register
def _release_process_group() -> None:
    """Tear the process group down while Python is still whole. Left to interpreter shutdown (DDP's
    reducer keeps it alive), gloo can abort a rank that finished fine: 'terminate called without
    an active exception'. DeepSpeed scripts never destroy the group themselves."""
    for engine in registry.live_engines():
        engine._ddp = None
    gc.collect()
    comm.destroy_process_group()


class DeepSpeedEngine(DeepSpeedAccessors, torch.nn.Module):
    """crew's engine, under DeepSpeed's class name: scripts and libraries test `type(model).__name__ ==
    "DeepSpeedEngine"`. `Engine` is the same class. Its __module__ stays crew's (it is crew's code)."""

    def __init__(self, model: torch.nn.Module, config: Config, optimizer=None,
                 model_parameters=None, lr_scheduler=None):
        super().__init__()
        self.crew_config = config
        self._init_accessors(optimizer)
        self.global_rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()
        self.world_size = comm.get_world_size()
        self.device = _device(self.local_rank)
        # AutoTP splits the model first (as DeepSpeed); data parallelism is then over the ranks holding one slice
        self.tp_section, tp_replaced = tensor_parallel.prepare(model, config)
        self.mp_world_size = parallel.tensor_parallel_size()
        self.dp_world_size = parallel.data_parallel_size()
        # DeepSpeed's sequence-data-parallel group: the SP ranks of every data-parallel replica, which reduce together
        self.seq_dp_world_size = self.dp_world_size * parallel.sequence_parallel_size()
        self.zero = zero.Zero(config.zero_optimization, self.world_size, self.device, parallel.data_parallel_group())
        self.precision: Precision = make_precision(config.fp16, config.bf16, sharded=self.zero.shards_params,
                                                   offload=self.zero.offload if self.zero.offload_optimizer else None)
        self.balancer = balance.make(config, self.global_rank, self.device, self.zero.stage)
        self.module, replaced = self._place(model)
        self._ddp = self.zero.wrap_ddp(model)
        built = self._optimizer(optimizer, model_parameters, tensor_parallel.chained(tp_replaced, replaced))
        tensor_parallel.mark_masters(self.precision)
        if self.zero.stage > 0 and built is not None and not _zero_tested(built):
            # DeepSpeed 0.19.8 asks for zero_allow_untested_optimizer here; crew trains it either way
            warn_once("**** You are using ZeRO with an untested optimizer, proceed with caution *****")
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            self._client_optimizer_name = type(built).__name__
        self.optimizer = self.zero.shard_optimizer(built, self.precision) if built is not None else None
        if self.optimizer is not None:
            self.optimizer.overflow = False  # as on DeepSpeed's ZeRO and fp16 optimizers: Accelerate reads it
        if self.balancer is not None:  # after the optimizer: at stage 2 it owns the gradient hooks
            self.balancer.watch(self._ddp if self._ddp is not None else self.zero.grads)
        self.lr_scheduler = self._scheduler(lr_scheduler) if built is not None else None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._armed_sync = True  # whether the last forward through DDP armed its gradient all-reduce
        self.grads_pending = False  # a backward since the last optimizer step or zero_grad
        self.training_dataloader = None
        self._loss_sum: torch.Tensor | None = None
        self._last_print = (time.perf_counter(), 0, 0)
        self._last_boundary: float | None = None
        self.monitor = Monitor(config, self.global_rank)
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        # the last steps' events are written when the engine goes, or at exit (scripts never close it)
        weakref.finalize(self, self.monitor.close)
        registry.register(self)
        self._preemption = preemption.make(config, self.device)  # None unless the config enables it

    def __getattr__(self, name: str):
        """As DeepSpeed's engine: what the engine does not have is looked up on the user's model."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and not name.startswith("__"):
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    # -- set-up -------------------------------------------------------------------------------

    def _place(self, model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
        """Cast and move (stages 0-2) or shard (stage 3, one unit at a time) the model; a model built
        partitioned under zero.Init is gathered whole at stages 0-2. Returns it and {id(param before): param
        after}."""
        self.zero.refuse_meta(model)
        dtype = getattr(self.precision, "dtype", torch.float32)
        casting.cast_buffers(model, dtype, self.crew_config.raw.get("data_types"))  # every stage: never partitioned
        if self.zero.shards_params:
            replaced = self.zero.shard(model, self.precision.sharded_compute_dtype, self.communication_data_type)
            self.precision.cast_module(model)  # checks the dtype's kernels; FSDP2 does the casting
            return model, replaced
        self.zero.make_whole(model)
        self.precision.cast_module(model)
        return model.to(self.device), {}

    def _optimizer(self, client, model_parameters, replaced: dict) -> torch.optim.Optimizer:
        section = self.crew_config.optimizer
        if client is not None and section is not None:
            # DeepSpeed 0.19.8 (_configure_optimizer) uses the client's and ignores the section (UER-py has both)
            log_rank0("Using client Optimizer as basic optimizer; the config's 'optimizer' section (%s) is not used",
                      section.type)
        groups = _param_groups(model_parameters, self.module, replaced)
        if isinstance(client, torch.optim.Optimizer):
            params = _flat(client.param_groups)
            masters = self.precision.master_params([replaced.get(id(p), p) for p in params])
            if any(m is not p for m, p in zip(masters, params, strict=True)):
                _rebind(client, masters)
            return client
        masters = _with_master_params(groups, self.precision)
        if callable(client):
            return client(masters)
        if section is None:
            return None  # a model-only engine (evaluation, as DeepSpeed's); step() says what is missing
        # DeepSpeed's zero_use_cpu_optimizer(): the config alone picks its CPU optimizers ("Lion": DeepSpeedCPULion)
        offload = (self.crew_config.zero_optimization.model_extra or {}).get("offload_optimizer") or {}
        return build_optimizer(section.type, section.params, masters, cpu_optimizer=offload.get("device") == "cpu")

    def _scheduler(self, client):
        if client is not None:
            return client(self.optimizer) if callable(client) and not hasattr(client, "step") \
                else client
        section = self.crew_config.scheduler
        return build_scheduler(section.type, section.params, self.optimizer) if section else None

    # -- the step -----------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self.module.training:
            self.tput_timer.start()
        if self.balancer is not None:
            self.balancer.forward_started()
        if self.fp16_auto_cast():
            args = _cast_half(args)  # positional inputs only, as DeepSpeed
        with self.precision.guard():  # an op with no fp16/bf16 kernel: a clear error, not deep
            if self._ddp is None:
                return self.module(*args, **kwargs)
            # DDP's no_sync, across two calls: arm the all-reduce only for the boundary's backward. Where the
            # caller sets the boundary (Accelerate: after this forward) and accumulates, it is not known yet:
            # the gradients are averaged after the boundary's backward instead, once (as DeepSpeed does).
            known = self._boundary_override is None or self.gradient_accumulation_steps() == 1
            self._ddp.require_backward_grad_sync = self._armed_sync = known and self._sync_this_backward()
            return self._ddp(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        detached = loss.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        # unequal micro batches: weight each rank by its samples, so the average is over samples
        weighted = loss if self.balancer is None else loss * self.balancer.grad_weight()
        with self.precision.guard(), self.zero.reducing(self._sync_this_backward()):
            self.precision.scale_loss(weighted).backward(retain_graph=retain_graph)
        if self._ddp is not None and not self._armed_sync and self._sync_this_backward():
            # the boundary was set after the forward (Accelerate sets it just before backward): DDP did
            # not reduce during this backward, so reduce now, as DeepSpeed does at stage 0-1 after it
            _average_grads(self.module.parameters(), group=parallel.data_parallel_group())
        if self.balancer is not None:
            self.balancer.backward_done()
        self.grads_pending = True
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        self._begin_step()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._take_model_step(lr_kwargs)
            if self.balancer is not None:
                self.balancer.after_step(self.global_steps)
        self.micro_steps += 1
        self.tput_timer.stop(global_step=boundary)
        if boundary and self._preemption is not None:
            self._preemption.after_step(self)  # a preemption notice on any rank: save and exit

    def _take_model_step(self, lr_kwargs: dict | None) -> None:
        if self.optimizer is None:
            raise ConfigError(
                f"{self.crew_config.source}: engine.step() needs an optimizer, and this engine has none. Add an "
                '\'optimizer\' section (e.g. {"type": "AdamW", "params": {"lr": 1e-3}}) or pass '
                "initialize(optimizer=...).")
        overflow = self.precision.unscale_grads()
        self.optimizer.overflow = bool(overflow)
        if not overflow:
            self._clip_and_record_norm(_flat(self.optimizer.param_groups))  # norm before clipping
            self.zero.before_step()
            self.optimizer.step()
            self.precision.copy_master_to_model()
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    # The order is right by construction; at stage 1 a client scheduler watches the
                    # optimizer ZeroRedundancyOptimizer replaced, which never steps itself.
                    warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
                    self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self._record_skipped_step()
        self.precision.update_scale(overflow)
        self.zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        if self.monitor.enabled:
            self._record_step()
        if self.global_steps % self.crew_config.steps_per_print == 0:
            self._print_progress()
            self.monitor.flush()
        self._loss_sum = None

    def _record_step(self) -> None:
        """This step's monitor events; they stay on the device until the monitor's next flush."""
        now, then = time.perf_counter(), self._last_boundary
        self._last_boundary = now
        rate = self.train_batch_size() / (now - then) if then is not None else None
        scale = self.precision.loss_scale if self.fp16_enabled() else None
        sizes = self.balancer.sizes if self.balancer is not None else None
        self.monitor.record(step_events(self.global_samples, self._loss_sum, self.get_lr()[0], scale, rate,
                                        sizes))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads_pending = False
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        self.precision.zero_model_grads()

    def _print_progress(self) -> None:
        now, samples, steps = time.perf_counter(), self.global_samples, self.global_steps
        then, before, steps_before = self._last_print
        self._last_print = (now, samples, steps)
        loss = self._loss_sum.item() if self._loss_sum is not None else float("nan")
        seconds = max(now - then, 1e-9)
        total = getattr(self.lr_scheduler, "total_num_steps", None)
        show_step(steps, total if isinstance(total, int) else None, loss, self.get_lr(),
                  (samples - before) / seconds, self.precision.skipped_steps, seconds / max(steps - steps_before, 1))

    # -- DeepSpeed's accessors (the rest: crew/runtime/accessors.py) ---------------------------

    def autotp_size(self) -> int:
        return self.tp_section.autotp_size

    def tensor_parallel_config(self):
        return self.tp_section

    def _clip_and_record_norm(self, params: list[torch.Tensor]) -> None:
        if self.mp_world_size == 1:
            return super()._clip_and_record_norm(params)
        # the whole model's norm: the slices' squares summed over the TP group, the replicated ones once
        norm = tensor_parallel.grad_norm(params, self.device, self.zero.partitioned and self.dp_world_size > 1)
        if self.crew_config.gradient_clipping > 0:
            gradnorm.clip_([p.grad for p in params if p.grad is not None], self.crew_config.gradient_clipping, norm)
        self._global_grad_norm, self._step_applied = norm.float(), True

    def train_batch_size(self) -> int:
        return self.crew_config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """This rank's micro batch (with train_micro_batch_size_per_rank, its current share)."""
        if self.balancer is not None:
            return self.balancer.micro_batch
        return self.crew_config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.crew_config.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    @property
    def skipped_steps(self) -> int:
        return self.precision.skipped_steps

    @property
    def loss_scale(self) -> float:
        return self.precision.loss_scale

    # -- checkpoints (crew/runtime/checkpoint/) -----------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False):
        self.monitor.flush()  # what a resumed run appends to starts where this one's events end
        saved = checkpoint.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if self._preemption is not None:
            self._preemption.remember(save_dir, tag, client_state, self.global_steps)
        return saved

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """(path, client_state) of the checkpoint loaded, or (None, None) when there is none.
        custom_load_fn(src=state_dict, dst=module), when given, loads the module's weights instead of
        module.load_state_dict (stages 0-2, as DeepSpeed)."""
        return checkpoint.load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        return checkpoint.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's old name for save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def log_batch_math(self, batches_per_epoch: int | None) -> None:
        accumulation = f"accumulation {self.gradient_accumulation_steps()}"
        if self.balancer is None:
            split = f"micro {self.train_micro_batch_size_per_gpu()} × {accumulation} × {self.world_size} ranks"
        else:
            split = f"micro {self.balancer.describe()} × {accumulation}"
        sequence = self.sequence_parallel_size
        if sequence > 1:  # each sample is split over `sequence` ranks; each rank's loader batch is one micro step
            split = split.replace(f"{self.world_size} ranks", f"{parallel.data_parallel_size()} data-parallel ranks "
                                  f"({self.world_size} / sequence parallel {sequence})")
            batches_per_epoch = None if batches_per_epoch is None else batches_per_epoch * sequence
        line = f"{split} = {self.train_batch_size()} per step"
        if batches_per_epoch is not None:
            line += f"; {batches_per_epoch // self.gradient_accumulation_steps()} steps per epoch"
        log_rank0("%s", line)


Engine = DeepSpeedEngine  # crew's own name


def _average_grads(params: Iterable[torch.Tensor], bucket_elements: int = 1 << 24, group=None) -> None:
    """All-reduce (average) every gradient across the ranks of `group` (None: all), in flat buckets of one dtype."""
    from crew.runtime.zero.stage2 import chunks  # torch.distributed.optim: seconds to import, on use only

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        for bucket in chunks(grads, bucket_elements):
            flat = torch.cat([grad.reshape(-1) for grad in bucket])
            comm.all_reduce(flat, op=comm.ReduceOp.AVG, group=group)
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()


def _zero_tested(optimizer: torch.optim.Optimizer) -> bool:
    cls = type(optimizer)
    return cls in _ZERO_TESTED_TORCH or (cls.__module__.startswith("crew.") and cls.__name__ in _ZERO_TESTED_OPS)


def _device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _cast_half(inputs):
    """Floating-point tensors in (nested lists, tuples, dicts of) `inputs` as fp16."""
    if isinstance(inputs, (list, tuple)):
        cast = [_cast_half(value) for value in inputs]
        return type(inputs)(*cast) if hasattr(inputs, "_fields") else type(inputs)(cast)  # namedtuple
    if isinstance(inputs, dict):
        return {key: _cast_half(value) for key, value in inputs.items()}
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        return inputs.half()
    return inputs


def _param_groups(model_parameters, module: torch.nn.Module, replaced: dict) -> list[dict]:
    """initialize(model_parameters=...) as param groups: tensors, or dicts with 'params'; a param
    that sharding replaced is swapped for its sharded successor."""
    items = list(model_parameters) if model_parameters is not None else list(module.parameters())
    if items and isinstance(items[0], dict):
        groups = [dict(group, params=list(group["params"])) for group in items]
    else:
        groups = [{"params": items}]
    for group in groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    return groups


def _with_master_params(groups: list[dict], precision: Precision) -> list[dict]:
    """The same groups over the tensors the optimizer steps (fp32 masters under fp16/bf16)."""
    return [dict(group, params=precision.master_params(group["params"])) for group in groups]


def _flat(groups: Iterable[dict]) -> list[torch.Tensor]:
    return [param for group in groups for param in group["params"]]


def _rebind(optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter]) -> None:
    """Point a client optimizer built on the model's fp16/bf16 params at the fp32 masters."""
    it = iter(masters)
    for group in optimizer.param_groups:
        group["params"] = [next(it) for _ in group["params"]]
    optimizer.state.clear()

