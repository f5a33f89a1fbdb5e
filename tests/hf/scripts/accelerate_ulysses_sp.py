# The shape of accelerate's test_utils/scripts/external_deps/test_ds_alst_ulysses_sp.py (its DeepSpeed ALST /
# Ulysses SP check, launched by `accelerate launch --use_deepspeed --zero_stage=N` on 2 processes): a
# ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(...)), a
# dataset of token sequences with position_ids, accelerator.prepare (which registers Ulysses attention with
# transformers, hands deepspeed.initialize the mpu and wraps the loader in UlyssesSPDataLoaderAdapter), and
# the loop's own SP loss: each shard's loss weighted by its tokens across the SP group. Differences: a tiny
# Llama built from a config (nothing downloaded), token ids within its vocabulary, a larger lr so that steps
# matter, fp32, and the model saved at the end. Rank 0 writes result.json with the loss, gradient norm and
# whole sequence of every step, and a one-process reference without SP: a copy of the initial model trained
# by torch alone on the same sequences (eager attention: transformers' "sdpa" is Ulysses' own wrapper in
# this process once prepare has run). Weights: OUT/initial, OUT/final (save_pretrained), OUT/reference.
import argparse
import copy
import json
import os

import torch
from deepspeed.runtime.utils import move_to_device
from transformers import LlamaConfig, LlamaForCausalLM

from accelerate import Accelerator
from accelerate.utils import ParallelismConfig, set_seed
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

parser = argparse.ArgumentParser()
parser.add_argument("--sp_size", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--output_dir", default="out")
args = parser.parse_args()

set_seed(42)

micro_batch_size = 1

parallelism_config = ParallelismConfig(
    sp_backend="deepspeed",
    sp_size=args.sp_size,
    sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length=256,
        sp_seq_length_is_variable=True,
        sp_attn_implementation="sdpa",
    ),
)

accelerator = Accelerator(
    parallelism_config=parallelism_config,
)

config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, attn_implementation="sdpa")
model = LlamaForCausalLM(config)
reference = copy.deepcopy(model)
if accelerator.is_main_process:
    reference.save_pretrained(f"{args.output_dir}/initial")

samples = 4
seqlen = 32
input_ids = torch.arange(1, seqlen * samples + 1).view(-1, seqlen) + 100
position_ids = torch.arange(seqlen * samples).view(-1, seqlen)

ds = torch.utils.data.TensorDataset(input_ids, position_ids)


def collate_fn(batch):
    input_ids, position_ids = batch[0]
    return dict(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        labels=input_ids.unsqueeze(0),
    )


dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)

optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)

rank = torch.distributed.get_rank()

if rank == 0:
    print(f"DL orig: {len(dl)} samples")

model, optimizer, dl = accelerator.prepare(model, optimizer, dl)

if rank == 0:
    print(f"DL w/ adapter: {len(dl)} samples")

sp_size = parallelism_config.sp_size if parallelism_config else 1
if sp_size > 1:
    from deepspeed.utils import groups

    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = parallelism_config.sp_size

unwrapped_model = accelerator.unwrap_model(model)


def whole(key, batch):
    """The step's whole sequence, from the shards of its SP group (for the reference)."""
    if sp_size == 1:
        return batch[key][0].tolist()
    shards = [None] * sp_world_size
    torch.distributed.all_gather_object(shards, batch[key][0].tolist(), group=sp_group)
    return sum(shards, [])


steps = []
# Normal training loop
for iter, batch in enumerate(dl):
    optimizer.zero_grad()

    if rank == 0:
        print(f"batch {iter}: seqlen: {len(batch['input_ids'][0])}")
    batch = move_to_device(batch, model.device)
    seen = {"input_ids": whole("input_ids", batch), "position_ids": whole("position_ids", batch)}
    outputs = model(**batch)

    shift_labels = batch["shift_labels"] if sp_size > 1 else torch.nn.functional.pad(
        batch["labels"], (0, 1), value=-100)[..., 1:]
    loss = unwrapped_model.loss_function(
        logits=outputs.logits,
        labels=None,
        shift_labels=shift_labels,
        vocab_size=unwrapped_model.config.vocab_size,
    )

    if sp_size > 1:
        # differentiable weighted per-shard-loss aggregation across ranks
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        # special dealing with SFT that has prompt tokens that aren't used in loss computation
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
        total_loss = sum(
            losses_per_rank[rank] * good_tokens_per_rank[rank]
            for rank in range(sp_world_size)
            if good_tokens_per_rank[rank] > 0
        )
        total_good_tokens = sum(good_tokens_per_rank)
        loss = total_loss / max(total_good_tokens, 1)

    if rank == 0:
        accelerator.print(f"{iter}: {loss=}")
    accelerator.log(dict(train_loss=loss, step=iter))

    accelerator.backward(loss)
    optimizer.step()
    steps.append({**seen, "loss": loss.item(), "grad_norm": float(model.get_global_grad_norm())})

rank = torch.distributed.get_rank()  # the loop above reuses the name
accelerator.wait_for_everyone()
unwrapped_model.save_pretrained(f"{args.output_dir}/final", is_main_process=accelerator.is_main_process,
                                save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))


if rank == 0:
    clip = accelerator.deepspeed_config.get("gradient_clipping") or 0.0
    reference.set_attn_implementation("eager")
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=args.learning_rate)
    replayed = []
    for step in steps:
        ids = torch.tensor([step["input_ids"]])
        out = reference(input_ids=ids, position_ids=torch.tensor([step["position_ids"]]), labels=ids)
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip if clip > 0 else float("inf"))
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        replayed.append({"loss": out.loss.item(), "grad_norm": norm.item()})
    reference.save_pretrained(f"{args.output_dir}/reference")
    result = {"world": torch.distributed.get_world_size(), "sp_size": sp_size, "engine": type(model).__module__,
              "zero_stage": accelerator.deepspeed_config["zero_optimization"]["stage"], "batches": len(dl),
              "steps": steps, "reference": replayed, "clip": clip, "learning_rate": args.learning_rate}
    with open("result.json", "w") as f:
        json.dump(result, f)

accelerator.end_training()
