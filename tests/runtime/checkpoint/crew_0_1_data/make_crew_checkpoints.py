"""Writes the checkpoints of crew 0.1's own layouts ("replicated": model_states.<i>-of-<k>.pt; "sharded": a DCP
folder at stage 3) that test_checkpoint_formats.py loads with today's crew, and the losses each run had after its
save (expected.json). Run it with the crew of the layout to keep, from a copy of that commit:

    git archive <commit> | tar -x -C /tmp/crew_old
    PYTHONPATH=/tmp/crew_old .venv/bin/python tests/runtime/checkpoint/crew_0_1_data/make_crew_checkpoints.py

Two ranks (gloo), a tiny MLP, AdamW with WarmupLR, 3 steps, save (client_state), then 3 more steps recorded.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # tests/: dist.py

SAVE_AT, END = 3, 6
# name: (ZeRO stage, precision)
RUNS = {"stage0_fp32": (0, "fp32"), "stage2_fp32": (2, "fp32"), "stage2_bf16": (2, "bf16"), "stage3_fp32": (3, "fp32")}


def config(stage: int, precision: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5}},
            "zero_optimization": {"stage": stage}, **({"bf16": {"enabled": True}} if precision == "bf16" else {})}


def model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(rank: int, step: int):
    """The same batch for a rank's step in every run."""
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(4, 8, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True)


def steps(engine, rank: int, until: int) -> list[float]:
    import torch

    losses = []
    while engine.global_steps < until:
        inputs, targets = batch(rank, engine.global_steps)
        dtype = next(engine.module.parameters()).dtype
        loss = torch.nn.functional.mse_loss(engine(inputs.to(dtype)).float(), targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def generate(rank: int, root: str) -> dict:
    import crew

    losses = {}
    for name, (stage, precision) in RUNS.items():
        engine, *_ = crew.initialize(model=model(), config=config(stage, precision))
        steps(engine, rank, SAVE_AT)
        engine.save_checkpoint(f"{root}/{name}", client_state={"saved_by": "crew 0.1", "step": SAVE_AT})
        losses[name] = steps(engine, rank, END)
    return losses


def main() -> None:
    import crew
    from dist import run_ranks

    for name in RUNS:
        shutil.rmtree(HERE / name, ignore_errors=True)
    ranks = run_ranks(generate, 2, str(HERE), timeout=600)
    expected = {"crew_version": crew.__version__, "save_at": SAVE_AT, "end": END,
                "losses": {name: [ranks[rank][name] for rank in range(2)] for name in RUNS}}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main()
