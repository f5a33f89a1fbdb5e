"""AutoTP tensor-parallel training, with DeepSpeed 0.19.8's names and meaning.

The DS config's `"tensor_parallel": {"autotp_size": N}` (or `deepspeed.tp_model_init(model, N, dtype)` before
`initialize`) splits the model's linear layers over groups of N contiguous ranks (crew/runtime/parallel/):
attention q/k/v and MLP gate/up column-wise, o/down row-wise with an all-reduce (layers.py), the output head
column-wise with its output gathered; embeddings and norms stay whole on every rank.

For checkpoints: sharded parameters carry `crew_tp_dim` (layers.TP_DIM), `gather_full(param)` and
`local_slice(whole, param)` convert between a rank's slice and the whole weight; state_dict() keys are the
model's own.
"""

from crew.runtime.tensor_parallel.layers import (TP_DIM, LinearAllreduce, LinearLayer, gather_full, is_sharded,
                                                 local_slice)
from crew.runtime.tensor_parallel.setup import chained, grad_norm, mark_masters, prepare, record

__all__ = ["TP_DIM", "LinearAllreduce", "LinearLayer", "chained", "gather_full", "grad_norm", "is_sharded",
           "local_slice", "mark_masters", "prepare", "record"]
