"""Writes small real DeepSpeed 0.19.8 AutoTP checkpoints beside this file, for
tests/runtime/checkpoint/test_tensor_parallel_checkpoint.py to load into crew. Not a test.

    cd /work/main/tests/runtime/checkpoint/tensor_parallel_data
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /opt/dsvenv/bin/python make_fixtures.py [case ...]

Each case (CASES): a tiny LlamaForCausalLM or Phi3ForCausalLM (make_model; seed 0), DeepSpeed's `"tensor_parallel":
{"autotp_size": 2}` (the Phi-3 ones with a preset_model or partition_config, SECTIONS),
torch's AdamW, two optimizer steps on fixed batches (batch(rank, step)), then engine.save_checkpoint(case,
tag="t2", client_state={"note": "fixture"}) as DeepSpeed writes it (its zero_to_fp32.py copies removed). Beside
the checkpoint, expected.pt: DeepSpeed's _consolidated_16bit_state_dict() (the whole weights) and every rank's
loss of a third forward on batch(rank, 2), which a run that loaded the checkpoint must reproduce. And presets.json:
DeepSpeed's preset_model layer specs (AutoTPPresets), which crew's must equal, and subparams.json: each TP rank's slice
of a few fused weights (CUTS) as DeepSpeed cuts them.
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
CASES = {"stage0_fp32": (0, "fp32", 2), "stage2_fp32_dp2": (2, "fp32", 4),
         "phi3_partition_config": (0, "fp32", 2), "gpt_neox_tp_plan": (0, "fp32", 2),
         "falcon_heuristic": (0, "fp32", 2)}
TP = 2
# Phi-3's fused gate_up_proj split as two sub-parameters (each rank its half of gate and of up), its attention whole:
# DeepSpeed's preset "phi3" also splits the fused qkv_proj, which Phi3Attention cannot run on (it slices q, k, v at
# the whole model's widths: DeepSpeed 0.19.8 fails in the first forward). GPT-NeoX: no section, so DeepSpeed splits
# by the model's Hugging Face tp_plan (query_key_value by column, attention.dense by row, ...). Falcon: no tp_plan, so
# DeepSpeed's heuristic parser (the linears before a norm and self_attention.dense by row, the rest by column, the
# fused query_key_value as one block, its attention's head counts halved).
PHI3_MLP = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.self_attn\..*"], "partition_type": "skip"},
    {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.mlp\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
     "partition_dim": 0}]}
SECTIONS = {"phi3_partition_config": {"partition_config": PHI3_MLP}}


def make_model(case: str = "stage0_fp32"):
    import transformers

    torch.manual_seed(0)
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32, max_position_embeddings=64)
    if case.startswith("phi3"):
        sizes.update(num_key_value_heads=4, pad_token_id=0)
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**sizes))
    if case.startswith("gpt_neox"):
        sizes.update(num_attention_heads=2)  # heads of 8: a quarter of each rotary
        del sizes["num_key_value_heads"]
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**sizes))
    if case.startswith("falcon"):
        return transformers.FalconForCausalLM(transformers.FalconConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=4, vocab_size=32, multi_query=False,
            bias=True, tie_word_embeddings=False))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))


def config(stage: int, precision: str, case: str = "stage0_fp32") -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 4}},
            "tensor_parallel": {"autotp_size": TP, **SECTIONS.get(case, {})}}


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
    model = make_model(name)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, precision, name))
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


def presets() -> None:
    """presets.json: DeepSpeed's AutoTPPresets, each as the layer_specs of a partition_config."""
    import json

    from deepspeed.module_inject.autotp_config import AutoTPPresets

    def spec(s):
        return {"patterns": list(s.patterns), "partition_type": s.partition_type.value, "shape": s.shape,
                "partition_dim": s.partition_dim, "model_types": s.model_types, "gather_output": s.gather_output,
                "grad_allreduce": s.grad_allreduce}

    names = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")
    found = {name: [spec(s) for s in AutoTPPresets.get_preset(name).layer_specs] for name in names}
    (HERE / "presets.json").write_text(json.dumps(found, indent=1) + "\n")
    (HERE / "subparams.json").write_text(json.dumps(subparam_cuts()) + "\n")


# (weight shape, spec shape, partition_dim): fused weights cut as sub-parameters, by DeepSpeed's own functions
CUTS = [((8, 3), [2, -1], 0), ((8, 3), [[4, 2, 2], -1], 0), ((12, 2), [[6, 2, 4], -1], 0), ((3, 8), [-1, [2, 6]], 1),
        ((16, 2), [2, [2, 6], -1], 1), ((12, 2), [3, -1], 0)]


def subparam_cuts() -> list:
    """For each of CUTS and TP 2 and 4: each rank's slice of torch.arange (DeepSpeed 0.19.8's
    _infer_subparam_logical_shapes, _subparam_shard_widths, _partition_logical_tensor, as SubParamLinearLayer)."""
    from deepspeed.module_inject import layers
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    found = []
    for weight_shape, shape, dim in CUTS:
        spec = layers._normalize_shape_spec(shape)
        logical, _, sizes, _ = layers._infer_subparam_logical_shapes(weight_shape, spec, dim)
        weight = torch.arange(weight_shape[0] * weight_shape[1]).reshape(weight_shape)
        for tp in (2, 4):
            widths = layers._subparam_shard_widths(sizes or (logical[dim], ), tp, AutoTPMeta())
            slices = []
            for rank in range(tp):
                cut = layers._partition_logical_tensor(weight.reshape(logical), dim, tp, rank, widths, sizes)
                slices.append(cut.reshape(-1, cut.shape[-1]).tolist())
            found.append({"weight": list(weight_shape), "shape": shape, "dim": dim, "tp": tp, "slices": slices})
    return found


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
        return
    presets()
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name in sys.argv[1:] or CASES:  # the cases named, or all
        ranks = CASES[name][2]
        subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(ranks), __file__, "save", name],
                       env=env, check=True)
    total = sum(path.stat().st_size for path in HERE.rglob("*") if path.is_file())
    print(f"fixtures: {total} bytes")


if __name__ == "__main__":
    main()
