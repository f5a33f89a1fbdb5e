"""DeepSpeed `optimizer` / `scheduler` config sections -> torch.optim objects.

Optimizers follow `DeepSpeedEngine._configure_basic_optimizer` (deepspeed/runtime/engine.py, 0.19.1):
"Adam"/"AdamW"/"Adagrad"/"Lion" match case-insensitively; other names are looked up on torch.optim. DeepSpeed's
"Adam" is FusedAdam in AdamW mode, so it becomes torch.optim.AdamW with FusedAdam's defaults
(weight_decay 0.0, not torch's 0.01) unless `torch_adam` asks for torch's classes as they are. "Lion" is
DeepSpeedCPULion where the config offloads the optimizer, else FusedLion (crew/runtime/optim/lion.py), as in DeepSpeed.

Schedulers follow deepspeed/runtime/lr_schedules.py (0.19.1): one class per DeepSpeed schedule, same
parameter names and defaults, same lr at construction and after every step(), same
`{"last_batch_iteration": n}` state dict, so checkpoints move between crew and DeepSpeed. Other names
are looked up on torch.optim.lr_scheduler, as DeepSpeed does. Where crew departs from 0.19.1 the class
docstring says so; each departure is a fix DeepSpeed merged later.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from crew.errors import ConfigError
from crew.runtime.optim import adam, lion

__all__ = [
    "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "adam_kernel", "build_optimizer",
    "build_scheduler",
]  # fmt: skip

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------- optimizers

# FusedAdam.__init__ defaults (deepspeed/ops/adam/fused_adam.py): what "Adam"/"AdamW" get without torch_adam.
_FUSED_ADAM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
    "amsgrad": False, "set_grad_none": True,
}  # fmt: skip
_ADAM_SWITCHES = ("torch_adam", "adam_w_mode")  # engine.py pops these before building the optimizer
_ADAM_NAMES = ("Adam", "AdamW")
# DeepSpeed reaches these through getattr(torch.optim, type); Adagrad it names itself (same class).
_TORCH_NAMES = ("Adagrad", "SGD", "Adadelta", "Adafactor", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
_TORCH_OPTIMIZERS = {name: getattr(torch.optim, name) for name in _TORCH_NAMES if hasattr(torch.optim, name)}
SUPPORTED_OPTIMIZERS = _ADAM_NAMES + tuple(_TORCH_OPTIMIZERS) + ("Lion",)

_UNSUPPORTED_OPTIMIZERS = {
    "lamb": "DeepSpeed's FusedLamb CUDA kernel",
    "onebitadam": "DeepSpeed's 1-bit Adam, compressed communication",
    "zerooneadam": "DeepSpeed's 0/1 Adam, compressed communication",
    "onebitlamb": "DeepSpeed's 1-bit LAMB, compressed communication",
    "muadam": "mup.MuAdam", "muadamw": "mup.MuAdamW", "musgd": "mup.MuSGD",
    "muon": "DeepSpeed's MuonWithAuxAdam, which needs param.use_muon",
    "lbfgs": "torch.optim.LBFGS, whose step() needs a closure the engine does not pass",
    "sparseadam": "torch.optim.SparseAdam, which needs sparse gradients",
}  # fmt: skip
# DeepSpeed class names people paste into `type`; DeepSpeed picks these itself from "Adam".
_CLASS_NAMES = ("fusedadam", "cpuadam", "deepspeedcpuadam", "zenflowcpuadam")


def build_optimizer(type_name: str, params: dict | None, model_parameters: Iterable, *,
                    cpu_optimizer: bool = False) -> Optimizer:
    """The torch optimizer that DeepSpeed's `{"optimizer": {"type": ..., "params": ...}}` means.

    `cpu_optimizer`: the config offloads the optimizer (DeepSpeed's zero_use_cpu_optimizer(): offload_optimizer
    on "cpu"), whatever the device and stage; it picks DeepSpeedCPULion over FusedLion. `params` is not modified.
    Raises ConfigError naming `optimizer.type` or `optimizer.params.<key>`.
    """
    name = _optimizer_name(type_name)
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm: DeepSpeed rejects gradient clipping here. Remove it and set "
            f'the top-level "gradient_clipping": {params["max_grad_norm"]!r} instead.'
        )
    if name in _ADAM_NAMES:
        return _build_adam(name, params, model_parameters)
    if name == "Lion":  # DeepSpeed hands the params to the class as they are: its defaults apply
        cls = lion.DeepSpeedCPULion if cpu_optimizer else lion.FusedLion
        _check_keys(params, _init_keys(cls), "optimizer.params", f"Lion ({cls.__name__})")
        return cls(model_parameters, **_checked_values(params))
    cls = _TORCH_OPTIMIZERS[name]
    _check_keys(params, _init_keys(cls), "optimizer.params", f"torch.optim.{cls.__name__}")
    return cls(model_parameters, **_checked_values(params))


def _optimizer_name(type_name: object) -> str:
    """DeepSpeed lowercases its own names; crew also forgives case on the torch.optim ones."""
    if not isinstance(type_name, str):
        raise ConfigError(f"optimizer.type: expected a name such as 'AdamW', got {type_name!r}.")
    key = type_name.lower()
    by_lower = {name.lower(): name for name in SUPPORTED_OPTIMIZERS}
    supported = ", ".join(SUPPORTED_OPTIMIZERS)
    if key in by_lower:
        return by_lower[key]
    if key in _CLASS_NAMES:
        raise ConfigError(
            f'optimizer.type {type_name!r} is a DeepSpeed class, not a config name. Use "Adam" '
            f"(DeepSpeed picks {type_name} from it)."
        )
    if key in _UNSUPPORTED_OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type {type_name!r} ({_UNSUPPORTED_OPTIMIZERS[key]}) is not available in crew. Use one "
            f"of: {supported}; or build the optimizer yourself, pass it as crew.initialize(optimizer=...) "
            "and drop the 'optimizer' section."
        )
    raise ConfigError(
        f"optimizer.type {type_name!r} is not a DeepSpeed or torch.optim optimizer."
        f"{_did_you_mean(type_name, SUPPORTED_OPTIMIZERS)} Supported: {supported}."
    )


def _build_adam(name: str, params: dict, model_parameters: Iterable) -> Optimizer:
    torch_adam = _flag("optimizer.params.torch_adam", params.pop("torch_adam", False))
    adam_w_mode = _flag("optimizer.params.adam_w_mode", params.pop("adam_w_mode", True))
    # engine.py: the name "AdamW" forces decoupled weight decay; "Adam" follows adam_w_mode (default on).
    cls = torch.optim.AdamW if name == "AdamW" or adam_w_mode else torch.optim.Adam
    if torch_adam:
        # DeepSpeed hands the params to torch untouched, so torch's defaults apply: AdamW's weight_decay is 0.01.
        _check_keys(params, _init_keys(cls) + _ADAM_SWITCHES, "optimizer.params", f"{name} with torch_adam")
        return cls(model_parameters, **_checked_values(params))
    _check_keys(params, tuple(_FUSED_ADAM_DEFAULTS) + _ADAM_SWITCHES, "optimizer.params", f"{name} (FusedAdam)")
    merged = {**_FUSED_ADAM_DEFAULTS, **params}
    if merged["amsgrad"] is not False:
        raise ConfigError(
            "optimizer.params.amsgrad: DeepSpeed's FusedAdam rejects AMSGrad. Remove the key, or add "
            '"torch_adam": true for torch.optim.Adam/AdamW, which support it.'
        )
    if merged["set_grad_none"] is not True:
        logger.warning("optimizer.params.set_grad_none=%r is ignored: zero_grad() sets gradients to None, "
                       "as FusedAdam does by default.", merged["set_grad_none"])  # fmt: skip
    kwargs = {key: merged[key] for key in ("lr", "betas", "eps", "weight_decay")}
    if not _flag("optimizer.params.bias_correction", merged["bias_correction"]):
        # FusedAdam's bias_correction=False, which torch's Adam cannot do (crew/runtime/optim/adam.py)
        cls, kwargs["bias_correction"] = (adam.AdamW if cls is torch.optim.AdamW else adam.Adam), False
    model_parameters = list(model_parameters)
    return cls(model_parameters, **_checked_values(kwargs), **adam_kernel(model_parameters))


def adam_kernel(params: Iterable) -> dict[str, bool]:
    """{"fused": True} when every parameter is a plain CUDA tensor: torch's fused Adam kernel, where
    DeepSpeed runs its FusedAdam kernel. Otherwise torch's own choice (foreach on CUDA, a loop on the
    CPU, and for ZeRO 2-3's sharded DTensors)."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    plain_cuda = [p.is_cuda and type(p) in (torch.Tensor, torch.nn.Parameter) for p in tensors]
    return {"fused": True} if tensors and all(plain_cuda) else {}


