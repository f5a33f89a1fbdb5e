# Written in the shape of DeepSpeed-Chat step 1 (DeepSpeedExamples@45b4b715 applications/DeepSpeed-Chat
# training/step1_supervised_finetuning/main.py); no code copied. It follows main.py's flow and makes the
# DeepSpeed and Hugging Face calls main.py and its dschat helpers make, in the same order: the same flags
# (deepspeed.add_config_arguments included), init_distributed, a get_train_ds_config-shaped dict,
# HfDeepSpeedConfig + from_pretrained at stage 3, resize_token_embeddings, the LoRA swap through
# deepspeed.compression.helper, FusedAdam/DeepSpeedCPUAdam, transformers' get_scheduler, deepspeed.initialize,
# the engine's forwarded gradient_checkpointing_enable()/model.model, model.backward/step, tput_timer, the
# LoRA merge under GatheredParameters and the HF-format and ZeRO-3 saves.
# Differences, for an offline CPU test: --data_path names folders holding train.json and eval.json (records
# with prompt/chosen/rejected, as the application's local/jsonfile dataset reads from its data/ folder);
# --dtype also takes fp32, which puts neither an fp16 nor a bf16 section in the config (main.py offers fp16
# and bf16 only; CPU training is checked in fp32); --compute_fp32_loss is accepted and has no effect (it
# matters under fp16/bf16 only); the throughput line prints the exact parameter count.
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
from datasets import load_dataset
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, SchedulerType, default_data_collator,
                          get_scheduler, set_seed)
from transformers.integrations.deepspeed import HfDeepSpeedConfig

import deepspeed
import deepspeed.comm  # noqa: F401  (the application's ds_utils imports it)
from deepspeed import get_accelerator
from deepspeed.accelerator import get_accelerator as accelerator_of_utils  # its utils.py's spelling
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

LORA_NAMES = ("lora_right_weight", "lora_left_weight")
NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


def parse_args():
    parser = argparse.ArgumentParser(description="Supervised fine-tuning of a causal LM (DeepSpeed-Chat step 1)")
    parser.add_argument("--data_path", nargs="*", required=True, help="folders with train.json and eval.json")
    parser.add_argument("--data_split", type=str, default="2,4,4")
    parser.add_argument("--sft_only_data_path", nargs="*", default=[])
    parser.add_argument("--data_output_path", type=str, default="/tmp/data_files/")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="cosine",
                        choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                 "constant_with_warmup"])
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--dropout", type=float, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--lora_module_name", type=str, default="decoder.layers.")
    parser.add_argument("--only_optimize_lora", action="store_true")
    parser.add_argument("--lora_learning_rate", type=float, default=5e-4)
    parser.add_argument("--compute_fp32_loss", action="store_true")
    parser.add_argument("--enable_tensorboard", action="store_true")
    parser.add_argument("--tensorboard_path", type=str, default="step1_tensorboard")
    parser.add_argument("--add_eot_token", action="store_true")
    parser.add_argument("--eot_token", type=str, default="<|endoftext|>")
    parser.add_argument("--print_loss", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def print_rank_0(message, rank):
    if rank <= 0:
        print(message, flush=True)


# -- the DeepSpeed config (ds_utils.get_train_ds_config's keys) ------------------------------------------------

def train_ds_config(offload, dtype, stage, enable_tensorboard, tb_path, tb_name):
    device = "cpu" if offload else "none"
    zero = {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
            "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False}
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
              "zero_optimization": zero, "gradient_clipping": 1.0, "prescale_gradients": False,
              "wall_clock_breakdown": False,
              "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                                "release_inference_cache": False, "pin_parameters": True,
                                "tp_gather_partition_size": 8},
              "tensorboard": {"enabled": enable_tensorboard, "output_path": f"{tb_path}/ds_tensorboard_logs/",
                              "job_name": f"{tb_name}_tensorboard"}}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale_window": 100}
    elif dtype == "bf16":
        config["bfloat16"] = {"enabled": True}
    return config


def seed_everything(seed):
    set_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


# -- tokenizer and model (utils.load_hf_tokenizer, model_utils.create_hf_model) --------------------------------

