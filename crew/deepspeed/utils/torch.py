"""`deepspeed.utils.torch`: DeepSpeed's torch-version helpers, which scripts and kernels call before using a
newer torch API."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

__all__ = ["register_grad_hook", "required_torch_version"]


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the installed torch is within [min_version, max_version] (either may be left out)."""
    assert min_version or max_version, "Must provide a min_version or max_version argument"
    installed = TorchVersion(torch.__version__)
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))


def register_grad_hook(param: torch.nn.Parameter, hook):
    """`hook(param)` after each accumulation of its gradient; the handle removes it."""
    return param.register_post_accumulate_grad_hook(hook)
