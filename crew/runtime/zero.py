"""ZeRO stages 0-3 on torch's own machinery, from DeepSpeed's `zero_optimization` section.

    stage 0   DistributedDataParallel: replicated parameters, gradients and optimizer state
    stage 1   DDP + ZeroRedundancyOptimizer: each rank keeps and steps 1/N of the optimizer state (under
              fp16/bf16 or offload_optimizer, stage 2's optimizer without its gradient hooks: the fp32
              masters too are kept only by their owner)
    stage 2   whole parameters on every rank, as in DeepSpeed; each parameter's gradient, fp32 master
              (fp16/bf16) and optimizer state kept only by the rank that owns it (ZeroRedundancyOptimizer's
              split); gradients averaged into the owners on every micro step (zero_stage2.py)
    stage 3   FSDP2 fully_shard, reshard_after_forward=True: parameters sharded too, gathered one
              wrapped unit at a time

At stages 0-2 `model.parameters()` and `model.state_dict()` are the whole, equal tensors on every rank.

Stage 3's FSDP2 units ("wrap", a crew key in zero_optimization): "blocks" (default) wraps every member of a
repeated stack (the children of a ModuleList/Sequential that hold two or more modules of one class:
the transformer blocks), falling back to the model's top-level children; "children" wraps each
top-level child; a list of class names wraps every module of those classes. The root is always
wrapped last and holds whatever is left (embeddings, heads, tied weights).

Under fp16/bf16 at stage 3 the sharded parameters stay fp32 (they are the master weights) and FSDP2's
MixedPrecisionPolicy gathers them in the 16-bit dtype for compute; gradients are reduced in fp32.
Gradients are reduce-scattered on every micro step, as DeepSpeed's stage 3 does, so accumulation
holds only the gradient shard.

`Init` and `GatheredParameters` are DeepSpeed's stage-3 API (see their docstrings).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from crew.errors import ConfigError, CrewError
from crew.log import log_rank0
from crew.runtime import comm
from crew.runtime.registry import live_engines

WRAP_CHOICES = ("blocks", "children")
OFFLOAD_ON_CPU = False  # tests: take the offload path on a machine without GPU (masters are then CPU copies)
_BUCKET_KEYS = ("reduce_bucket_size",)  # stages 0-2: DDP's or stage 2's bucket size; FSDP2 buckets per unit


class Zero:
    """The `zero_optimization` section, checked, and the means to apply it to a model."""

    def __init__(self, section: Any, world_size: int, device: torch.device) -> None:
        self.stage = section.stage
        self.world_size = world_size
        self.device = device
        extra = dict(section.model_extra or {})
        self.wrap_rule = _wrap_rule(extra.get("wrap", "blocks"))
        self.bucket_elements = _bucket_elements(extra.get("reduce_bucket_size"))
        self.offload = _offload(extra, self.stage, device)
        # stages 1-2: the fp32 masters, their gradients and the optimizer's state and step on the CPU
        self.offload_optimizer = bool(self.offload and self.stage in (1, 2))
        self.grads = None  # stage 2 on more than one rank: its zero_stage2.GradientPartition
        self.partitioned = False  # the optimizer is zero_stage2's (each rank holds its owned masters and grads)

    @property
    def shards_params(self) -> bool:
        """Stage 3: the model is wrapped by fully_shard and its parameters become DTensors."""
        return self.stage == 3

    def no_effect_keys(self) -> list[str]:
        """Implemented keys that do nothing at this stage (on top of config.ignored_keys)."""
        if self.stage == 3 and self.bucket_elements is not None:
            return [f"zero_optimization.{key}" for key in _BUCKET_KEYS]
        return []

    # -- the model ---------------------------------------------------------------------------

    def wrap_ddp(self, model: torch.nn.Module):
        """Stages 0-1 on more than one rank: DDP, which also broadcasts rank 0's weights. Stage 2 has
        no DDP (its gradient hooks reduce): rank 0's weights are broadcast here all the same."""
        if self.stage == 3 or self.world_size == 1:
            return None
        if self.stage == 2:
            from crew.runtime import zero_stage2  # torch.distributed.optim: seconds to import, on use only
            zero_stage2.broadcast_module(model, self.bucket_elements)
            return None
        from torch.nn.parallel import DistributedDataParallel
        ids = [self.device.index] if self.device.type == "cuda" else None
        options: dict[str, Any] = {"gradient_as_bucket_view": True}  # no second copy of the grads
        if self.bucket_elements is not None:
            dtype = next((p.dtype for p in model.parameters()), torch.float32)
            size = torch.tensor([], dtype=dtype).element_size()
            options["bucket_cap_mb"] = self.bucket_elements * size / 2**20
        return DistributedDataParallel(model, device_ids=ids, **options)

    def shard(self, model: torch.nn.Module, compute_dtype: torch.dtype | None) -> dict[int, torch.nn.Parameter]:
        """Stage 3: fully_shard the units and the root, in place. Returns {id(old param): new}
        so that parameter lists taken before sharding can be pointed at the sharded parameters."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
        if compute_dtype is not None:
            # inputs are not cast, as at stages 0-1 and in DeepSpeed: the same script runs at any stage
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                                        cast_forward_inputs=False)
        if self.offload:
            from torch.distributed.fsdp import CPUOffloadPolicy
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.offload["pin_memory"])
        units = wrap_units(model, self.wrap_rule)
        with _materialising(model) as memo:
            for unit in units:
                _materialise(unit, self.device, memo)
                fully_shard(unit, **options)
                _forget_whole(memo)  # the unit holds only its shards now: free the whole tensors
            _materialise(model, self.device, memo)
            fully_shard(model, **options)
        log_rank0("ZeRO stage %d: fully_shard over %d ranks, %d wrapped units (+ root)%s",
                  self.stage, self.world_size, len(units),
                  ", CPU offload" if self.offload else "")
        current = dict(model.named_parameters(remove_duplicate=False))
        return {old: current[name] for old, name in names.items() if name in current}

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, precision=None) -> torch.optim.Optimizer:
        """Stage 1: the same optimizer, its state split over the ranks by ZeroRedundancyOptimizer.
        Stage 2: the same split, and with it the fp32 masters (of `precision`) and the gradients."""
        if self.stage not in (1, 2):
            return optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        # defaults can hold entries the constructor does not take (AdamW: decoupled_weight_decay)
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            if self.stage == 2 or self.offload_optimizer or (precision is not None and precision.master_pairs()):
                # stage 2, and stage 1 with fp32 masters (bf16/fp16: only the owner keeps its masters, as in
                # DeepSpeed; offload: masters on the CPU, which NCCL cannot send): the owners broadcast the
                # model's parameters; stage 1 reduces through DDP
                from crew.runtime import zero_stage2
                partitioned = zero_stage2.partition(optimizer, cls, defaults, precision, self.bucket_elements,
                                                    self.device, reduce_gradients=self.stage == 2)
                self.grads, self.partitioned = partitioned.grads, True
                return partitioned
            # The same group dicts: a scheduler built on `optimizer` still sets the lr that is used.
            return ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=cls, **defaults)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"zero_optimization.stage {self.stage} rebuilds the optimizer as ZeroRedundancyOptimizer("
                f"optimizer_class={cls.__name__}, ...), which failed: {exc}. Use a torch.optim "
                "optimizer, or stage 0 or 3.") from None

    def reducing(self, boundary: bool) -> contextlib.AbstractContextManager:
        """Around a backward: at stage 2 its gradients are averaged into their owners, and on the
        accumulation boundary become the owned parameters' .grad."""
        return self.grads.reducing(boundary) if self.grads is not None else contextlib.nullcontext()


