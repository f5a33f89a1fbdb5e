# The shape of a transformers 5.24 Trainer script with DeepSpeed ALST / Ulysses sequence parallelism beside data
# parallelism, as transformers' deepspeed_alst.md combines them: TrainingArguments(deepspeed=<ZeRO config with
# "auto" values>, parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2,
# dp_replicate_size=world // 2, sp_handler=DeepSpeedSequenceParallelConfig(...))), a dataset of token sequences
# with position_ids (UlyssesSPDataLoaderAdapter needs them), run by a launcher that passes --local_rank. Trainer
# hands the ParallelismConfig to its Accelerator, which registers Ulysses attention, passes deepspeed.initialize
# the mpu and a train_batch_size of micro batch x data_parallel_size (dp_replicate_size x dp_shard_size: without
# dp_replicate_size it is 1 and DeepSpeed's batch check refuses 4 ranks); Trainer then wraps its train loader in
# the adapter (deepspeed_ulysses_dl_adapter), counts sp_size times as many batches, a data parallel world of
# world_size // sp_size, and computes the loss with deepspeed_sp_compute_loss (shards' losses weighted by their
# tokens across the SP group). A tiny Llama built from a config (nothing downloaded), fp32.
# Rank 0 writes result.json: each step's logged loss and grad norm and the whole sequences it trained on (one per
# data-parallel group), the Trainer's batch arithmetic, and a one-process reference without SP: a copy of the
# initial model trained by torch alone on the same sequences, a step's as one batch (eager attention:
# transformers' "sdpa" is Ulysses' own wrapper in this process once it is on). Weights: OUT/initial, OUT/final
# (trainer.save_model), OUT/reference.
import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from accelerate.utils import ParallelismConfig
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--sp_size", type=int, default=2)
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--output_dir", default="out")
args = parser.parse_args()

ds_config = {
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
world_size = int(os.environ.get("WORLD_SIZE", "1"))
parallelism_config = ParallelismConfig(
    sp_backend="deepspeed", sp_size=args.sp_size, dp_replicate_size=world_size // args.sp_size,
    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))

torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, attn_implementation="sdpa")
model = LlamaForCausalLM(config)
reference = copy.deepcopy(model)
if int(os.environ.get("RANK", "0")) == 0:
    reference.save_pretrained(f"{args.output_dir}/initial")

# arithmetic runs modulo the vocabulary: text a tiny model learns within a few steps
generator = torch.Generator().manual_seed(1)
start = torch.randint(0, 128, (8, 1), generator=generator)
stride = torch.randint(1, 4, (8, 1), generator=generator)
tokens = (start + stride * torch.arange(32)) % 128
data = [{"input_ids": t, "labels": t, "position_ids": torch.arange(32)} for t in tokens]


class Record(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs["grad_norm"]})


class SeenTrainer(Trainer):
    """Trainer, recording the whole sequences of each training step for the reference."""

    seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # every rank's shard; DeepSpeed's SP groups are consecutive ranks (parallel_state_sp), so each run of
        # sp_size shards is one data-parallel group's whole sequence
        shards = [None] * world_size
        dist.all_gather_object(shards, inputs["input_ids"][0].tolist())
        self.seen.append([sum(shards[first:first + args.sp_size], []) for first in range(0, world_size, args.sp_size)])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


training_args = TrainingArguments(
    output_dir=args.output_dir, per_device_train_batch_size=1, num_train_epochs=1, logging_steps=1,
    learning_rate=1e-3, lr_scheduler_type="constant", deepspeed=ds_config, parallelism_config=parallelism_config,
    report_to=[], seed=0, save_strategy="no")
record = Record()
trainer = SeenTrainer(model=model, args=training_args, train_dataset=data, callbacks=[record])
trainer.train()
trainer.save_model(f"{args.output_dir}/final")


if dist.get_rank() == 0:
    reference.set_attn_implementation("eager")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=training_args.learning_rate, weight_decay=0.0)
    replayed = []
    for step in SeenTrainer.seen:
        # the data-parallel groups' sequences as one batch: all the same length, so its mean token loss is the
        # mean of theirs, which is what Trainer logs (the ranks' losses averaged) and DP's averaged gradient
        ids = torch.tensor(step)
        out = reference(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids), labels=ids)
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), training_args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        replayed.append({"loss": out.loss.item(), "grad_norm": norm.item()})
    reference.save_pretrained(f"{args.output_dir}/reference")
    engine = trainer.model_wrapped
    result = {"world": dist.get_world_size(), "sp_size": args.sp_size, "engine": type(engine).__module__,
              "zero_stage": args.stage, "sp_size_seen": trainer.get_sp_size(),
              "per_device_train_batch_size": training_args.per_device_train_batch_size,
              "total_train_batch_size": trainer.get_total_train_batch_size(training_args),
              "train_batch_size": engine.train_batch_size(), "global_step": trainer.state.global_step,
              "steps": record.logs, "seen": SeenTrainer.seen, "dataset": tokens.tolist(), "reference": replayed,
              "learning_rate": training_args.learning_rate}
    with open("result.json", "w") as f:
        json.dump(result, f)
