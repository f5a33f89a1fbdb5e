"""Fused weights split as sub-parameters: a layer spec's `shape` and `partition_dim` (DeepSpeed 0.19.8's
module_inject/layers.py SubParamLinearLayer / SubParamLinearAllreduce).

The whole weight is viewed as `shape` (-1 inferred, the last dim the input's), cut along `partition_dim` into its
sub-parameters ([2, -1]: two of equal size; [[16, 8, 8], -1]: three of those sizes), and each TP rank takes its
share of every sub-parameter, in order: with gate_up_proj = [gate; up] and TP 2, rank 0 holds [gate[:n/2];
up[:n/2]]. A column layer's bias is cut the same way along the output dims; a row layer's stays whole.

`Layout` is that rule for one tensor: `cut` gives a rank its slice, `join` puts the ranks' slices back together
(gather_full, checkpoints of another TP size). As a dict (`as_dict`) it is what a checkpoint records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from crew.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    whole: tuple[int, ...]  # the whole tensor's shape
    logical: tuple[int, ...]  # the view it is cut in
    dim: int  # the dim of `logical` that is cut
    sizes: tuple[int, ...]  # the sub-parameters' sizes along `dim`
    spec: tuple = ()  # the spec's shape with the sizes at `dim`, as DeepSpeed's checkpoints record it

    def cut(self, whole: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        view = whole.detach().reshape(self.logical)
        subs = torch.split(view, list(self.sizes), dim=self.dim)
        mine = [sub.narrow(self.dim, rank * (sub.shape[self.dim] // size), sub.shape[self.dim] // size)
                for sub in subs]
        return self._flat(torch.cat(mine, dim=self.dim)).clone()

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        size = len(parts)
        widths = [s // size for s in self.sizes]
        views = [part.reshape(self.local_logical(size)).split(widths, dim=self.dim) for part in parts]
        subs = [torch.cat([view[i] for view in views], dim=self.dim) for i in range(len(self.sizes))]
        return torch.cat(subs, dim=self.dim).reshape(self.whole)

    def local_logical(self, size: int) -> list[int]:
        """A rank's slice in the logical view."""
        return [n // size if i == self.dim else n for i, n in enumerate(self.logical)]

    def local_shape(self, size: int) -> tuple[int, ...]:
        return tuple(self._flat(torch.empty(self.local_logical(size), device="meta")).shape)

    def _flat(self, local: torch.Tensor) -> torch.Tensor:
        """Back to the whole tensor's rank: the cut dim folded into the output rows, or the input columns."""
        if len(self.whole) == 1:
            return local.reshape(-1)
        if self.dim == len(self.logical) - 1:
            return local.reshape(*self.whole[:-1], -1)
        return local.reshape(-1, *self.whole[1:])

    def as_dict(self) -> dict:
        return {"whole": list(self.whole), "logical": list(self.logical), "dim": self.dim, "sizes": list(self.sizes)}

    @classmethod
    def from_dict(cls, raw: dict) -> Layout:
        return cls(tuple(raw["whole"]), tuple(raw["logical"]), int(raw["dim"]), tuple(raw["sizes"]))

    def deepspeed_shape(self) -> list:
        """The shape DeepSpeed's universal_checkpoint_info gives a sub-parameter weight: [(32, 32), -1]."""
        return [tuple(self.sizes) if i == self.dim else d for i, d in enumerate(self.spec or self.logical)]


def weight_layout(weight_shape: tuple[int, ...], shape: tuple, dim: int, where: str) -> Layout:
    """A spec's `shape` and `partition_dim` resolved against a 2-D weight (DeepSpeed's
    _infer_subparam_logical_shapes): the inferred dims filled in, the sub-parameters' sizes."""
    spec = shape[dim]
    sizes = tuple(spec) if isinstance(spec, tuple) else None
    count = spec if isinstance(spec, int) and spec > 0 else None
    logical = [None if i == dim or d == -1 else d for i, d in enumerate(shape)]
    if sizes is not None:
        logical[dim] = sum(sizes)
    unknown = [i for i, d in enumerate(logical) if d is None]
    known = math.prod(d for d in logical if d is not None)
    total = math.prod(weight_shape)
    if len(unknown) == 1 and total % known == 0:
        logical[unknown[0]] = total // known
    elif len(unknown) > 1 and len(shape) == len(weight_shape):
        for i in unknown:
            logical[i] = weight_shape[i]
    if None in logical or math.prod(logical) != total:
        raise ConfigError(f"{where}: shape {_show(shape)} does not fit the weight of shape {list(weight_shape)} "
                          f"({total} elements); give sizes whose product is {total}, one of them -1 at most.")
    if logical[-1] != weight_shape[-1] or math.prod(logical[:-1]) != weight_shape[0]:
        raise ConfigError(f"{where}: shape {_show(shape)} makes {logical}, whose last dim must be the weight's input "
                          f"size ({weight_shape[-1]}) and whose other dims must multiply to its output size "
                          f"({weight_shape[0]}).")
    if count is not None:
        if logical[dim] % count:
            raise ConfigError(f"{where}: shape {_show(shape)}: {logical[dim]} rows do not make {count} equal "
                              "sub-parameters.")
        sizes = (logical[dim] // count,) * count
    return Layout(tuple(weight_shape), tuple(logical), dim, sizes or (logical[dim],), tuple(shape))


def bias_layout(weight: Layout, bias_shape: tuple[int, ...]) -> Layout | None:
    """A column layer's bias, cut along the weight's output dims as the weight; None: the cut is on the input dim, so
    the bias stays whole."""
    if weight.dim >= len(weight.logical) - 1:
        return None
    return Layout(tuple(bias_shape), weight.logical[:-1], weight.dim, weight.sizes, weight.logical[:-1])


def from_deepspeed(shape: list, dim: int, whole: tuple[int, ...], where: str) -> Layout:
    """The Layout of an entry of DeepSpeed's parameter_with_sub_params, for a tensor of shape `whole`."""
    spec = tuple(tuple(d) if isinstance(d, list) else d for d in shape)
    if len(whole) == 2:
        return weight_layout(whole, spec, dim, where)
    sizes = spec[dim] if isinstance(spec[dim], tuple) else (whole[0],)
    logical = tuple(sum(d) if isinstance(d, tuple) else d for d in spec)
    return Layout(tuple(whole), logical, dim, sizes, logical)


def _show(shape: tuple) -> list:
    return [list(d) if isinstance(d, tuple) else d for d in shape]