# -- wrapping ---------------------------------------------------------------------------------

def _wrap_rule(value: Any) -> str | tuple[str, ...]:
    if value in WRAP_CHOICES:
        return value
    if isinstance(value, list) and value and all(isinstance(name, str) for name in value):
        return tuple(value)
    raise ConfigError(
        f"zero_optimization.wrap is {value!r}; use \"blocks\" (each member of a repeated stack of "
        "modules, e.g. transformer blocks), \"children\" (each top-level child module) or a list of "
        "module class names, e.g. [\"LlamaDecoderLayer\"].")


def wrap_units(model: torch.nn.Module, rule: str | tuple[str, ...]) -> list[torch.nn.Module]:
    """The submodules that become FSDP2 units under `rule`, parents never inside children."""
    if isinstance(rule, tuple):
        units = [m for m in model.modules() if m is not model and type(m).__name__ in rule]
        if not units:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"zero_optimization.wrap names {list(rule)}, but the model has none "
                              f"of those classes; its module classes are {present}.")
        return _outermost(units)
    if rule == "blocks":
        blocks = [child for stack in model.modules() if isinstance(stack, (torch.nn.ModuleList,
                  torch.nn.Sequential)) for child in _repeated(stack)]
        if blocks:
            return _outermost(blocks)
    return [child for child in model.children() if _has_params(child)]


