"""fp32 / bf16 / fp16 training: casting the model, fp32 master weights, dynamic loss scaling.

The engine holds one `Precision` (from `make_precision`) and calls its hooks (fp32: no-ops). For fp16 and
bf16 the model's parameters are cast to the low-precision dtype while the optimizer steps fp32 master copies,
as DeepSpeed does (`deepspeed/runtime/fp16/fused_optimizer.py`, `deepspeed/runtime/bf16_optimizer.py`):

    precision.cast_module(model)                      # once, before wrapping (DDP / ZeRO)
    optimizer = make_optimizer(precision.master_params(trainable))
    loss = model(batch); precision.scale_loss(loss).backward()     # each micro-step
    with precision.guard():                           # optional: clear errors for missing kernels
        ...
    overflow = precision.unscale_grads()              # once per step, after gradient sync
    if not overflow:
        clip(master params); optimizer.step(); precision.copy_master_to_model()
    precision.update_scale(overflow)                  # logs and counts a skipped step
    precision.zero_model_grads()

fp16 uses DeepSpeed's `DynamicLossScaler` rules (`deepspeed/runtime/fp16/loss_scaler.py`), matched
step for step: the scale starts at 2**initial_scale_power; an overflow first spends hysteresis and
only then halves the scale (never below min_loss_scale; an overflow when the scale is already at the
minimum is an error, as in DeepSpeed); the scale doubles when (iteration - last overflow - 1) is a
positive multiple of loss_scale_window. A static scale (fp16.loss_scale > 0) never changes; an
overflowing step is still skipped. bf16 has no loss scale. At ZeRO stage 2 each rank keeps only the
masters of the params it owns (`drop_masters`) and holds only their gradients.

torch 2.13 (CPU build), probed op by op in fp16 and bf16: the common layers, attention, RNNs, losses,
forward and backward, SGD/AdamW/clip_grad_norm_ on half tensors, and gloo's collectives of half tensors
all work; torch.linalg, torch.fft, cdist, ctc_loss and multi_margin_loss are missing. Older builds lack
even fp16 addmm on CPU: `check_supported` probes the basics once per (dtype, device type) and
`Precision.guard` turns a missing kernel met later into a CrewError naming the op.

With the optimizer offloaded (ZeRO stages 1-2, `offload_optimizer`), the fp32 masters live on the CPU, in
fp32 training too: gradients go to them, the optimizer steps there, the masters are copied back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from crew.errors import ConfigError, CrewError
from crew.runtime.casting import cast_parameters

__all__ = ["DynamicLossScaler", "LossScaler", "Precision", "check_supported", "make_precision"]

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_CONFIG_KEYS = {torch.float16: "fp16.enabled", torch.bfloat16: "bf16.enabled"}


def _number(value: float) -> str:
    """A loss scale as DeepSpeed prints it: 65536, not 65536.0; 0.5 stays 0.5."""
    return str(int(value)) if float(value).is_integer() else str(value)


# ---------------------------------------------------------------------------------------------
# Loss scalers


class LossScaler:
    """A fixed loss scale (fp16.loss_scale > 0): overflowing steps are skipped, the scale stays."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            logger.info("OVERFLOW! Skipping step. Static loss scale %s (fp16.loss_scale) "
                        "stays; set fp16.loss_scale to 0 for dynamic scaling.", _number(self.cur_scale))

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic": False, "cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(LossScaler):
    """DeepSpeed's DynamicLossScaler (deepspeed/runtime/fp16/loss_scaler.py), same arithmetic.

    `delayed_shift` is fp16.hysteresis: how many overflows in a row (or, without consecutive
    hysteresis, since the last growth) are tolerated before the scale halves.
    """

    dynamic = True

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, scale_factor: float = 2.0) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                previous = self.cur_scale
                self.cur_scale *= self.scale_factor
                logger.info("No overflow for %d iterations: loss scale %s -> %s",
                            self.scale_window, _number(previous), _number(self.cur_scale))
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        # Hysteresis is spent first; the scale moves only once it is down to 1. DeepSpeed checks the
        # minimum before halving and raises there, leaving every counter untouched.
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale:
                raise CrewError(
                    f"fp16: gradients overflowed (inf/nan) with the loss scale already at its minimum "
                    f"{_number(self.min_scale)} (fp16.min_loss_scale), iteration {self.cur_iter}; it "
                    f"cannot go lower. The gradients are not finite even barely scaled: look for "
                    f"inf/nan in the loss or inputs, lower the learning rate, or train in bf16 "
                    f"(bf16.enabled: true, fp16.enabled: false).")
            next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            logger.info("OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s",
                        _number(self.cur_scale), _number(next_scale))
            self.cur_scale = next_scale
        else:
            logger.info("OVERFLOW! Skipping step. Attempted loss scale: %s, but hysteresis is "
                        "%d. Reducing hysteresis to %d", _number(self.cur_scale), self.cur_hysteresis,
                        self.cur_hysteresis - 1)
            self.cur_hysteresis -= 1

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic": True, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])
        if state.get("dynamic"):
            self.cur_iter = int(state["cur_iter"])
            self.last_overflow_iter = int(state["last_overflow_iter"])
            # As DeepSpeed: a checkpoint without the counter restarts with full hysteresis.
            self.cur_hysteresis = int(state.get("cur_hysteresis", self.delayed_shift))


