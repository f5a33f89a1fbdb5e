# A Hugging Face Trainer script with DeepSpeed's AutoTP ("tensor_parallel": {"autotp_size": --tp}) and "auto"
# values, run under `crew run --as_deepspeed`: 4 steps, save_model, then rank 0 loads the saved folder with
# from_pretrained and compares it with the trained weights (each TP slice gathered whole).
import argparse
import json

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--tp", type=int, default=2)
parser.add_argument("--stage", type=int, default=1)
args = parser.parse_args()

config = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": args.stage},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
          "train_micro_batch_size_per_gpu": "auto", "tensor_parallel": {"autotp_size": args.tp}}


class Record(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))
tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]
training_args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                                  learning_rate=1e-2, weight_decay=0.01, deepspeed=config, report_to=[], seed=0,
                                  save_strategy="no")
record = Record()
trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[record])
trainer.train()
trainer.save_model("out/final")
whole = {}
for name, param in trainer.model.named_parameters():
    if getattr(param, "crew_tp_dim", None) is not None:
        from crew.runtime.tensor_parallel import gather_full
        whole[name] = gather_full(param).float()
    else:
        whole[name] = param.detach().float()
result = {"losses": record.losses, "world": dist.get_world_size()}
if dist.get_rank() == 0:
    loaded = LlamaForCausalLM.from_pretrained("out/final", torch_dtype=torch.float32).state_dict()
    result["worst"] = max((loaded[name] - value).abs().max().item() for name, value in whole.items())
    result["shape"] = list(loaded["model.layers.0.self_attn.q_proj.weight"].shape)
with open(f"result{dist.get_rank()}.json", "w") as f:
    json.dump(result, f)
