"""`deepspeed.git_version_info`: the build record DeepSpeed's setup.py writes, answered for crew: DeepSpeed's
API version, no compiled ops installed (crew builds none), the ops crew provides on torch as compatible, and the
running torch's versions in torch_info."""

from __future__ import annotations

import torch

from crew.deepspeed.ops.op_builder import compatible_ops as _compatible_ops

version = "0.19.8"
git_hash = "[none]"
git_branch = "[none]"
compatible_ops = _compatible_ops()
installed_ops = dict.fromkeys(compatible_ops, False)
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _major_minor(text: str | None) -> str:
    return ".".join(text.split(".")[:2]) if text else "0.0"


torch_info = {"version": _major_minor(torch.__version__.split("+")[0]),
              "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
              "cuda_version": _major_minor(torch.version.cuda),
              "nccl_version": ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.version.cuda else "0.0",
              "hip_version": _major_minor(torch.version.hip)}