# ---------------------------------------------------------------------------------------------
# What the device can do


def _probe_ops(dtype: torch.dtype, device: torch.device) -> None:
    """Linear + matmul forward/backward and cross_entropy in `dtype`: what every model needs. Its
    own generator only: the script's random stream must not depend on whether crew probed."""
    generator = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randn(*shape, generator=generator).to(device=device, dtype=dtype).requires_grad_()
                       for shape in ((4, 8), (4,), (3, 8)))
    hidden = torch.nn.functional.linear(x, weight, bias) @ torch.ones(4, 4, device=device, dtype=dtype)
    loss = torch.nn.functional.cross_entropy(hidden, torch.tensor([0, 1, 2], device=device))
    loss.backward()


@functools.cache
def _first_failure(dtype: torch.dtype, device_type: str) -> str | None:
    """The error of the probe in `dtype` on a `device_type` device, or None when it runs."""
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return f"this GPU ({torch.cuda.get_device_name()}) has no bf16 support"
    try:
        _probe_ops(dtype, torch.device(device_type))
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return f"{type(exc).__name__}: {first_line}"
    return None


def check_supported(dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise CrewError when `dtype` training cannot run on `device` (probed once per device type)."""
    device = torch.device(device)
    if dtype == torch.float32 or device.type == "meta":
        return
    failure = _first_failure(dtype, device.type)
    if failure is None:
        return
    name = _DTYPE_NAMES.get(dtype, str(dtype))
    other = "bf16.enabled: true" if dtype == torch.float16 else "fp16.enabled: true"
    raise CrewError(
        f"{name} is not supported on {device.type.upper()} with torch {torch.__version__}: a Linear "
        f"forward/backward in {dtype} failed ({failure}). Set {_CONFIG_KEYS[dtype]} to false to "
        f"train in fp32, or try {other}.")


_C10_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16"}
_MIXED_DTYPES = re.compile(r"must have the same dtype|should be the same|does not match weight "
                           r"dtype|expected scalar type")


def _missing_kernel(text: str, dtype: torch.dtype) -> re.Match | None:
    """torch's ways of saying an op has no kernel for `dtype` (checked on torch 2.13)."""
    c10 = _C10_NAMES[dtype]
    for pattern in (rf"\"(?P<op>[^\"]+)\" not implemented for '{c10}'",
                    rf"(?P<op>[\w.]+): Low precision dtypes not supported. Got {c10}",
                    rf"Unsupported dtype {c10}"):
        match = re.search(pattern, text)
        if match:
            return match
    return None


def _explain(exc: BaseException, dtype: torch.dtype, device: str) -> str | None:
    """A fix-it message for a low-precision failure inside the model, or None when it is not one."""
    text = str(exc)
    name, key = _DTYPE_NAMES[dtype], _CONFIG_KEYS[dtype]
    match = _missing_kernel(text, dtype)
    if match:
        op = match.groupdict().get("op")
        where = f"op '{op}'" if op else "an op in the model"
        return (f"{name} is not supported on {device} for {where} (torch {torch.__version__}: "
                f"{text.splitlines()[0]}). Run that op in float32 inside the model (call it on "
                f"x.float() and cast the result back), or set {key} to false to train in fp32.")
    # An fp32 input reaching a cast layer; LayerNorm/BatchNorm on CPU say "mixed dtype" instead.
    mentions_dtype = _C10_NAMES[dtype] in text or str(dtype) in text
    if "mixed dtype" in text or (mentions_dtype and _MIXED_DTYPES.search(text)):
        auto_cast = ' or set "fp16": {"auto_cast": true};' if dtype == torch.float16 else ";"
        return (f"the model was cast to {dtype} ({key}) but a layer got an input of another dtype "
                f"({text.splitlines()[0]}). Cast floating-point inputs to {dtype} before the "
                f"forward, e.g. x.to({dtype}),{auto_cast} DeepSpeed does not cast them by default either.")
    return None


# ---------------------------------------------------------------------------------------------
# Precision


class Precision:
    """fp32: the model trains as it is and every hook is a no-op."""

    dtype: torch.dtype = torch.float32

    def __init__(self) -> None:
        self.skipped_steps = 0
        self._model_params: list[torch.nn.Parameter] = []

    @property
    def name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def loss_scale(self) -> float:
        return 1.0

    @property
    def sharded_compute_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2's MixedPrecisionPolicy gathers parameters in (None: as they are)."""
        return None

    def cast_module(self, module: torch.nn.Module) -> None:
        pass

    def master_params(self, model_params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        params = list(model_params)
        known = {id(p) for p in self._model_params}
        self._model_params += [p for p in params if id(p) not in known]
        return params

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor the optimizer steps for `param` (the param itself under fp32)."""
        return param

    def master_pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(model param, its fp32 master) for each master this rank keeps."""
        return []

    def drop_masters(self, params: Iterable[torch.Tensor]) -> None:
        """ZeRO stage 2: other ranks keep these params' masters (master_of gives the param here)."""

    def unscale_grads(self) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1

    def copy_master_to_model(self) -> None:
        pass

    def zero_model_grads(self) -> None:
        for param in self._model_params:
            param.grad = None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap forward/backward: a missing low-precision kernel becomes a CrewError naming the op."""
        yield

    def state_dict(self) -> dict[str, Any]:
        return {"dtype": self.name, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))


class _MasterWeights(Precision):
    """bf16 (and the base of fp16): low-precision model, fp32 master copies that the optimizer steps."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.master_device: torch.device | None = None  # None: the parameter's; the CPU when offloaded
        self.pin_masters = False  # offload_optimizer.pin_memory: page-locked CPU masters, for full-speed copies
        self._masters: list[torch.nn.Parameter] = []
        self._with_master: list[torch.nn.Parameter] = []  # the model params of _masters, in order
        self._master_of: dict[int, torch.nn.Parameter] = {}
        self._device = "cpu"

    def cast_module(self, module: torch.nn.Module) -> None:
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        self._device = device.type
        check_supported(self.dtype, device)
        cast_parameters(module, self.dtype)  # buffers keep their dtype, as in DeepSpeed (casting.cast_buffers)

    def master_params(self, model_params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """fp32 leaf copies of `model_params`, in order; asking again for a param gives the same copy."""
        result = []
        for param in model_params:
            if id(param) not in self._master_of:
                device = self.master_device or param.device
                master = param.detach().to(device, torch.float32, copy=True)
                if self.pin_masters and device.type == "cpu" and param.device.type == "cuda":
                    master = master.pin_memory()
                master = torch.nn.Parameter(master)
                self._master_of[id(param)] = master
                self._model_params.append(param)
                self._with_master.append(param)
                self._masters.append(master)
            result.append(self._master_of[id(param)])
        return result

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        return self._master_of.get(id(param), param)

    def master_pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return list(self._pairs())

    def drop_masters(self, params: Iterable[torch.Tensor]) -> None:
        dropped = {id(param) for param in params}
        kept = [(param, master) for param, master in self._pairs() if id(param) not in dropped]
        self._with_master, self._masters = [p for p, _ in kept], [m for _, m in kept]
        for key in dropped:
            self._master_of.pop(key, None)

    def _pairs(self) -> Iterator[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return zip(self._with_master, self._masters)

    def _move_grads(self, scale: float) -> None:
        for param, master in self._pairs():
            if param.grad is None:
                master.grad = None
                continue
            # copy=True: a model param left in fp32 must not have its own grad scaled in place
            grad = param.grad.detach().to(master.device, torch.float32, copy=True)
            master.grad = grad.mul_(1.0 / scale) if scale != 1.0 else grad

    def unscale_grads(self) -> bool:
        self._move_grads(1.0)
        return False

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        for param, master in self._pairs():
            param.copy_(master)

    def zero_model_grads(self) -> None:
        super().zero_model_grads()
        for master in self._masters:
            master.grad = None

    def guard(self) -> contextlib.AbstractContextManager:
        return _explained(self.dtype, self._device)

    def state_dict(self) -> dict[str, Any]:
        # The fp32 masters carry the bits the model copy lost; DeepSpeed saves them as well.
        masters = [master.detach().clone() for master in self._masters]
        return {**super().state_dict(), "master_params": masters}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("master_params")
        if saved is None:  # e.g. a checkpoint from an fp32 run: start from the model's values
            for param, master in self._pairs():
                master.copy_(param)
            return
        if len(saved) != len(self._masters):
            raise CrewError(f"precision state has {len(saved)} fp32 master params, this model has "
                            f"{len(self._masters)}: load a checkpoint of the same model.")
        for index, (master, value) in enumerate(zip(self._masters, saved)):
            if master.shape != value.shape:
                raise CrewError(f"precision state: fp32 master param {index} has shape "
                                f"{tuple(value.shape)}, the model's has {tuple(master.shape)}: load a "
                                f"checkpoint of the same model.")
            master.copy_(value)
        self.copy_master_to_model()


@contextlib.contextmanager
def _explained(dtype: torch.dtype, device: str) -> Iterator[None]:
    try:
        yield
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        message = _explain(exc, dtype, device.upper())
        if message is None:
            raise
        raise CrewError(message) from exc


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True when `flag` is set on any rank: every rank must skip the same steps or they diverge."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class _Fp16(_MasterWeights):
    """fp16: bf16's master weights plus a loss scale, and steps skipped on inf/nan gradients."""

    def __init__(self, scaler: LossScaler) -> None:
        super().__init__(torch.float16)
        self.scaler = scaler

    @property
    def loss_scale(self) -> float:
        return self.scaler.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.scaler.cur_scale

    def _found_overflow(self) -> bool:
        return _overflow(self._model_params)

    def unscale_grads(self) -> bool:
        # As FP16_Optimizer.step: check the fp16 grads first, skip with cleared master grads on
        # overflow, else move them to the fp32 masters divided by the scale.
        if self._found_overflow():
            for master in self._masters:
                master.grad = None
            return True
        self._move_grads(self.scaler.cur_scale)
        return False

    def update_scale(self, overflow: bool) -> None:
        self.scaler.update_scale(overflow)  # first: at the minimum scale it raises
        super().update_scale(overflow)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


def _overflow(params: list[torch.nn.Parameter]) -> bool:
    """An inf/nan in any gradient on any rank (a DTensor grad: the shard this rank holds; at ZeRO
    stage 2 a rank may hold none, and still takes part)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else params[0].device if params else torch.device("cpu")
    finite = [torch.isfinite(g).all().to(device) for g in grads]  # one sync, not one per grad
    local = bool(torch.stack(finite).logical_not().any()) if grads else False
    return _any_rank(local, device)


class _Sharded(Precision):
    """fp16/bf16 under ZeRO stage 3: the fp32 sharded parameters are the master weights and
    FSDP2's MixedPrecisionPolicy gathers them in the 16-bit dtype for compute. fp16 keeps the loss
    scale: gradients are checked for inf/nan and unscaled in place."""

    def __init__(self, dtype: torch.dtype, scaler: LossScaler | None) -> None:
        super().__init__()
        self.dtype = dtype
        self.scaler = scaler
        self._device = "cpu"

    @property
    def sharded_compute_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def loss_scale(self) -> float:
        return self.scaler.cur_scale if self.scaler else 1.0

    def cast_module(self, module: torch.nn.Module) -> None:
        first = next(module.parameters(), None)
        device = first.device if first is not None and not first.is_meta else torch.device("cpu")
        self._device = device.type
        check_supported(self.dtype, device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.scaler.cur_scale if self.scaler else loss

    @torch.no_grad()
    def unscale_grads(self) -> bool:
        if self.scaler is None:
            return False
        if _overflow(self._model_params):
            self.zero_model_grads()
            return True
        for param in self._model_params:
            if param.grad is not None and self.scaler.cur_scale != 1.0:
                param.grad.mul_(1.0 / self.scaler.cur_scale)
        return False

    def update_scale(self, overflow: bool) -> None:
        if self.scaler is not None:
            self.scaler.update_scale(overflow)
        super().update_scale(overflow)

    def guard(self) -> contextlib.AbstractContextManager:
        return _explained(self.dtype, self._device)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "loss_scaler": self.scaler.state_dict()} if self.scaler else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


# ---------------------------------------------------------------------------------------------
# Config


def _positive_int(config: Any, key: str) -> int:
    value = getattr(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"fp16.{key} must be an integer >= 1, got {value!r}.")
    return value


def _make_scaler(fp16: Any) -> LossScaler:
    loss_scale = fp16.loss_scale
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (
            0 <= loss_scale < float("inf")):
        raise ConfigError(f"fp16.loss_scale must be a finite number >= 0 (0: dynamic loss "
                          f"scaling), got {loss_scale!r}.")
    if loss_scale > 0:
        return LossScaler(float(loss_scale))
    power = fp16.initial_scale_power
    if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power < 128:
        raise ConfigError(f"fp16.initial_scale_power must be an integer in [0, 127] (the first "
                          f"scale is 2**power), got {power!r}.")
    min_scale = fp16.min_loss_scale
    if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) or not (
            0 < min_scale < float("inf")):
        raise ConfigError(f"fp16.min_loss_scale must be a finite number > 0, got {min_scale!r}.")
    return DynamicLossScaler(init_scale=2.0 ** power,
                             scale_window=_positive_int(fp16, "loss_scale_window"),
                             min_scale=min_scale,
                             delayed_shift=_positive_int(fp16, "hysteresis"),
                             consecutive_hysteresis=bool(fp16.consecutive_hysteresis))


def make_precision(fp16_config: Any, bf16_config: Any, sharded: bool = False, offload: dict | None = None) -> Precision:
    """The Precision for the config's fp16 / bf16 sections (either may be None: disabled);
    `sharded`: for ZeRO stage 3, where FSDP2 does the casting; `offload` ({"pin_memory": bool}): the fp32
    masters (in fp32 training too) on the CPU, where the optimizer steps them (ZeRO stages 1-2)."""
    fp16_on = bool(getattr(fp16_config, "enabled", False))
    bf16_on = bool(getattr(bf16_config, "enabled", False))
    if fp16_on and bf16_on:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; pick one: set "
                          "bf16.enabled to false for fp16 with loss scaling, or fp16.enabled to "
                          "false for bf16.")
    if sharded and (fp16_on or bf16_on):
        return _Sharded(torch.float16, _make_scaler(fp16_config)) if fp16_on \
            else _Sharded(torch.bfloat16, None)
    precision = _Fp16(_make_scaler(fp16_config)) if fp16_on else _MasterWeights(torch.bfloat16) if bf16_on \
        else _MasterWeights(torch.float32) if offload else Precision()
    if offload:
        precision.master_device, precision.pin_masters = torch.device("cpu"), offload["pin_memory"]
    return precision
