# A Hugging Face Trainer script at ZeRO stage 3 in the shape of transformers' DeepSpeed docs: the ZeRO-3 config
# with "auto" values, TrainingArguments(deepspeed=...) made first (so that HfDeepSpeedConfig is alive and
# from_pretrained builds the model under deepspeed.zero.Init and loads it through its ZeRO-3 path), then
# from_pretrained of the checkpoint the test wrote. Four Trainers, one after another in this process:
#   full    6 steps, evaluation at the start and every 3 steps, checkpoints at 3 and 6, save_model(final),
#           then generate() on the sharded model;
#   resumed a fresh model and Trainer from checkpoint-3 with stage3_gather_16bit_weights_on_model_save false,
#           so that its save_model takes Trainer's fallback (save_checkpoint + zero_to_fp32.py);
#   lora    PEFT LoRA on the same pretrained base, 4 steps, checkpoints at 2 and 4, save_model(lora/final);
#   lora-resumed  from lora/checkpoint-2.
# Each rank writes result<rank>.json; rank 0 also tensors.pt: the whole weights it gathered after each run.
import argparse
import hashlib
import json

import deepspeed
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
from transformers.integrations import is_deepspeed_zero3_enabled

parser = argparse.ArgumentParser()
parser.add_argument("pretrained")
parser.add_argument("data")
parser.add_argument("--local_rank", type=int, default=-1)
cli = parser.parse_args()


def ds_config(gather=True):
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
            "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": gather},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }


data = torch.load(cli.data, weights_only=True)
train_data = [{"input_ids": t, "labels": t} for t in data["train"]]
eval_data = [{"input_ids": t, "labels": labels} for t, labels in zip(data["eval"], data["eval_labels"])]


def arguments(out, steps, save_steps, gather=True, evaluate=False, learning_rate=1e-2):
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=steps,
        save_steps=save_steps, logging_steps=1, learning_rate=learning_rate, warmup_steps=2, weight_decay=0.01,
        max_grad_norm=1.0, deepspeed=ds_config(gather), report_to=[], seed=0, per_device_eval_batch_size=4,
        eval_strategy="steps" if evaluate else "no", eval_steps=save_steps, eval_on_start=evaluate)


def held(model):
    """What this rank holds of the model's parameters: the elements of every parameter (ds_numel), of this
    rank's partitions (ds_tensor), of the parameters' .data, and how many parameters are partitioned."""
    params = list(model.parameters())
    return {"numel": sum(p.ds_numel for p in params if hasattr(p, "ds_numel")),
            "partition": sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor")),
            "data": sum(p.data.numel() for p in params), "params": len(params),
            "partitioned": sum(hasattr(p, "ds_tensor") for p in params)}


def whole(model):
    """The whole parameters (gathered from every rank's partitions), name -> CPU tensor, and their digest."""
    named = list(model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        tensors = {n: p.detach().cpu().clone() for n, p in named}
    hashed = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        hashed.update(name.encode() + value.float().numpy().tobytes())
    return tensors, hashed.hexdigest()


def history(trainer):
    steps = [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"], "lr": h["learning_rate"]}
             for h in trainer.state.log_history if "loss" in h]
    evals = [[h["step"], h["eval_loss"]] for h in trainer.state.log_history if "eval_loss" in h]
    return steps, evals


result, tensors = {}, {}


def run(label, args, model, resume=None):
    trainer = Trainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data)
    trainer.train(resume_from_checkpoint=resume)
    steps, evals = history(trainer)
    tensors[label], digest = whole(trainer.model)
    result[label] = {"steps": steps, "evals": evals, "digest": digest,
                     "engine": isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine)}
    return trainer


# Full fine-tuning. TrainingArguments first: from_pretrained then sees ZeRO-3 enabled.
args = arguments("out", 6, 3, evaluate=True)
model = GPT2LMHeadModel.from_pretrained(cli.pretrained)
result.update(world=dist.get_world_size(), zero3_enabled=is_deepspeed_zero3_enabled(), held=held(model))
tensors["loaded"], _ = whole(model)
full = run("full", args, model)
full.save_model("out/final")
with torch.no_grad():  # HF generate on the sharded model, outside the engine's forward (every rank)
    prompt = data["eval"][:2, :4].to(full.model.device)
    result["generated"] = full.model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()

args = arguments("out-resumed", 6, 3, gather=False, evaluate=True)
run("resumed", args, GPT2LMHeadModel.from_pretrained(cli.pretrained), resume="out/checkpoint-3").save_model(
    "out-resumed/final")


# PEFT LoRA on the pretrained base: frozen base, checkpoints without it, resume.
def lora_model():
    set_seed(0)  # LoRA's new weights are drawn outside zero.Init: the same draw on every rank
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["c_attn"], fan_in_fan_out=True,
                      task_type="CAUSAL_LM")
    return get_peft_model(GPT2LMHeadModel.from_pretrained(cli.pretrained), lora)


args = arguments("lora", 4, 2, learning_rate=3e-2)
lora = run("lora", args, lora_model())
result["lora"]["trainable"] = sorted(n for n, p in lora.model.named_parameters() if p.requires_grad)
lora.save_model("lora/final")
run("lora_resumed", arguments("lora-resumed", 4, 2, learning_rate=3e-2), lora_model(), resume="lora/checkpoint-2")

with open(f"result{dist.get_rank()}.json", "w") as file:
    json.dump(result, file)
if dist.get_rank() == 0:
    torch.save(tensors, "tensors.pt")
