"""What a DeepSpeed script meets when it reaches for a part of DeepSpeed crew does not provide."""

from __future__ import annotations

from crew.errors import CrewError

# DeepSpeed modules and names crew refuses, with the feature they belong to.
UNSUPPORTED = {
    "pipe": "pipeline parallelism (PipelineModule, LayerSpec)",
    "PipelineModule": "pipeline parallelism",
    "PipelineEngine": "pipeline parallelism",
    "moe": "mixture of experts",
    "inference": "DeepSpeed inference",
    "init_inference": "DeepSpeed inference",
    "InferenceEngine": "DeepSpeed inference",
    "module_inject": "kernel injection",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels",
    "compression": "model compression",
    "profiling": "the flops profiler",
    "sequence": "Megatron-style DistributedAttention; crew's Ulysses SP is deepspeed.runtime.sequence_parallel",
    "DeepSpeedHybridEngine": "the hybrid (RLHF) engine",
    "sparse_attention": "sparse attention (removed from DeepSpeed 0.19 too)",
    "launcher": "DeepSpeed's launcher: `crew run` starts the job",
    "checkpoint": "DeepSpeed's checkpoint reshaping: where DeepSpeed is installed, its tools read crew's checkpoints",
    "lamb": "DeepSpeed's FusedLamb CUDA kernel",
}
_WHAT_CREW_DOES = ("crew runs data-parallel training with ZeRO stages 0-3, Ulysses sequence parallelism and AutoTP "
                   "tensor parallelism (docs/engine.md in its source lists what it provides)")


class UnsupportedAttribute(CrewError, AttributeError):
    """`deepspeed.NAME` that crew does not provide (an AttributeError too, so hasattr() stays False)."""


class UnsupportedModule(CrewError, ModuleNotFoundError):
    """`import deepspeed.X` that crew does not provide (a ModuleNotFoundError too, for try/except imports)."""


def unsupported(dotted: str) -> str:
    """The message for `deepspeed.<dotted>`: the feature when it is a known one, and what crew does."""
    feature = next((UNSUPPORTED[part] for part in dotted.split(".") if part in UNSUPPORTED), None)
    what = f" ({feature})" if feature else ""
    return f"deepspeed.{dotted}{what} is not supported by crew: {_WHAT_CREW_DOES}."