def _checked_values(kwargs: dict) -> dict:
    """Name the config key for the common values torch would reject without saying which key it was."""
    for key in ("lr", "eps", "weight_decay", "momentum"):
        if key in kwargs:
            _number(f"optimizer.params.{key}", kwargs[key])
    if "betas" in kwargs:
        betas = kwargs["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise ConfigError(f"optimizer.params.betas: expected two numbers like [0.9, 0.999], got {betas!r}.")
        for beta in betas:
            _number("optimizer.params.betas", beta, below=1.0)
        kwargs = {**kwargs, "betas": tuple(betas)}
    return kwargs


# ---------------------------------------------------------------------------------------- schedulers


class _Schedule:
    """DeepSpeed's scheduler contract: the lr is a function of `last_batch_iteration` alone.

    At construction (last_batch_iteration == -1) the "before the first step" lr is written into the
    optimizer; each step() advances the iteration and writes the next lr. state_dict() holds only the
    iteration, as DeepSpeed's does; load_state_dict() leaves the optimizer alone (its state dict has the lr).
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = _integer("last_batch_iteration", last_batch_iteration, minimum=-1)
        self._last_lr: list[float] | None = None

    def _start(self, lrs: list[float]) -> None:
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, lrs)

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The lr last written into the optimizer: at construction, or by the latest step()."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__} was built to resume at an iteration; call step() first.")
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_batch_iteration = state_dict["last_batch_iteration"]

    def _groups(self) -> int:
        return len(self.optimizer.param_groups)


class LRRangeTest(_Schedule):
    """lr = min_lr * (1 + step_rate * interval), interval = (it + 1) / step_size, floored if staircase.

    Construction sets lr = lr_range_test_min_lr; the first step() (it = 0) already raises it.
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group("lr_range_test_min_lr", lr_range_test_min_lr, self._groups())
        self.step_size = _number("lr_range_test_step_size", lr_range_test_step_size, positive=True)
        self.step_rate = _number("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = _flag("scheduler.params.lr_range_test_staircase", lr_range_test_staircase)
        self._start(self.min_lr)

    def get_lr(self) -> list[float]:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)


class OneCycle(_Schedule):
    """1Cycle: lr climbs cycle_min_lr -> cycle_max_lr over cycle_first_step_size steps, comes back over
    cycle_second_step_size, then is min_lr / (1 + decay_lr_rate * (it - cycle + 1) / decay_step_size).

    With cycle_momentum, beta1 moves the other way (max_mom - (max_mom - min_mom) * scale) and after the
    cycle is max_mom * (1 + decay_mom_rate * interval). As in DeepSpeed: construction sets lr =
    cycle_min_lr and betas = (cycle_min_mom, 0.99); beta2 is forced to 0.99; the post-cycle momentum
    "decay" grows beta1 (past 1 if run long enough); an optimizer without `betas` (SGD) keeps its
    momentum, with a warning. Departure from 0.19.1, where stair counts did nothing: a stair count > 0
    holds lr and momentum flat on that many stairs per half cycle (DeepSpeed PR #8179). The lrs and
    momenta are one number or a list of one per param group, as in DeepSpeed 0.19.8.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.first_step_size = float(_number("cycle_first_step_size", cycle_first_step_size, positive=True))
        self.second_step_size = float(_number("cycle_second_step_size", second))
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.first_stair_count = _integer("cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = _integer("cycle_second_stair_count", second_stairs)
        self.decay_step_size = _number("decay_step_size", decay_step_size)
        self.min_lrs = _per_group("cycle_min_lr", cycle_min_lr, self._groups())
        self.max_lrs = _per_group("cycle_max_lr", cycle_max_lr, self._groups())
        self.decay_lr_rate = _number("decay_lr_rate", decay_lr_rate, minimum=-math.inf)
        self.decay_mom_rate = _number("decay_mom_rate", decay_mom_rate, minimum=-math.inf)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.min_moms = [(mom, 0.99) for mom in _per_group("cycle_min_mom", cycle_min_mom, self._groups())]
        self.max_moms = [(mom, 0.99) for mom in _per_group("cycle_max_mom", cycle_max_mom, self._groups())]
        self.cycle_momentum = _flag("scheduler.params.cycle_momentum", cycle_momentum)
        if self.cycle_momentum and "betas" not in self.optimizer.defaults:
            logger.warning("OneCycle: cycle_momentum is off because %s has no 'betas'; DeepSpeed cycles only "
                           "Adam-style beta1. Set \"cycle_momentum\": false to silence this.",
                           type(self.optimizer).__name__)  # fmt: skip
            self.cycle_momentum = False
        self._start(self.min_lrs)
        if self.last_batch_iteration == -1 and self.cycle_momentum:
            _set_betas(self.optimizer, self.min_moms)

    def _scale_factor(self) -> float:
        """Where in the cycle: 0 at cycle_min_lr, 1 at cycle_max_lr (DeepSpeed's float formula as is)."""
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # From the integer offset, not `scale`: at a half-cycle edge the float can sit 1e-16 under a stair.
            offset = batch_iteration % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * self._decay_interval()) for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        return [(b1 * (1 + self.decay_mom_rate * self._decay_interval()), b2) for b1, b2 in self.max_moms]

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            _set_betas(self.optimizer, self.get_mom())


class WarmupLR(_Schedule):
    """lr = min_lr + (max_lr - min_lr) * gamma; over warmup_num_steps (at least 2) gamma is
    ln(it + 1) / ln(warmup_num_steps) for "log" or it / warmup_num_steps for "linear", then 1.0.

    Construction sets lr = warmup_min_lr and the first step() (it = 0) keeps it there. Departures from
    0.19.1: an omitted warmup_max_lr is each group's own lr (0.19.1 gave every group group 0's lr;
    DeepSpeed PR #8171). An unknown warmup_type warms up by "log" with a warning, as DeepSpeed 0.19.8.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, self._groups())
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, self._groups())
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _integer("warmup_num_steps", warmup_num_steps, minimum=0))
        self.warmup_type = _warmup_type(warmup_type)
        self._start(self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then gamma = max(0, (total - it) / max(1, total - warmup)): straight down from
    warmup_max_lr at it = warmup_num_steps to warmup_min_lr at it = total_num_steps, flat after that.

    As in DeepSpeed, an omitted warmup_max_lr is 0.001 here, not the optimizer's lr.
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:  # fmt: skip
        self.total_num_steps = _integer("total_num_steps", total_num_steps, minimum=0)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_short_total(self.total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """lr = base_lr * ratio, base_lr being each group's lr when the scheduler is built.

    Warmup: ratio = warmup_min_ratio + gamma * (1 - warmup_min_ratio), gamma as in WarmupLR. Then
    ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2, p = (it - warmup + 1) / (total -
    warmup). Construction sets lr = 0.0 (not warmup_min_ratio * lr), as DeepSpeed does. Departures from
    0.19.1, both merged in DeepSpeed later: p stops at 1, so the lr stays at cos_min_ratio * base_lr from
    it = total - 1 on (0.19.1 followed the cosine back up to base_lr), and total <= warmup no longer
    divides by zero.
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _integer("total_num_steps", total_num_steps, minimum=0)
        self.warmup_min_ratio = _number("warmup_min_ratio", warmup_min_ratio)
        self.warmup_num_steps = max(2, _integer("warmup_num_steps", warmup_num_steps, minimum=0))
        self.cos_min_ratio = _number("cos_min_ratio", cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        _warn_short_total(self.total_num_steps, self.warmup_num_steps)
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._start(self.get_lr())

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            gamma = _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        real_total = max(1, self.total_num_steps - self.warmup_num_steps)
        real_last = min(it - self.warmup_num_steps + 1, real_total)  # the clamp; pi * a / b as DeepSpeed rounds it
        cosine = (1 + math.cos(math.pi * real_last / real_total)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS: dict[str, type[_Schedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}
# DeepSpeed falls back to getattr(torch.optim.lr_scheduler, type); these can be built from JSON alone.
_TORCH_SCHEDULERS = ("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
                     "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR",
                     "ReduceLROnPlateau")  # fmt: skip


def build_scheduler(type_name: str, params: dict | None, optimizer: Any) -> Any:
    """The scheduler that DeepSpeed's `{"scheduler": {"type": ..., "params": ...}}` means.

    `optimizer` is a torch optimizer or a wrapper holding one in `.optimizer`, as DeepSpeed accepts.
    `params` is not modified. Raises ConfigError naming `scheduler.type` or `scheduler.params.<key>`.
    """
    cls = _scheduler_class(type_name)
    params = dict(params or {})
    ours = type_name in SCHEDULERS
    _check_keys(params, _init_keys(cls), "scheduler.params", type_name if ours else f"torch's {type_name}")
    for key in _init_keys(cls, required_only=True):
        if key not in params:
            example = " (the number of optimizer steps in the run)" if key == "total_num_steps" else ""
            raise ConfigError(f'scheduler.params.{key}: {type_name} requires it. Add "{key}"{example}.')
    return cls(optimizer if ours else _torch_optimizer(optimizer), **params)


def _scheduler_class(type_name: object) -> type:
    """DeepSpeed matches scheduler names exactly (getattr), so crew does too, and suggests the near miss."""
    if not isinstance(type_name, str):
        raise ConfigError(f"scheduler.type: expected a name such as 'WarmupLR', got {type_name!r}.")
    if type_name in SCHEDULERS:
        return SCHEDULERS[type_name]
    if type_name in _TORCH_SCHEDULERS and hasattr(torch.optim.lr_scheduler, type_name):
        return getattr(torch.optim.lr_scheduler, type_name)
    raise ConfigError(
        f"scheduler.type {type_name!r} is not a DeepSpeed or torch.optim.lr_scheduler schedule (names are "
        f"case-sensitive).{_did_you_mean(type_name, tuple(SCHEDULERS) + _TORCH_SCHEDULERS)} Supported: "
        f"{', '.join(SCHEDULERS)}; from torch: {', '.join(_TORCH_SCHEDULERS)}."
    )


# ------------------------------------------------------------------------------------------- helpers


def _warmup_gamma(it: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Warmup progress. DeepSpeed multiplies by 1/ln(n) rather than dividing; kept so the floats match."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup_num_steps)) * math.log(it + 1)
    return it / warmup_num_steps


def _warn_short_total(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        logger.warning("scheduler.params.total_num_steps %d is less than warmup_num_steps %d; the lr leaves "
                       "warmup straight for its final value.", total_num_steps, warmup_num_steps)  # fmt: skip


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """DeepSpeed's get_torch_optimizer: the optimizer itself, or the one a wrapper holds."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(getattr(optimizer, "optimizer", None), Optimizer):
        return optimizer.optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and has none in .optimizer")


def _set_lrs(optimizer: Optimizer, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)  # keep the tensor: capturable/compiled steps hold a reference to it
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


def _set_betas(optimizer: Optimizer, betas: list[tuple[float, float]] | None) -> None:
    for group, pair in zip(optimizer.param_groups, betas or []):
        group["betas"] = pair


def _init_keys(cls: type, required_only: bool = False) -> tuple[str, ...]:
    """Keyword parameters of cls.__init__ after self and the first one (params / optimizer)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    found = [p for p in inspect.signature(cls.__init__).parameters.values() if p.kind in kinds][2:]
    return tuple(p.name for p in found if not required_only or p.default is inspect.Parameter.empty)


def _check_keys(params: dict, accepted: tuple[str, ...], section: str, owner: str) -> None:
    for key in params:
        if key not in accepted:
            raise ConfigError(
                f"{section}.{key}: {owner} has no parameter {key!r}.{_did_you_mean(key, accepted)} "
                f"Accepted: {', '.join(accepted)}."
            )


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean {by_lower[close[0]]!r}?" if close else ""


def _where(key: str) -> str:
    return key if "." in key else f"scheduler.params.{key}"


def _number(key: str, value: object, minimum: float = 0.0, below: float = math.inf, positive: bool = False) -> Any:
    """A JSON number >= minimum and < below (> 0 if positive), returned unchanged; bools are not numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{_where(key)}: expected a number, got {value!r}.")
    if value < minimum or value >= below or (positive and value <= 0):
        bound = "> 0" if positive else f">= {minimum}" + (f" and < {below}" if below != math.inf else "")
        raise ConfigError(f"{_where(key)}: expected a number {bound}, got {value!r}.")
    return value


def _integer(key: str, value: object, minimum: int | None = None) -> int:
    """A whole number; 1000.0 from a JSON writer counts as 1000."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_where(key)}: expected a whole number, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{_where(key)}: expected a whole number >= {minimum}, got {value!r}.")
    return value


def _flag(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}.")
    return value


def _per_group(key: str, value: object, groups: int) -> list[Any]:
    """One number for every param group, or a list of one per group (DeepSpeed's _format_param)."""
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"{_where(key)}: got {len(value)} values for {groups} optimizer param groups. "
                              "Give one number, or one per group.")  # fmt: skip
        return [_number(key, v) for v in value]
    return [_number(key, value)] * groups


def _warmup_type(value: object) -> str:
    """'log' or 'linear'; anything else warns and warms up by 'log', as DeepSpeed 0.19.8 does."""
    if value not in ("log", "linear"):
        hint = _did_you_mean(value, ("log", "linear")) if isinstance(value, str) else ""
        logger.warning("scheduler.params.warmup_type: expected 'log' or 'linear', got %r: warming up by 'log', "
                       "as DeepSpeed does.%s", value, hint)
        return "log"
    return value
