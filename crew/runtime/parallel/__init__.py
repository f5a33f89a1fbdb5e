"""The ranks' layout past data parallelism: Ulysses sequence-parallel (SP) and AutoTP tensor-parallel (TP) groups.

As in DeepSpeed 0.19.8, a group of N is N contiguous ranks (SP 2 on 4 ranks: {0, 1} and {2, 3}), and the
data-parallel size is world / N. One torch DeviceMesh holds the layout, (dp, sp) or (dp, tp), so each dimension's
process group is torch's own. SP and TP together are refused: DeepSpeed 0.19.8 does not combine them either.

Which group reduces what:
- SP: gradients are averaged and ZeRO shards over the whole world (DeepSpeed's sequence-data-parallel group).
  The SP ranks of one group together hold one sample, and each one's loss is the whole sample's (Hugging Face
  gathers it), so the world average is the data-parallel average of the samples' gradients.
- TP: each TP rank holds its own slice of the weights, so gradients are averaged and ZeRO shards over the ranks
  that hold the same slice: the data-parallel group, `data_parallel_group()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from crew.errors import ConfigError


@dataclass
class _Layout:
    kind: str  # "sp" or "tp"
    size: int
    mesh: object  # torch.distributed.device_mesh.DeviceMesh, dims ("dp", kind)


_layout: _Layout | None = None


def init_sequence_parallel(size: int, where: str = "sequence_parallel_size") -> None:
    """SP groups of `size` contiguous ranks (DeepSpeed's parallel_state_sp.initialize_sequence_parallel)."""
    _init("sp", size, where)


def init_tensor_parallel(size: int, where: str = "tensor_parallel.autotp_size") -> None:
    """TP groups of `size` contiguous ranks (DeepSpeed's groups._init_tp_mesh_device)."""
    _init("tp", size, where)


def _init(kind: str, size: int, where: str) -> None:
    global _layout
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{where} = {size!r}: expected a whole number >= 1.")
    if world % size:
        raise ConfigError(f"{where} = {size} does not divide the {world} ranks of this job: run a multiple of "
                          f"{size} ranks, or set {where} to a divisor of {world}.")
    if _layout is not None:
        if (_layout.kind, _layout.size) == (kind, size):
            return
        current = _describe(_layout.kind, _layout.size)
        raise ConfigError(f"{where} = {size} ({_describe(kind, size)}): this process already runs {current}; "
                          "crew (as DeepSpeed 0.19.8) runs one of Ulysses sequence parallelism and AutoTP "
                          "tensor parallelism at a time, with one size for the whole job.")
    if size == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh

    from crew.runtime.parallel import gloo_fix
    gloo_fix.install()  # Hugging Face's SP loss all-gathers in these groups, differentiably
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world // size, size), mesh_dim_names=("dp", kind))
    _layout = _Layout(kind, size, mesh)


def _describe(kind: str, size: int) -> str:
    return f"sequence parallel size {size}" if kind == "sp" else f"tensor parallel size {size}"


def reset() -> None:
    """Forget the layout (tests; DeepSpeed's _release_sequence_parallel_groups)."""
    global _layout
    _layout = None


def _group(kind: str):
    return _layout.mesh.get_group(kind) if _layout is not None and _layout.kind == kind else None


def sequence_parallel_size() -> int:
    return _layout.size if _layout is not None and _layout.kind == "sp" else 1


def tensor_parallel_size() -> int:
    return _layout.size if _layout is not None and _layout.kind == "tp" else 1


def sequence_parallel_group():
    """The SP group of this rank; None without SP."""
    return _group("sp")


def tensor_parallel_group():
    """The TP group of this rank; None without TP."""
    return _group("tp")


def sequence_parallel_rank() -> int:
    group = _group("sp")
    return dist.get_rank(group) if group is not None else 0


def tensor_parallel_rank() -> int:
    group = _group("tp")
    return dist.get_rank(group) if group is not None else 0


def data_parallel_size() -> int:
    """world / (SP or TP size): the samples one optimizer step sees per micro step and accumulation step."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world // (_layout.size if _layout is not None else 1)


def data_parallel_group():
    """The group gradients are averaged over and ZeRO shards across: None (the whole world) but under TP."""
    return _layout.mesh.get_group("dp") if _layout is not None and _layout.kind == "tp" else None


def data_parallel_mesh():
    """The 1-D DeviceMesh of this rank's data-parallel group under TP (ZeRO stage 3 shards each TP slice over
    it, as DeepSpeed's stage 3 over its data-parallel group); None without TP."""
    return _layout.mesh["dp"] if _layout is not None and _layout.kind == "tp" else None
