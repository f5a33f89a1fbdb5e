# TRL's online and offline trainers in the shape of TRL's DeepSpeed examples: GRPOTrainer (with a reference
# model, beta > 0, generation inside unwrap_model_for_generation, TRL's default ds3_gather_for_generation=True
# and False), RLOOTrainer (the same generation path, --runs rloo-zeroS) and DPOTrainer (its reference model
# built by TRL from the model's path, then prepare_deepspeed: a frozen-model engine at stage 0 below ZeRO-3 and
# sharded at ZeRO-3; dpo-sync: TRL's sync_ref_model, the reference mixed with the policy after every step
# under GatheredParameters(modifier_rank=0)), one after another in this process, at each ZeRO stage given
# (--runs NAME-zeroSTAGE,...).
# The model and tokenizer are tiny and written here by rank 0 (no download).
# Runs unchanged under `crew run --as_deepspeed` and under real DeepSpeed (torchrun), so that
# benchmarks/trl_compare.py can put the two side by side. Each rank writes <out>/result<rank>.json:
# per run, the logged losses and rewards per step, the wall time, how far the weights moved, and
# how far the model saved by save_model and loaded with from_pretrained is from the trained weights.
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--runs", default="grpo-zero2,dpo-zero2,grpo-zero3,grpo-nogather-zero3,dpo-zero3")
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--local_rank", type=int, default=-1)
cli = parser.parse_args()
rank = int(os.environ["RANK"])
WORDS = "the a cat dog sat ran on under mat log red blue big small".split()


def ds_config(stage):
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold="auto",
                    stage3_prefetch_bucket_size="auto", reduce_bucket_size="auto")
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto"}


def write_base(folder):
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    tokenizer.chat_template = None
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(vocab), n_positions=64,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=1))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def sentences(count, length, seed):
    generator = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=generator))
            for _ in range(count)]


def reward_short_words(completions, **kwargs):
    """More reward for completions of short words: something the policy can learn from."""
    return [-sum(len(word) for word in text.split()) / 10.0 for text in completions]


def common(stage, folder):
    return dict(output_dir=folder, per_device_train_batch_size=2, max_steps=cli.steps, logging_steps=1,
                learning_rate=5e-3, deepspeed=ds_config(stage), report_to=[], save_strategy="no", bf16=False,
                seed=0)


def grpo(stage, folder, base, gather):
    args = GRPOConfig(**common(stage, folder), num_generations=2, max_completion_length=6, beta=0.1,
                      ds3_gather_for_generation=gather)
    data = Dataset.from_dict({"prompt": sentences(32, 3, 1)})
    return GRPOTrainer(model=base, reward_funcs=reward_short_words, args=args, train_dataset=data)


def rloo(stage, folder, base):
    args = RLOOConfig(**common(stage, folder), num_generations=2, max_completion_length=6, beta=0.1)
    data = Dataset.from_dict({"prompt": sentences(32, 3, 1)})
    return RLOOTrainer(model=base, reward_funcs=reward_short_words, args=args, train_dataset=data)


def dpo(stage, folder, base, sync=False):
    extra = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5) if sync else {}
    args = DPOConfig(**common(stage, folder), max_length=24, beta=0.1, **extra)
    data = Dataset.from_dict({"prompt": sentences(32, 3, 2), "chosen": sentences(32, 4, 3),
                              "rejected": sentences(32, 4, 4)})
    return DPOTrainer(model=base, args=args, train_dataset=data)


def weights(model):
    import deepspeed
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def whole_while_generating(trainer):
    """TRL's generation context at ZeRO-3 (gathered): after a generate() inside it, is every parameter of the
    model still whole (nothing resharded between the forwards)?"""
    from torch.distributed.tensor import DTensor
    from trl.models.utils import unwrap_model_for_generation
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
        unwrapped.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
        return not any(isinstance(p, DTensor) or p.numel() == 0 for p in unwrapped.parameters())


def run(label, base):
    name, stage = label.rsplit("-zero", 1)
    stage, folder = int(stage), f"{cli.out}/{label}"
    trainer = (dpo(stage, folder, base, sync=name == "dpo-sync") if name.startswith("dpo")
               else rloo(stage, folder, base) if name == "rloo"
               else grpo(stage, folder, base, name == "grpo"))
    before = weights(trainer.model)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    after = weights(trainer.model)
    trainer.save_model(f"{folder}/final")
    dist.barrier()  # rank 0 writes it
    history = [h for h in trainer.state.log_history if "loss" in h]
    result = {"losses": [h["loss"] for h in history], "seconds": seconds,
              "rewards": [h.get("reward") for h in history],
              "grad_norms": [h.get("grad_norm") for h in history],
              "margins": [h.get("rewards/margins") for h in history],
              "moved": max((after[n] - before[n]).abs().max().item() for n in after),
              "ref_model": type(getattr(trainer, "ref_model", None)).__name__,
              "status_after": statuses(trainer.model)}
    if label == "grpo-zero3":
        result["whole_while_generating"] = whole_while_generating(trainer)
        result["status_after_generating"] = statuses(trainer.model)
    saved = weights(AutoModelForCausalLM.from_pretrained(f"{folder}/final"))  # under zero.Init at ZeRO-3
    result["saved_diff"] = max((saved[n] - after[n]).abs().max().item() for n in after)
    return result


def statuses(model) -> dict:
    """The ds_status values of the persistent (ds_persist: small, never partitioned) parameters and the others."""
    found = {"persistent": set(), "partitioned": set()}
    for param in model.parameters():
        found["persistent" if getattr(param, "ds_persist", False) else "partitioned"].add(
            str(getattr(param, "ds_status", None)))
    return {kind: sorted(values) for kind, values in found.items()}


base = f"{cli.out}/base"
labels = cli.runs.split(",")
# joins the process group, as the first TrainingArguments does (with DeepSpeed on: without, Accelerate's state
# on a CPU-only machine would be one process, and every later TrainingArguments would keep it)
GRPOConfig(output_dir=cli.out, report_to=[], bf16=False, deepspeed=ds_config(int(labels[0].rsplit("-zero")[1])))
if rank == 0 and not os.path.exists(f"{base}/config.json"):
    write_base(base)
dist.barrier()
results = {label: run(label, base) for label in labels}
with open(f"{cli.out}/result{rank}.json", "w") as file:
    json.dump(results, file, indent=1)
