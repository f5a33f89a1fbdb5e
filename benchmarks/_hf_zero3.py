"""The Hugging Face Trainer script that benchmarks/zero3_compare.py runs, unchanged, under DeepSpeed and crew.

A fine-tuning script in the shape of transformers' DeepSpeed docs at ZeRO stage 3: the ZeRO-3 config with
"auto" values (AdamW, WarmupLR, clipping from TrainingArguments, stage3_gather_16bit_weights_on_model_save,
no offload), fp32, `TrainingArguments(deepspeed=dict)` made before `from_pretrained`, so that transformers'
HfDeepSpeedConfig is alive and the model is built under `deepspeed.zero.Init` and loaded through its ZeRO-3
path. With `--outside_init` the model is loaded first, before TrainingArguments (no HfDeepSpeedConfig yet:
every rank builds and loads the whole model, and deepspeed.initialize partitions it afterwards).

    train.py PRETRAINED OUT --record run.json [--steps 12] [--length 16] [--batch 4] [--outside_init]
        [--evaluate]

Each rank writes RECORD with .rank<N> before the suffix: its memory (VmRSS from /proc/self/status, the peak
so far, resource.getrusage ru_maxrss, and the bytes of the tensors alive, from a gc census) after the imports,
after from_pretrained, after deepspeed.initialize (Trainer's on_train_begin) and at the end; the parameter
elements it holds after from_pretrained (its ZeRO partitions plus every parameter's .data); rank 0 also
Trainer's log history.

On a machine without GPUs Accelerate picks no backend for a CPU rank with a DeepSpeed config and counts a
world of one, where DeepSpeed's batch-size check stops a 2-rank run: zero3_compare.py runs DeepSpeed's side
with crew's rank site (crew/launcher/node/site, standard library only) on its path and
CREW_DEEPSPEED_ON_CPU=1, which hands Accelerate gloo over the launched ranks, as under --as_deepspeed.
"""

import argparse
import json
import os
import resource
import time

STARTED = time.time()


def memory() -> dict:
    """This process's resident memory now and its peak so far, and the bytes of the tensors alive now, in MiB."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {"rss": rss / 1024, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tensors": live_tensors() / 2**20}


def live_tensors() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can reach (a DTensor: its local
    shard; views of one storage count once): what the process holds, without what the allocator kept."""
    import gc

    import torch

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            tensor = getattr(obj, "_local_tensor", obj)
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def deepspeed_config() -> dict:
    """hf_compare's HF-docs config (benchmarks/_hf_trainer.py) with the docs' stage-3 section."""
    from _hf_trainer import deepspeed_config as hf_docs_config  # beside this script: on its sys.path

    config = hf_docs_config(3)
    config["zero_optimization"] = {
        "stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
    return config


def held(model) -> dict:
    """Parameter elements in the model and held by this rank: its ZeRO partitions (ds_tensor) plus .data."""
    params = list(model.parameters())
    return {"numel": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "held": sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor"))
            + sum(p.data.numel() for p in params)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pretrained")
    parser.add_argument("out")
    parser.add_argument("--record", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--length", type=int, default=16, help="tokens per row")
    parser.add_argument("--batch", type=int, default=4, help="rows per micro batch")
    parser.add_argument("--outside_init", action="store_true")
    parser.add_argument("--evaluate", action="store_true", help="evaluate at the start and at the end")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    marks = {"imported": memory()}  # the census also runs at the other marks: its cost is outside the steps

    class Marks(TrainerCallback):
        def on_train_begin(self, *_, **__):  # after deepspeed.initialize (and a checkpoint load)
            marks["initialized"] = memory()

    vocab = AutoConfig.from_pretrained(args.pretrained).vocab_size
    rows = torch.randint(0, vocab, (16 * args.batch, args.length), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in rows]
    model = GPT2LMHeadModel.from_pretrained(args.pretrained) if args.outside_init else None
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=2,
        max_steps=args.steps, logging_steps=1, learning_rate=1e-3, warmup_steps=3, max_grad_norm=1.0,
        deepspeed=deepspeed_config(), report_to=[], seed=0, save_strategy="no", per_device_eval_batch_size=args.batch,
        eval_strategy="steps" if args.evaluate else "no", eval_steps=args.steps, eval_on_start=args.evaluate)
    if model is None:
        model = GPT2LMHeadModel.from_pretrained(args.pretrained)
    marks["loaded"] = memory()
    holding = held(model)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, eval_dataset=data[:4 * args.batch],
                      callbacks=[Marks()])
    trainer.train()
    marks["end"] = memory()
    rank = dist.get_rank()
    record = {"rank": rank, "world_size": dist.get_world_size(), "marks": marks, **holding,
              "started": STARTED, "ended": time.time()}
    if rank == 0:
        record["log_history"] = trainer.state.log_history
    stem, suffix = os.path.splitext(args.record)
    with open(f"{stem}.rank{rank}{suffix}", "w") as file:
        json.dump(record, file)


if __name__ == "__main__":
    main()
