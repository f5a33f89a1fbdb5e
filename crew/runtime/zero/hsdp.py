"""Stage 3 within groups of ranks: DeepSpeed's `mics_shard_size` (MiCS) and `zero_hpz_partition_size` (ZeRO++
hpZ) as FSDP2 on a 2-D device mesh (HSDP): the parameters are sharded within each group of G consecutive ranks
(a node, when G is its rank count) and replicated across the groups. A unit's all-gather and its gradients'
reduce-scatter then stay inside the group, on the fast link; only one all-reduce of each gradient shard crosses
the groups, on each micro step, as the reduce-scatter does without groups.

Ranks are numbered node by node, so groups of the ranks per node are the nodes. The cost: each rank holds 1/G of
the parameters, gradients and optimizer state, not 1/world. That is MiCS's trade; DeepSpeed's hpZ keeps the
optimizer state partitioned over every rank and only the parameters' second copy within the group, which FSDP2
has no form for: crew's hpZ is MiCS's layout (docs/zero.md).
"""

from __future__ import annotations

from typing import Any

import torch

from crew.errors import ConfigError

KEYS = ("mics_shard_size", "zero_hpz_partition_size")
OFF = {"mics_shard_size": -1, "zero_hpz_partition_size": 1}  # DeepSpeed's defaults


def group_size(extra: dict[str, Any], world_size: int) -> int | None:
    """The shard group's size when the section asks for groups smaller than the world; None for plain stage 3."""
    asked = {key: _value(key, extra[key]) for key in KEYS if key in extra and extra[key] != OFF[key]}
    if not asked:
        return None
    if len(set(asked.values())) > 1:
        raise ConfigError(f"zero_optimization: mics_shard_size {asked['mics_shard_size']} and "
                          f"zero_hpz_partition_size {asked['zero_hpz_partition_size']} disagree; both set the group "
                          "the parameters are sharded in here. Give one (usually the number of GPUs per node).")
    key, size = next(iter(asked.items()))
    if world_size % size:
        raise ConfigError(f"zero_optimization.{key} {size} does not divide the world size {world_size}: the ranks "
                          f"split into groups of {size}. Use a divisor of {world_size}, usually the number of ranks "
                          "per node.")
    return size if size < world_size else None


def no_effect(extra: dict[str, Any]) -> list[str]:
    """The keys set at stages 0-2, where DeepSpeed ignores them too."""
    return [f"zero_optimization.{key}" for key in KEYS if key in extra and extra[key] != OFF[key]]


def mesh(device: torch.device, world_size: int, group: int | None):
    """FSDP2's mesh: 1-D over the world, or (world / group, group) with the shard dimension last."""
    from torch.distributed.device_mesh import init_device_mesh

    if group is None:
        return init_device_mesh(device.type, (world_size,))
    return init_device_mesh(device.type, (world_size // group, group), mesh_dim_names=("replicate", "shard"))


def _value(key: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"zero_optimization.{key} is {value!r}: give the number of ranks to shard within (a "
                          f"whole number >= 1, e.g. the GPUs per node), or leave it out ({OFF[key]}: off).")
    return value
