# The shape of accelerate's examples/by_feature/deepspeed_with_config_support.py: a causal LM trained by an
# Accelerate loop under a launch YAML with `distributed_type: DEEPSPEED` and a deepspeed_config_file. The
# optimizer and scheduler are DummyOptim/DummyScheduler when the DeepSpeed config has those sections, else
# torch's AdamW and transformers' get_scheduler. It saves its state at step 3 (save_state), finishes, then
# loads step 3 back (load_state) and trains the last steps again. Each rank writes result<rank>.json with what
# it saw, and a one-process reference: the same model trained by torch alone on the whole global batches.
import argparse
import copy
import hashlib
import json
import math
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DummyOptim, DummyScheduler, set_seed
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

parser = argparse.ArgumentParser()
parser.add_argument("--learning_rate", type=float, default=1e-2)
parser.add_argument("--weight_decay", type=float, default=0.1)
parser.add_argument("--per_device_train_batch_size", type=int, default=2)
parser.add_argument("--max_train_steps", type=int, default=6)
parser.add_argument("--checkpointing_steps", type=int, default=3)
parser.add_argument("--reference_steps", type=int, default=3)
parser.add_argument("--output_dir", default="out")
args = parser.parse_args()

# the seedable sampler: the same shuffled order when the loader is read again after load_state
accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
set_seed(0)
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
reference = copy.deepcopy(model)
initial = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])


def sequences(count, generator):
    """Arithmetic runs modulo the vocabulary: text a tiny model learns within a few steps."""
    start = torch.randint(0, 64, (count, 1), generator=generator)
    stride = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + stride * torch.arange(16)) % 64


generator = torch.Generator().manual_seed(1)
train_dataset = [{"input_ids": ids, "labels": ids} for ids in sequences(64, generator)]
eval_dataset = [{"input_ids": ids, "labels": ids} for ids in sequences(16, generator)]
train_dataloader = torch.utils.data.DataLoader(train_dataset, shuffle=True,
                                               batch_size=args.per_device_train_batch_size)
eval_dataloader = torch.utils.data.DataLoader(eval_dataset, batch_size=4)


def grouped_parameters(module):
    no_decay = ("bias", "ln_")
    named = list(module.named_parameters())
    return [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]


ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
optimizer_cls = DummyOptim if "optimizer" in ds_config else torch.optim.AdamW
optimizer = optimizer_cls(grouped_parameters(model), lr=args.learning_rate)
if "scheduler" in ds_config:
    lr_scheduler = DummyScheduler(optimizer, total_num_steps=args.max_train_steps, warmup_num_steps=2)
else:  # Accelerate steps a prepared scheduler once per process at each optimizer step
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                                 num_training_steps=args.max_train_steps * accelerator.num_processes)
model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)


def whole(parameter):
    """The full tensor, also where a parameter is sharded (a DTensor), so that a sharded model still compares."""
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def flat(module):
    return torch.cat([whole(p).detach().reshape(-1) for p in module.parameters()])


def digest(module):
    return hashlib.sha256(b"".join(whole(p).detach().numpy().tobytes() for p in module.parameters())).hexdigest()


def train(loader, steps, record, save_at=None, snapshot_at=None):
    completed_steps, micro = 0, []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            lr = optimizer.param_groups[0]["lr"]  # the lr this step uses (DeepSpeed steps inside backward)
            loss = model(**batch).loss
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        micro.append({"loss": accelerator.reduce(loss.detach(), "mean").item(),
                      "ids": accelerator.gather(batch["input_ids"]).tolist()})
        if accelerator.sync_gradients:
            completed_steps += 1
            record.append({"loss": sum(m["loss"] for m in micro) / len(micro), "lr": lr, "grad_norm": grad_norm,
                           "ids": [row for m in micro for row in m["ids"]]})
            micro = []
            if completed_steps == snapshot_at:
                snapshots["engine"] = flat(accelerator.unwrap_model(model))
            if completed_steps == save_at:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps == steps:
                return


def evaluate():
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
    model.train()
    return torch.cat(losses).mean().item()


def train_reference(steps):
    """One process, torch alone: the whole global batch of each step, clipped at 1.0 (the config's "auto"
    gradient_clipping), AdamW with the lr the engine used. Returns its grad norms."""
    reference_optimizer = torch.optim.AdamW(grouped_parameters(reference), lr=args.learning_rate)
    norms = []
    for step in steps:
        for group in reference_optimizer.param_groups:
            group["lr"] = step["lr"]
        ids = torch.tensor(step["ids"])
        reference(input_ids=ids, labels=ids).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item())
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return norms


snapshots = {}
full, resumed = [], []
train(train_dataloader, args.max_train_steps, full, save_at=args.checkpointing_steps,
      snapshot_at=args.reference_steps)
eval_loss = evaluate()
unwrapped = accelerator.unwrap_model(model)
final = {"digest": digest(unwrapped), "eval_loss": eval_loss}

checkpoint = os.path.join(args.output_dir, f"step_{args.checkpointing_steps}")
files = sorted(str(path.relative_to(checkpoint)) for path in Path(checkpoint).rglob("*"))
accelerator.load_state(checkpoint)
skipped = accelerator.skip_first_batches(train_dataloader,
                                         args.checkpointing_steps * accelerator.gradient_accumulation_steps)
train(skipped, args.max_train_steps - args.checkpointing_steps, resumed)

reference_norms = train_reference(full[:args.reference_steps])
difference = (snapshots["engine"] - flat(reference)).abs().max().item()

accelerator.wait_for_everyone()
state_dict = accelerator.get_state_dict(model)
unwrapped.save_pretrained(os.path.join(args.output_dir, "model"), is_main_process=accelerator.is_main_process,
                          save_function=accelerator.save, state_dict=state_dict)
accelerator.wait_for_everyone()
loaded = GPT2LMHeadModel.from_pretrained(os.path.join(args.output_dir, "model"))

result = {
    "world": accelerator.num_processes, "rank": accelerator.process_index,
    "distributed_type": str(accelerator.distributed_type), "engine": type(model).__module__,
    "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
    "ds_config": {k: v for k, v in accelerator.deepspeed_config.items() if k != "steps_per_print"},
    "full": [{k: v for k, v in step.items() if k != "ids"} for step in full],
    "resumed": [{k: v for k, v in step.items() if k != "ids"} for step in resumed],
    "global_batch": len(full[0]["ids"]),
    "final": final, "resumed_digest": digest(unwrapped),
    "whole": all(type(p) is torch.nn.Parameter and p.shape == q.shape
                 for p, q in zip(unwrapped.parameters(), reference.parameters())),
    "reference_norms": reference_norms, "reference_max_difference": difference,
    "moved": (snapshots["engine"] - initial).abs().max().item(),
    "files": files, "latest": Path(checkpoint, "latest").read_text().strip(),
    "loaded_digest": digest(loaded), "finite": all(math.isfinite(step["loss"]) for step in full),
}
Path(f"result{accelerator.process_index}.json").write_text(json.dumps(result))
accelerator.end_training()
