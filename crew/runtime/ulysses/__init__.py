"""Ulysses sequence parallelism for Hugging Face models, with DeepSpeed 0.19.8's names (its
deepspeed.runtime.sequence_parallel.ulysses_sp): the attention wrapper and its registration, the DataLoader
adapter, and the tiled compute that goes with it (Arctic Long Sequence Training)."""

from crew.runtime.ulysses.attention import UlyssesShapeError, UlyssesSPAttentionHF
from crew.runtime.ulysses.loader import UlyssesBatchError, UlyssesSPDataLoaderAdapter
from crew.runtime.ulysses.tiled import (AutogradComputeMLP, SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP,
                                        sequence_tiled_compute)

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute", "SequenceTiledCompute",
           "TiledMLP", "TiledFusedLogitsLoss", "AutogradComputeMLP", "UlyssesShapeError", "UlyssesBatchError"]
