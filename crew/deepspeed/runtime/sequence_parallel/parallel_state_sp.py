"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the mpu register_with_transformers returns, with
DeepSpeed 0.19.8's function names, over crew's layout (crew/runtime/parallel/: SP groups of contiguous ranks).

Where crew differs: initializing again with the same size is a no-op (DeepSpeed asserts), and the errors are
CrewError with DeepSpeed's text and a fix.
"""

from __future__ import annotations

import torch.distributed as dist

from crew.errors import ConfigError, CrewError
from crew.runtime import parallel


class NotInitialized(CrewError, AssertionError):
    """A getter called before initialize_sequence_parallel (an AssertionError too, as DeepSpeed's assert)."""


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """SP groups of `sequence_parallel_size` contiguous ranks; the sequence-data-parallel group is the world."""
    if not dist.is_initialized():
        raise NotInitialized("initialize_sequence_parallel: torch.distributed is not initialized; call "
                             "deepspeed.init_distributed() (or start the script with `crew run`) first.")
    world = dist.get_world_size()
    where = f"sequence_parallel_size={sequence_parallel_size}"
    if world < sequence_parallel_size:
        raise ConfigError(f"{where}: world_size ({world}) is less than sequence_parallel_size "
                          f"{sequence_parallel_size}; run at least {sequence_parallel_size} ranks.")
    if sequence_parallel_size <= 1:
        raise ConfigError(f"{where}: sequence_parallel_size must be greater than 1, got {sequence_parallel_size}.")
    if world % sequence_parallel_size:
        raise ConfigError(f"{where}: world_size ({world}) is not divisible by sequence_parallel_size "
                          f"{sequence_parallel_size}; run a multiple of {sequence_parallel_size} ranks.")
    parallel.init_sequence_parallel(sequence_parallel_size, where="sequence_parallel_size")


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (after the world is torn down)."""
    parallel.reset()


def get_sequence_parallel_group():
    group = parallel.sequence_parallel_group()
    if group is None:
        raise NotInitialized("sequence parallel group is not initialized: call UlyssesSPAttentionHF."
                             "register_with_transformers(..., sequence_parallel_size=N) or "
                             "initialize_sequence_parallel(N) first.")
    return group


def get_sequence_data_parallel_group():
    """Where gradients are reduced and ZeRO shards under SP: the whole world."""
    get_sequence_parallel_group()  # DeepSpeed's asserts it was initialized
    return dist.group.WORLD


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


# one dimension past data parallelism: DeepSpeed aliases model parallelism to it
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
