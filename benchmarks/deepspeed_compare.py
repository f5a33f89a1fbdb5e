"""The same unchanged DeepSpeed script under DeepSpeed and under `crew run --as_deepspeed`: losses per step.

    .venv/bin/python benchmarks/deepspeed_compare.py --deepspeed_python /path/to/venv-with-deepspeed/bin/python

The script has the shape of DeepSpeed's getting-started tutorial: `deepspeed.initialize(args=...,
model=..., model_parameters=..., training_data=...)`, a loop over the returned loader, backward, step.
DeepSpeed runs it under torchrun (2 CPU ranks, gloo); crew under `crew run --num_gpus 2 --as_deepspeed`.
Config: micro batch 4, accumulation 2, Adam (torch_adam: DeepSpeed builds no C++ op), gradient clipping,
WarmupLR; ZeRO stages 0 and 1. Prints one table per stage: step, loss under each, difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SCRIPT = """
    import argparse, json, os
    import torch
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    inputs = torch.randn(256, 16)
    data = torch.utils.data.TensorDataset(inputs, (inputs[:, :4].sum(dim=1, keepdim=True)).tanh())
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=data)
    losses = []
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if int(os.environ.get("RANK", 0)) == 0:
        with open(args.out, "w") as out:
            json.dump({"losses": losses, "lr": engine.get_lr()}, out)
"""


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}}}


def run(command: list[str], folder: Path, env: dict) -> None:
    proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"{command[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_python", required=True, help="a Python with deepspeed (and torch) installed")
    parser.add_argument("--stages", default="0,1")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="crew-ds-compare-"))
    (folder / "train.py").write_text(textwrap.dedent(SCRIPT))
    crew_bin = str(Path(sys.executable).parent / "crew")
    torchrun = str(Path(args.deepspeed_python).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for stage in map(int, args.stages.split(",")):
        (folder / "ds.json").write_text(json.dumps(config(stage)))
        common = ["train.py", "--deepspeed", "--deepspeed_config", "ds.json", "--out"]
        run([torchrun, "--standalone", "--nproc_per_node", "2", *common, "deepspeed.json"], folder, env)
        run([crew_bin, "run", "--num_gpus", "2", "--as_deepspeed", *common, "crew.json"], folder, env)
        ds, cr = (json.loads((folder / f"{name}.json").read_text()) for name in ("deepspeed", "crew"))
        print(f"\nZeRO stage {stage}: {len(ds['losses'])} micro steps, final lr deepspeed {ds['lr']} crew {cr['lr']}")
        print("| micro step | deepspeed loss | crew loss | abs diff |\n|---|---|---|---|")
        for step, (a, b) in enumerate(zip(ds["losses"], cr["losses"], strict=True)):
            print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.2e} |")
        print(f"max abs diff: {max(abs(a - b) for a, b in zip(ds['losses'], cr['losses'])):.2e}")


if __name__ == "__main__":
    main()
