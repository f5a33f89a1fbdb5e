"""A model with no trainable parameter and no optimizer, as TRL's prepare_deepspeed builds its reference,
reward and teacher models (`deepspeed.initialize(model=frozen, config=...)`, the stage forced to 0 below
ZeRO-3): DeepSpeed accepts it at every stage, broadcasts rank 0's weights and runs its forward."""

from __future__ import annotations

import torch
from dist import run_ranks

import crew

STAGES = (0, 1, 2, 3)


def model_made_with(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def frozen_engines(rank: int) -> dict:
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    seen = {}
    for stage in STAGES:
        model = model_made_with(seed=rank)  # different weights on each rank: the engine must use rank 0's
        model.requires_grad_(False)
        engine, optimizer, _, scheduler = crew.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}})
        engine.eval()
        with torch.no_grad():
            out = engine(inputs)
        seen[stage] = {"out": out, "optimizer": (optimizer, engine.optimizer, scheduler),
                       "training": engine.training}
    return seen


def test_a_frozen_model_without_optimizer_runs_at_every_stage_with_rank_0s_weights():
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model_made_with(seed=0)(inputs)
    for rank, seen in enumerate(run_ranks(frozen_engines, 2)):
        for stage in STAGES:
            torch.testing.assert_close(seen[stage]["out"], expected, rtol=0, atol=1e-6,
                                       msg=f"rank {rank}, stage {stage}")
            if stage == 0:  # DeepSpeed builds a stand-in ZeRO optimizer at stages 1-3; at stage 0 in fp32 none
                assert seen[stage]["optimizer"] == (None, None, None)
            assert seen[stage]["training"] is False
