"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: crew's Ulysses SP (crew/runtime/ulysses)."""

from crew.runtime.ulysses import (AutogradComputeMLP, SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP,
                                  UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, sequence_tiled_compute)

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute", "SequenceTiledCompute",
           "TiledMLP", "TiledFusedLogitsLoss", "AutogradComputeMLP"]
