# A Hugging Face Trainer script with DeepSpeed's AutoTP ("tensor_parallel": {"autotp_size": 2}) and "auto"
# values, run under `crew run --as_deepspeed --num_gpus 2`: 4 steps, save_model. fp32, a tiny Llama built from a
# config (nothing downloaded).
# Every rank writes result<rank>.json: the batches each step trained on (gathered from both ranks), the logged
# loss and grad norm, and the shapes of its own slices of the split linears beside the whole ones. Rank 0 also
# loads the saved folder with from_pretrained and compares it with the trained weights (each TP slice gathered
# whole), and trains a one-process reference without TP or DeepSpeed: a copy of the initial model, on the
# batches the steps saw, with what Trainer and DeepSpeed built from the config's "auto" values: torch's AdamW with
# the lr, betas, eps and weight decay of TrainingArguments over all parameters in one group (DeepSpeed's
# optimizer, given Trainer's model parameters), Trainer's lr schedule (the config has none), gradient clipping at
# max_grad_norm.
import argparse
import copy
import json

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, get_scheduler

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--tp", type=int, default=2)
parser.add_argument("--stage", type=int, default=1)
args = parser.parse_args()

# stage 3: every parameter sharded (the tiny model's would all stay whole under the default persistence threshold)
zero = {"stage": args.stage, **({"stage3_param_persistence_threshold": 0} if args.stage == 3 else {})}
config = {"bf16": {"enabled": "auto"}, "zero_optimization": zero,
          "optimizer": {"type": "AdamW",
                        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
          "train_micro_batch_size_per_gpu": "auto", "tensor_parallel": {"autotp_size": args.tp}}


class Record(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({"loss": logs["loss"], "grad_norm": logs["grad_norm"]})


class SeenTrainer(Trainer):
    """Trainer, recording each rank's batch of each training step for the reference."""

    seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batches = [None] * dist.get_world_size()
        dist.all_gather_object(batches, {"input_ids": inputs["input_ids"].tolist(),
                                         "labels": inputs["labels"].tolist()})
        self.seen.append(batches)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))
reference = copy.deepcopy(model)
tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]
training_args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                                  learning_rate=1e-2, weight_decay=0.01, deepspeed=config, report_to=[], seed=0,
                                  save_strategy="no")
record = Record()
trainer = SeenTrainer(model=model, args=training_args, train_dataset=data, callbacks=[record])
trainer.train()
trainer.save_model("out/final")

from crew.runtime.tensor_parallel import gather_full  # noqa: E402  (crew's, as `deepspeed` is under --as_deepspeed)

whole, split = {}, {}
for name, param in trainer.model.named_parameters():
    whole[name] = gather_full(param).float()
    if getattr(param, "crew_tp_dim", None) is not None:
        split[name] = {"local": list(param.shape), "whole": list(whole[name].shape), "dim": param.crew_tp_dim}
engine = trainer.model_wrapped
result = {"world": dist.get_world_size(), "engine": type(engine).__module__, "steps": record.logs,
          "seen": SeenTrainer.seen, "split": split}
if dist.get_rank() == 0:
    # the reference: Trainer's optimizer and schedule as DeepSpeed builds them from the config's "auto" values
    optimizer = torch.optim.AdamW(reference.parameters(), lr=training_args.learning_rate,
                                  betas=(training_args.adam_beta1, training_args.adam_beta2),
                                  eps=training_args.adam_epsilon, weight_decay=training_args.weight_decay)
    schedule = get_scheduler(training_args.lr_scheduler_type, optimizer,
                             num_warmup_steps=training_args.get_warmup_steps(training_args.max_steps),
                             num_training_steps=training_args.max_steps,
                             scheduler_specific_kwargs=training_args.lr_scheduler_kwargs)
    initial = {name: param.detach().clone() for name, param in reference.named_parameters()}
    replayed = []
    reference.train()
    for batches in SeenTrainer.seen:
        batch = batches[0]  # one data-parallel rank: both TP ranks train on the same batch (asserted)
        out = reference(input_ids=torch.tensor(batch["input_ids"]), labels=torch.tensor(batch["labels"]))
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), training_args.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        replayed.append({"loss": out.loss.item(), "grad_norm": norm.item()})
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()  # stage 3: else from_pretrained builds under zero.Init, a collective rank 0 alone calls
    loaded = LlamaForCausalLM.from_pretrained("out/final", dtype=torch.float32).state_dict()
    final = {name: param.detach() for name, param in reference.named_parameters()}
    result.update(
        reference=replayed, learning_rate=training_args.learning_rate,
        keys_equal=loaded.keys() >= whole.keys() == final.keys(),
        saved_vs_trained=max((loaded[name] - value).abs().max().item() for name, value in whole.items()),
        saved_vs_reference=max((loaded[name] - value).abs().max().item() for name, value in final.items()),
        saved_vs_reference_mean=max((loaded[name] - value).abs().mean().item() for name, value in final.items()),
        moved=max((final[name] - value).abs().max().item() for name, value in initial.items()),
        shapes={name: list(value.shape) for name, value in loaded.items()})
with open(f"result{dist.get_rank()}.json", "w") as f:
    json.dump(result, f)
