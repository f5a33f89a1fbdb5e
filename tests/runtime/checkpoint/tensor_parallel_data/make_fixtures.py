"""Writes small real DeepSpeed 0.19.8 AutoTP checkpoints beside this file, for
tests/runtime/checkpoint/test_tensor_parallel_checkpoint.py to load into crew. Not a test.

    cd /work/main/tests/runtime/checkpoint/tensor_parallel_data
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /opt/dsvenv/bin/python make_fixtures.py

Each case (CASES): a tiny LlamaForCausalLM (make_model; seed 0), DeepSpeed's `"tensor_parallel": {"autotp_size": 2}`,
torch's AdamW, two optimizer steps on fixed batches (batch(rank, step)), then engine.save_checkpoint(case,
tag="t2", client_state={"note": "fixture"}) as DeepSpeed writes it (its zero_to_fp32.py copies removed). Beside
the checkpoint, expected.pt: DeepSpeed's _consolidated_16bit_state_dict() (the whole weights) and every rank's
loss of a third forward on batch(rank, 2), which a run that loaded the checkpoint must reproduce.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# name: (ZeRO stage, precision, ranks)
CASES = {"stage0_fp32": (0, "fp32", 2), "stage2_fp32_dp2": (2, "fp32", 4)}
TP = 2


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def config(stage: int, precision: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 4}},
            "tensor_parallel": {"autotp_size": TP}}


def batch(rank: int, step: int) -> torch.Tensor:
    """The same tokens on the ranks of one TP group (AutoTP's input is replicated over it)."""
    generator = torch.Generator().manual_seed(1000 * step + rank // TP)
    return torch.randint(0, 32, (1, 8), generator=generator)


def save(name: str) -> None:
    import deepspeed
    import torch.distributed as dist

    stage, precision, _ = CASES[name]
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, precision))
    for step in range(2):
        tokens = batch(rank, step)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    folder = HERE / name
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(folder), tag="t2", client_state={"note": "fixture"})
    whole = engine._consolidated_16bit_state_dict()
    tokens = batch(rank, 2)
    loss = engine(input_ids=tokens, labels=tokens).loss
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss.float().item())
    dist.barrier()
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (folder / script).unlink(missing_ok=True)
        torch.save({"state_dict": whole, "next_losses": losses}, folder / "expected.pt")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
        return
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name, (_, _, ranks) in CASES.items():
        subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(ranks), __file__, "save", name],
                       env=env, check=True)
    total = sum(path.stat().st_size for path in HERE.rglob("*") if path.is_file())
    print(f"fixtures: {total} bytes")


if __name__ == "__main__":
    main()