def load_tokenizer(path, add_special_tokens=None):
    name = path
    config_file = os.path.join(path, "config.json")
    if os.path.exists(config_file):
        with open(config_file) as file:
            name = json.load(file).get("_name_or_path", path)
    tokenizer = AutoTokenizer.from_pretrained(name, fast_tokenizer=True)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if add_special_tokens is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": [add_special_tokens]})
    return tokenizer


def set_dropout(config, dropout):
    if dropout is None:
        return
    for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout"):
        if hasattr(config, key):
            setattr(config, key, dropout)


def create_model(path, tokenizer, ds_config, dropout):
    config = AutoConfig.from_pretrained(path)
    set_dropout(config, dropout)
    # at stage 3 this object is what tells from_pretrained to build under deepspeed.zero.Init; it lives
    # until this function returns, through from_pretrained and the resize, as in the application
    zero3_marker = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None
    model = AutoModelForCausalLM.from_pretrained(path, from_tf=bool(".ckpt" in path), config=config)
    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.config.eos_token_id
    model.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8.0)))
    del zero3_marker
    return model


# -- LoRA (module/lora.py's shape) -----------------------------------------------------------------------------

class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update; `fuse()` folds the update into the weight."""

    def __init__(self, weight, rank, scaling=1, dropout=0, bias=None):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA needs a rank above 0, got {rank}")
        self.weight = weight
        self.bias = bias
        try:
            out_features, in_features = weight.ds_shape  # a ZeRO-3 partitioned weight keeps its shape here
        except AttributeError:
            out_features, in_features = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(in_features, rank))
        self.lora_left_weight = nn.Parameter(torch.zeros(rank, out_features))
        self.lora_scaling = scaling / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_left_weight)
        self.weight.requires_grad = False
        self.fused = False

    # as the application's layer: train()/eval() reach only the dropout (and return nothing)
    def eval(self):
        self.lora_dropout.eval()

    def train(self, mode=True):
        self.lora_dropout.train(mode)

    def fuse(self):
        if not self.fused:
            self.weight.data += self.lora_scaling * (self.lora_left_weight.t() @ self.lora_right_weight.t())
        self.fused = True

    def forward(self, inputs):
        base = F.linear(inputs, self.weight, self.bias)
        if self.fused:
            return base
        return base + (self.lora_dropout(inputs) @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def convert_linear_layer_to_lora(model, part_module_name, rank):
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and part_module_name in name]
    for name in names:
        linear = recursive_getattr(model, name)
        lora = LoRALinear(linear.weight, rank, bias=linear.bias)
        recursive_setattr(model, name, lora.to(linear.weight.device).to(linear.weight.dtype))
    return model


def only_optimize_lora_parameters(model):
    for name, param in model.named_parameters():
        param.requires_grad = any(part in name for part in LORA_NAMES)
    return model


def make_model_gradient_checkpointing_compatible(model):
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    elif hasattr(model, "get_input_embeddings"):
        model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: output.requires_grad_(True))
    return model


def lora_params_to_fetch(params):
    # lora.py spells the status through the package path, utils.py through the imported name
    status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    return [p for p in params if p is not None and hasattr(p, "ds_id") and p.ds_status == status.NOT_AVAILABLE]


def convert_lora_to_linear_layer(model):
    for name in [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]:
        layer = recursive_getattr(model, name)
        zero3 = hasattr(layer.weight, "ds_id")
        fetch = lora_params_to_fetch([layer.weight, layer.bias, layer.lora_left_weight, layer.lora_right_weight])
        with deepspeed.zero.GatheredParameters(fetch, modifier_rank=0, enabled=zero3):
            layer.fuse()
    return model


# -- data (data/data_utils.create_prompt_dataset for train phase 1, local/jsonfile) ---------------------------

def split_indices(seed, size, data_split, phase):
    """The indices of the phase's share of `size` records: shuffled with the seed, cut by the split's weights."""
    weights = [float(part) for part in data_split.split(",")]
    bounds = np.concatenate([[0], np.cumsum(weights) / sum(weights)])
    cuts = [int(round(bound * size)) for bound in bounds]
    order = np.random.RandomState(seed=seed).permutation(size)
    return order[cuts[phase - 1]:cuts[phase]].tolist()


def tokenize_chosen(records, tokenizer, max_seq_len, end_token):
    samples = []
    for record in records:
        if record.get("prompt") is None or record.get("chosen") is None:
            continue
        text = " " + record["prompt"] + " " + record["chosen"] + end_token
        tokens = tokenizer(text, max_length=max_seq_len, padding="max_length", truncation=True, return_tensors="pt")
        input_ids, mask = tokens["input_ids"].squeeze(0), tokens["attention_mask"].squeeze(0)
        samples.append({"input_ids": input_ids, "attention_mask": mask,
                        "labels": torch.where(mask.bool(), input_ids, -100)})
    return samples


def build_phase1_data(folders, data_split, seed, tokenizer, max_seq_len, end_token):
    train, evaluation = [], []
    for folder in folders:
        raw = load_dataset("json", data_files={"train": os.path.join(folder, "train.json"),
                                               "eval": os.path.join(folder, "eval.json")})
        for split, into in (("train", train), ("eval", evaluation)):
            picked = [raw[split][i] for i in split_indices(seed, len(raw[split]), data_split, phase=1)]
            into.extend(tokenize_chosen(picked, tokenizer, max_seq_len, end_token))
    return train, evaluation


def create_prompt_dataset(local_rank, args, tokenizer):
    os.makedirs(args.data_output_path, exist_ok=True)
    tokenizer_name = tokenizer.init_kwargs["name_or_path"].replace("/", "_")
    files = [os.path.join(args.data_output_path, f"{split}data_phase1_seed{args.seed}_{tokenizer_name}.pt")
             for split in ("train", "eval")]
    device = accelerator_of_utils().current_device_name()
    missing = torch.ByteTensor([not all(os.path.isfile(f) for f in files)]).to(device)
    torch.distributed.all_reduce(missing)
    if local_rank <= 0 and missing.item() != 0:
        built = build_phase1_data(args.data_path, args.data_split, args.seed, tokenizer, args.max_seq_len,
                                  tokenizer.eos_token)
        for data, path in zip(built, files):
            torch.save(data, path)
    torch.distributed.barrier()
    return [torch.load(path, weights_only=True) for path in files]


# -- training helpers (utils.py, perf.py) ------------------------------------------------------------------------

def to_device(batch, device):
    return {key: value.to(device) if hasattr(value, "to") else value for key, value in batch.items()}


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def optimizer_groups(model, weight_decay, lora_lr):
    def decays(name):
        return not any(part in name.lower() for part in NO_DECAY)

    def lora(name):
        return any(part in name.lower() for part in LORA_NAMES)

    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if decays(name) and not lora(name)], "weight_decay": weight_decay},
              {"params": [p for name, p in named if decays(name) and lora(name)], "weight_decay": weight_decay,
               "lr": lora_lr},
              {"params": [p for name, p in named if not decays(name)], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def print_throughput(hf_model, args, seconds, rank):
    if rank > 0:
        return
    config = hf_model.config
    hf_model._num_params = sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in hf_model.parameters())
    tokens = args.per_device_train_batch_size * args.max_seq_len
    passes = 4 if args.gradient_checkpointing else 3  # forward, backward twice over; a forward more when recomputing
    tflops = 2 * passes * hf_model._num_params * tokens / (seconds * torch.distributed.get_world_size() * 1e12)
    print(f"Model Parameters: {hf_model._num_params / 1e9:.3f} B ({hf_model._num_params} in {config.num_hidden_layers} "
          f"layers, hidden {config.hidden_size}, vocab {config.vocab_size}), Latency: {seconds:.2f}s, "
          f"TFLOPs: {tflops:.4f}, Samples/sec: {args.per_device_train_batch_size / seconds:.2f}", flush=True)


# -- saving (utils.save_hf_format, utils.save_zero_three_model) -----------------------------------------------

def save_hf_format(model, tokenizer, args):
    module = model.module if hasattr(model, "module") else model
    os.makedirs(args.output_dir, exist_ok=True)
    state = {key: value for key, value in module.state_dict().items() if "lora" not in key}
    torch.save(state, os.path.join(args.output_dir, "pytorch_model.bin"))
    module.config.to_json_file(os.path.join(args.output_dir, "config.json"))
    tokenizer.save_vocabulary(args.output_dir)


def save_zero_three_model(model, global_rank, save_dir, zero_stage):
    module = model.module if hasattr(model, "module") else model
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, "pytorch_model.bin")
    if zero_stage != 3:
        if global_rank == 0:
            torch.save(module.state_dict(), path)
        return
    gathered = {}
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id"):
            fetch = [param] if param.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
            with deepspeed.zero.GatheredParameters(fetch, enabled=True):
                value = param.data.cpu()
        else:
            value = param.cpu()
        if global_rank == 0 and "lora" not in name:
            gathered[name] = value
    if global_rank == 0:
        torch.save(gathered, path)


# -- main --------------------------------------------------------------------------------------------------------

def main():
    args = parse_args()
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = train_ds_config(args.offload, args.dtype, args.zero_stage, args.enable_tensorboard,
                                args.tensorboard_path, "step1_model")
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    seed_everything(args.seed)
    torch.distributed.barrier()

    tokenizer = load_tokenizer(args.model_name_or_path, args.eot_token if args.add_eot_token else None)
    model = create_model(args.model_name_or_path, tokenizer, ds_config, args.dropout)
    if args.lora_dim > 0:
        model = convert_linear_layer_to_lora(model, args.lora_module_name, args.lora_dim)
        if args.only_optimize_lora:
            model = only_optimize_lora_parameters(model)
            model = make_model_gradient_checkpointing_compatible(model)

    train_dataset, eval_dataset = create_prompt_dataset(args.local_rank, args, tokenizer)
    if args.local_rank == -1:
        train_sampler, eval_sampler = RandomSampler(train_dataset), SequentialSampler(eval_dataset)
    else:
        train_sampler, eval_sampler = DistributedSampler(train_dataset), DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=train_sampler,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, sampler=eval_sampler,
                                 batch_size=args.per_device_eval_batch_size)

    def evaluation(model, eval_dataloader):
        model.eval()
        total, batches = 0, 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**to_device(batch, device))
            total += outputs.loss.float()
            batches += 1
        mean = get_all_reduce_mean(total / batches)
        try:
            perplexity = torch.exp(mean).item()
        except OverflowError:
            perplexity = float("inf")
        return perplexity, mean.item()

    optimizer_class = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = optimizer_class(optimizer_groups(model, args.weight_decay, args.lora_learning_rate),
                                lr=args.learning_rate, betas=(0.9, 0.95))
    updates_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * updates_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    print_rank_0("***** Running training *****", args.global_rank)
    print_rank_0(f"***** Evaluating perplexity, Epoch 0/{args.num_train_epochs} *****", args.global_rank)
    perplexity, eval_loss = evaluation(model, eval_dataloader)
    print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
    for epoch in range(args.num_train_epochs):
        print_rank_0(f"Beginning of Epoch {epoch + 1}/{args.num_train_epochs}, Total Micro Batches "
                     f"{len(train_dataloader)}", args.global_rank)
        model.train()
        for step, batch in enumerate(train_dataloader):
            start = time.time()
            outputs = model(**to_device(batch, device), use_cache=False)
            loss = outputs.loss
            if args.print_loss:
                print(f"Epoch: {epoch}, Step: {step}, Rank: {torch.distributed.get_rank()}, loss = {loss}", flush=True)
            model.backward(loss)
            model.step()
            if torch.distributed.get_rank() == 0:
                print_throughput(model.model, args, time.time() - start, args.global_rank)
        print_rank_0(f"***** Evaluating perplexity, Epoch {epoch + 1}/{args.num_train_epochs} *****",
                     args.global_rank)
        perplexity, eval_loss = evaluation(model, eval_dataloader)
        print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
        model.tput_timer.update_epoch_count()

    if args.output_dir is not None:
        print_rank_0("saving the final model ...", args.global_rank)
        model = convert_lora_to_linear_layer(model)
        if args.global_rank == 0:
            save_hf_format(model, tokenizer, args)
        if args.zero_stage == 3:
            save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)


if __name__ == "__main__":
    main()
