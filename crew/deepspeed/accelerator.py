"""`deepspeed.accelerator.get_accelerator()`: DeepSpeed's device abstraction, CUDA when present, CPU otherwise.

Same names and return values as DeepSpeed 0.19.8's CUDA_Accelerator and CPU_Accelerator, except where
DeepSpeed's CPU answer is an accident: `current_device()` is an int (DeepSpeed returns LOCAL_RANK as a
string), `is_fp16_supported()` is a bool (DeepSpeed may return None) and `communication_backend_name()`
is what crew's process group uses (gloo), never oneCCL.
"""

from __future__ import annotations

import functools
import os
import resource

import torch


class Accelerator:
    def __init__(self, cuda: bool):
        self._name = "cuda" if cuda else "cpu"
        self._cuda = cuda

    def device_name(self, device_index: int | None = None) -> str:
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """On the CPU, DeepSpeed's count is LOCAL_SIZE (its launcher's ranks on this node); torchrun's
        LOCAL_WORLD_SIZE where only that is set."""
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self._cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        if self._cuda:
            return torch.cuda.get_device_capability()[0] >= 7
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else _resident_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def pin_memory(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """0.19.5 took (tensor, align_bytes), 0.19.8 (tensor, make_copy, match_shape): both accepted."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return str(tensor.device).startswith(f"{self._name}:" if self._cuda else "cpu")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def get_accelerator() -> Accelerator:
    return Accelerator(cuda=torch.cuda.is_available() and torch.cuda.device_count() > 0)


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that the accelerator is one it knows: crew's two (cuda, cpu) always are."""
    return get_accelerator().device_name() in ("cuda", "cpu")
