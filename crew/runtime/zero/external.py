"""Stage 3: a unit's parameter used in the model's forward outside that unit's own forward.

`F.linear(h, self.embed.weight)` in a parent's forward (an output layer tied to the embedding by hand,
DeepSpeed's `test_ext_param_getattr`) reads the embedding's parameter after its unit resharded: FSDP2 gives
the sharded DTensor, and the op fails ("mixed torch.Tensor and DTensor"). DeepSpeed fetches such a parameter
on access and registers it as the caller's external parameter. crew does the same on FSDP2: inside the
model's forward, reading a sharded parameter of a unit through its module unshards that unit and returns the
whole parameter; the unit stays whole until its backward reduces the gradients of both uses and reshards it
(or, without gradients, until its next forward). The gradient is the one of the same model unsharded.

Reading it before the unit's own forward in the same pass is not covered: that forward reshards it again.
"""

from __future__ import annotations

import torch

_IN_FORWARD = "_crew_in_model_forward"


class _FetchingParameters(dict):
    """A module's `_parameters`: a sharded parameter read inside the model's forward comes back whole."""

    def __init__(self, entries: dict, unit: torch.nn.Module, model: torch.nn.Module) -> None:
        super().__init__(entries)
        self.unit, self.model = unit, model

    def __getitem__(self, name: str):
        value = super().__getitem__(name)
        if getattr(self.model, _IN_FORWARD, 0) and _is_shard(value):
            self.unit.unshard()
            value = super().__getitem__(name)
        return value


def fetch_on_access(model: torch.nn.Module, units: list[torch.nn.Module]) -> None:
    """After fully_shard: the modules owning each unit's parameters fetch them when read in the model's forward
    (the root's own parameters are whole through its forward)."""
    for unit in units:
        for module in _owners(unit, units):
            module._parameters = _FetchingParameters(module._parameters, unit, model)
    setattr(model, _IN_FORWARD, 0)
    model.register_forward_pre_hook(_entered)  # after FSDP2's own (prepended) root pre-forward
    model.register_forward_hook(_left, always_call=True)


def _owners(unit: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules under `unit` whose parameters belong to its FSDP2 group (not to a unit nested inside)."""
    inner = [u for u in units if u is not unit and any(u is m for m in unit.modules())]
    nested = {id(m) for u in inner for m in u.modules()}
    return [m for m in unit.modules() if id(m) not in nested and m._parameters]


def _entered(model: torch.nn.Module, args) -> None:
    setattr(model, _IN_FORWARD, getattr(model, _IN_FORWARD, 0) + 1)


def _left(model: torch.nn.Module, args, output) -> None:
    setattr(model, _IN_FORWARD, max(0, getattr(model, _IN_FORWARD, 0) - 1))


def _is_shard(value) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)