def _repeated(stack: torch.nn.Module) -> list[torch.nn.Module]:
    children = [c for c in stack.children() if _has_params(c)]
    kinds = [type(c) for c in children]
    return [c for c in children if kinds.count(type(c)) >= 2]


def _outermost(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    inner = {id(sub) for module in modules for sub in module.modules() if sub is not module}
    seen: set[int] = set()
    result = []
    for module in modules:
        if id(module) not in inner and id(module) not in seen:
            seen.add(id(module))
            result.append(module)
    return result


def _has_params(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


# -- config values ----------------------------------------------------------------------------

def _bucket_elements(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise ConfigError(f"zero_optimization.reduce_bucket_size must be a number of elements >= 1 "
                          f"(DeepSpeed's default is 5e8), got {value!r}.")
    return int(value)


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
    if stage == 0:
        raise ConfigError(f"zero_optimization.{next(iter(wanted))} needs ZeRO stage 1, 2 or 3 (as in "
                          "DeepSpeed); this config has stage 0. Set zero_optimization.stage, or remove the "
                          "offload section.")
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


# -- deferred construction (zero.Init) --------------------------------------------------------

_INIT_RNG_STATE: torch.Tensor | None = None  # the CPU generator's state when the Init block ended


class Init:
    """`with crew.zero.Init(): model = Model()`: build the model without allocating its weights
    (on torch's meta device). At stage 3 the engine materialises it one FSDP2 unit at a time (at
    stages 0-2 whole, every rank keeping every parameter): each unit's
    parameters are allocated, initialised by the modules' reset_parameters(), sharded, and only
    then is the next unit allocated. The random state is rank 0's as it was at the end of the
    block (building on meta draws no random numbers), so every rank gets the same values, and a
    model whose units are built in order (a stack of blocks) gets the values it would have had
    without Init. Accepts and ignores DeepSpeed's other arguments (data_parallel_group,
    config_dict_or_path, ...)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, **kwargs) -> None:
        if module is not None:
            raise CrewError("crew.zero.Init(module=...) converts an existing model, which crew does "
                            "not do: build the model inside `with crew.zero.Init():` instead.")
        self.enabled = enabled
        self._device_context: torch.device | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._device_context = torch.device("meta")
            self._device_context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _INIT_RNG_STATE
        if self._device_context is not None:
            # Building on meta drew no random numbers: this is the state the first draw would have
            # seen, including a torch.manual_seed() called inside the block.
            _INIT_RNG_STATE = torch.get_rng_state()
            self._device_context.__exit__(*exc)
            self._device_context = None


def is_deferred(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in _own_tensors(model, recurse=True))


def materialise(model: torch.nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
    """Stages 0-2 with a model built under zero.Init: allocate and initialise it whole. Returns
    {id(meta param): allocated param}."""
    if not is_deferred(model):
        return {}
    with _materialising(model) as memo:
        _materialise(model, device, memo)
    log_rank0("zero.Init: stages 0-2 keep whole parameters on every rank, so the model built on "
              "the meta device is now allocated whole")
    return {key: allocated for key, (_, allocated) in memo.items()}


@contextlib.contextmanager
def _materialising(model: torch.nn.Module) -> Iterator[dict]:
    """Around materialising a deferred model: checks, one seed on every rank, and a memo of the
    tensors already allocated (a tied weight stays tied)."""
    if not is_deferred(model):
        yield {}
        return
    _check_resettable(model)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(_agreed_rng_state())
        yield {}


def _materialise(module: torch.nn.Module, device: torch.device, memo: dict) -> None:
    """Allocate `module`'s meta tensors, then run reset_parameters() on each submodule that owned
    one of them, in construction order."""
    for owner in [m for m in module.modules() if any(t.is_meta for t in _own_tensors(m))]:
        fresh = False
        for store in (owner._parameters, owner._buffers):
            for name, tensor in store.items():
                if tensor is not None and tensor.is_meta:
                    if id(tensor) not in memo:  # keeps the meta tensor alive: ids stay unique
                        memo[id(tensor)] = (tensor, _allocated(tensor, device))
                        fresh = True
                    if memo[id(tensor)][1] is None:
                        raise CrewError(
                            f"zero.Init: {type(owner).__name__}.{name} is shared with a module in "
                            "another FSDP2 unit, which has been sharded already. Set "
                            "zero_optimization.wrap so that modules sharing a weight are in one "
                            "unit (or stay in the root).")
                    store[name] = memo[id(tensor)][1]
        if fresh:
            with torch.no_grad():
                owner.reset_parameters()


def _forget_whole(memo: dict) -> None:
    for key, (meta, _) in list(memo.items()):
        memo[key] = (meta, None)


def _allocated(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    value = torch.empty_like(meta, device=device)
    if isinstance(meta, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=meta.requires_grad)
    return value


def _own_tensors(module: torch.nn.Module, recurse: bool = False) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


def _check_resettable(model: torch.nn.Module) -> None:
    lacking = sorted({type(m).__name__ for m in model.modules()
                      if any(t.is_meta for t in _own_tensors(m)) and not hasattr(m, "reset_parameters")})
    if lacking:
        raise CrewError(
            f"zero.Init: {', '.join(lacking)} own parameters or buffers but have no "
            "reset_parameters(), so crew cannot initialise them after building on the meta device. "
            "Add a reset_parameters() that initialises the module's own tensors, or build the model "
            "outside `with crew.zero.Init():`.")


def _agreed_rng_state() -> torch.Tensor:
    """Rank 0's random state from the end of the zero.Init block: the same values on every rank."""
    state = _INIT_RNG_STATE.clone() if _INIT_RNG_STATE is not None else torch.get_rng_state()
    if comm.get_world_size() > 1:
        comm.broadcast(state, 0)
    return state


# -- GatheredParameters -----------------------------------------------------------------------

class GatheredParameters:
    """DeepSpeed's `with GatheredParameters(params, modifier_rank=None):` at every stage.

    Inside the block each sharded parameter is whole: the module attribute that holds it is
    swapped for a full copy (`model.layer.weight` is the full tensor), and `as` gives the full
    tensors in order. With `modifier_rank=r`, what rank r wrote is broadcast and written back into
    every rank's shard (and into the fp32 master weights) on exit; with None, changes are dropped.
    Every rank must enter with the same parameters, as in DeepSpeed."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True) -> None:
        world = comm.get_world_size()
        if modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world):
            raise CrewError(f"GatheredParameters(modifier_rank={modifier_rank!r}): give the rank whose "
                            f"changes are kept, 0..{world - 1}, or None to drop changes.")
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._full: list[torch.Tensor] = []
        self._kept: list[torch.Tensor | None] = []
        self._swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def __enter__(self) -> list[torch.Tensor]:
        if not self.enabled:
            return self.params
        self._full = [_gather(p) for p in self.params]
        self._kept = [p.detach().clone() if full is p and self.modifier_rank is None else None
                      for p, full in zip(self.params, self._full)]
        self._swapped = [(owner, name, param) for param, full in zip(self.params, self._full)
                         if full is not param for owner, name in _owners(param)]
        by_id = {id(p): f for p, f in zip(self.params, self._full)}
        for owner, name, param in self._swapped:
            owner._parameters[name] = by_id[id(param)]
        return self._full

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for owner, name, param in self._swapped:
            owner._parameters[name] = param
        with torch.no_grad():
            if self.modifier_rank is None:
                for param, kept in zip(self.params, self._kept):
                    if kept is not None:
                        param.copy_(kept)
            elif exc[0] is None:
                for param, full in zip(self.params, self._full):
                    _write_back(param, full, self.modifier_rank)
        self._full, self._swapped, self._kept = [], [], []


def _gather(param: torch.Tensor) -> torch.Tensor:
    """A whole copy of a sharded param; an unsharded one is itself (its values are kept aside so
    that, without a modifier rank, changes are dropped at every stage alike)."""
    if not _is_dtensor(param):
        return param
    with torch.no_grad():
        full = param.full_tensor()
    return torch.nn.Parameter(full, requires_grad=param.requires_grad)


def _write_back(param: torch.Tensor, full: torch.Tensor, source: int) -> None:
    if comm.get_world_size() > 1:
        comm.broadcast(full.data, source)
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor
        mine = distribute_tensor(full.data, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(mine.to_local())
    for master in _masters_of(param):
        master.copy_(param)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")


def _owners(param: torch.Tensor) -> Iterable[tuple[torch.nn.Module, str]]:
    for engine in live_engines():
        for module in engine.module.modules():
            for name, value in module._parameters.items():
                if value is param:
                    yield module, name


def _masters_of(param: torch.Tensor) -> Iterable[torch.Tensor]:
    for engine in live_engines():
        master = engine.precision.master_of(param)
        if master is not param:
            yield master
