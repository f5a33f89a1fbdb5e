"""`deepspeed.utils.groups`: DeepSpeed's getters for the data-, sequence- and tensor-parallel groups, over crew's
layout (crew/runtime/parallel/). Hugging Face reads `_get_sequence_parallel_group()` and friends for Ulysses SP
(transformers' deepspeed_sp_compute_loss, Accelerate), and AutoTP code the tensor-parallel ones.

Without SP or TP the data-parallel group is the whole world, as DeepSpeed's is. `mpu` is the object passed to
`deepspeed.initialize(mpu=...)`, as DeepSpeed keeps it here.
"""

from __future__ import annotations

import torch.distributed as dist

from crew.runtime import parallel

mpu = None


def _world():
    return dist.group.WORLD


def _no_group(what: str, fix: str) -> KeyError:
    return KeyError(f"No {what} group found: {fix}")


# -- data parallel --------------------------------------------------------------------------------

def _get_data_parallel_group():
    """The ranks that hold the same weights: the world, or under AutoTP the ranks with the same TP rank."""
    return parallel.data_parallel_group() or _world()


def _get_data_parallel_world_size() -> int:
    return parallel.data_parallel_size()


def _get_data_parallel_rank() -> int:
    group = parallel.data_parallel_group()
    if group is not None:
        return dist.get_rank(group)
    return dist.get_rank() // parallel.sequence_parallel_size() if dist.is_initialized() else 0


def _get_broadcast_src_rank() -> int:
    """The global rank of the first rank of this rank's sequence-data-parallel group (DeepSpeed's)."""
    group = parallel.data_parallel_group()
    return dist.get_global_rank(group, 0) if group is not None else 0


# -- sequence parallel (Ulysses) --------------------------------------------------------------------

def _get_sequence_parallel_group():
    group = parallel.sequence_parallel_group()
    if group is None:
        raise _no_group("sequence parallel", "call UlyssesSPAttentionHF.register_with_transformers("
                        "sequence_parallel_size=N) (or pass initialize(mpu=...) its result) first.")
    return group


def _get_sequence_parallel_world_size() -> int:
    return parallel.sequence_parallel_size()


def _get_sequence_parallel_rank() -> int:
    return parallel.sequence_parallel_rank()


def _get_sequence_data_parallel_group():
    """Where gradients are reduced and ZeRO shards under SP: the whole world (DeepSpeed's, without TP)."""
    return parallel.data_parallel_group() or _world()


def _get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_sequence_data_parallel_group()) if dist.is_initialized() else 1


def _get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(_get_sequence_data_parallel_group()) if dist.is_initialized() else 0


# -- tensor parallel (AutoTP) -----------------------------------------------------------------------

def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size=None):
    parallel.init_tensor_parallel(tensor_model_parallel_size, where="groups._init_tp_mesh_device")
    return parallel.data_parallel_group(), parallel.tensor_parallel_group()


def get_tensor_model_parallel_group():
    group = parallel.tensor_parallel_group()
    if group is None:
        raise AssertionError("intra_layer_model parallel group is not initialized: set tensor_parallel.autotp_size "
                             "in the config (or call deepspeed.tp_model_init) first.")
    return group


def get_model_parallel_group():
    return get_tensor_model_parallel_group()


def get_tensor_model_parallel_world_size() -> int:
    return parallel.tensor_parallel_size()


def get_model_parallel_world_size():
    return get_tensor_model_parallel_world_size()


def get_tensor_model_parallel_rank() -> int:
    return parallel.tensor_parallel_rank()


def get_model_parallel_rank():
    return get_tensor_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    size = parallel.tensor_parallel_size()
    return (dist.get_rank() // size) * size if dist.is_initialized() else 0


def get_data_parallel_group():
    return _get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


def _get_model_parallel_world_size() -> int:
    return parallel.tensor_parallel_size()


def _get_expert_parallel_group_dict() -> dict:
    return {}


def _get_expert_data_parallel_group_dict() -> dict:
    return {}
