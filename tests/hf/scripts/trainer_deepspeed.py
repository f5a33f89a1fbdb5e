# The shape of transformers' DeepSpeed docs: a Trainer script, TrainingArguments(deepspeed=<ZeRO config with
# "auto" values>), run by a launcher that passes --local_rank. Each stage: a run of 6 steps that saves at steps
# 3 and 6, then a fresh Trainer resuming from checkpoint-3 (a second deepspeed.initialize in this process).
import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--stages", default="1,2")
parser.add_argument("--combos_stage", type=int, default=1)
args = parser.parse_args()


def ds_config(stage, optimizer=True, scheduler=True):
    config = {
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "overlap_comm": True,
                              "reduce_scatter": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "none", "nvme_path": None}},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }
    if not optimizer:
        del config["optimizer"]
    if not scheduler:
        del config["scheduler"]
    return config


class Record(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, "loss": logs["loss"], "lr": logs["learning_rate"],
                              "grad_norm": logs["grad_norm"], "lr_used": optimizer.param_groups[0]["lr"]})


def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32))


tokens = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]


def train(stage, out, resume=None, steps=6, **sections):
    training_args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=steps, save_steps=3,
        logging_steps=1, learning_rate=1e-2, warmup_steps=2, weight_decay=0.01, deepspeed=ds_config(stage, **sections),
        report_to=[], seed=0, save_strategy="steps" if steps == 6 else "no")
    record = Record()
    trainer = Trainer(model=model(), args=training_args, train_dataset=data, callbacks=[record])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record.logs


def digest(module):
    hashed = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        hashed.update(name.encode() + value.detach().float().cpu().numpy().tobytes())
    return hashed.hexdigest()


result = {"world": None, "stages": {}}
for stage in [int(s) for s in args.stages.split(",")]:
    out = f"out{stage}"
    trainer, full = train(stage, out)
    engine = trainer.model_wrapped
    seen = {"full": full, "engine": type(engine).__name__, "module_is_model": engine.module is trainer.model,
            "config_is_dict": isinstance(engine.config, dict), "digest": digest(trainer.model),
            "whole": all(type(p) is torch.nn.Parameter for p in trainer.model.parameters())}
    trainer.save_model(f"{out}/final")
    resumed_trainer, resumed = train(stage, out + "-resumed", resume=f"{out}/checkpoint-3")
    seen["resumed"] = resumed
    seen["resumed_digest"] = digest(resumed_trainer.model)
    if dist.get_rank() == 0:
        loaded = GPT2LMHeadModel.from_pretrained(f"{out}/final")
        seen["loaded_digest"] = digest(loaded)
        checkpoint = f"{out}/checkpoint-3"
        seen["files"] = sorted(os.listdir(checkpoint)) + sorted(os.listdir(f"{checkpoint}/global_step3"))
    result["stages"][stage] = seen
    result["world"] = dist.get_world_size()
# Trainer's four optimizer/scheduler combinations (config section or Trainer's own), 3 steps each
result["combos"] = {}
for optimizer in (True, False):
    for scheduler in (True, False):
        _, logs = train(args.combos_stage, "combo", steps=3, optimizer=optimizer, scheduler=scheduler)
        result["combos"][f"{optimizer},{scheduler}"] = logs
with open(f"result{dist.get_rank()}.json", "w") as f:
    json.dump(result, f)
