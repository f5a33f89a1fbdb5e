"""The Hugging Face Trainer script that benchmarks/hf_compare.py runs, unchanged, under DeepSpeed and crew.

A plain fine-tuning script in the shape of the Trainer DeepSpeed docs: a tiny GPT-2 built from a config
(2 layers, width 32, vocabulary 100), synthetic token data, an HF-docs ZeRO config with "auto" values
(AdamW, WarmupLR, gradient clipping from TrainingArguments), `TrainingArguments(deepspeed=dict)`,
fp32. It only does what a user's script does; the one extra is a TrainerCallback that keeps timings.

    train.py OUT --stage N [--steps 12] [--save_steps 4] [--resume OUT/checkpoint-4] --record run.json

The world's rank 0 writes `--record`: Trainer's log history (loss, grad_norm, learning_rate per
step), the optimizer steps done, the world size Trainer saw, and time.time() at the start of the
script, at train begin and after each optimizer step (the harness subtracts its own launch time).
"""

import argparse
import json
import time

STARTED = time.time()

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


def deepspeed_config(stage: int) -> dict:
    return {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "overlap_comm": True,
                              "reduce_scatter": True, "contiguous_gradients": True},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


class Timings(TrainerCallback):
    def __init__(self):
        self.train_begin = None
        self.step_ends = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_begin = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.time())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--record", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
    tokens = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=args.steps, save_steps=args.save_steps, logging_steps=1, learning_rate=1e-3,
        warmup_steps=args.warmup_steps, max_grad_norm=1.0, deepspeed=deepspeed_config(args.stage),
        report_to=[], seed=0)
    timings = Timings()
    trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[timings])
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(f"{args.out}/final")
    if trainer.is_world_process_zero():
        with open(args.record, "w") as record:
            json.dump({"started": STARTED, "train_begin": timings.train_begin, "step_ends": timings.step_ends,
                       "global_step": trainer.state.global_step, "world_size": training_args.world_size,
                       "log_history": trainer.state.log_history}, record)


if __name__ == "__main__":
    main()
