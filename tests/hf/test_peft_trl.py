"""PEFT and TRL through the Hugging Face Trainer on crew's engine (`crew run --as_deepspeed`, 2 ranks,
ZeRO-2 with an HF-docs "auto" config): one job trains a LoRA model, resumes it from a checkpoint, saves the
adapter, and runs a short TRL SFTTrainer; the tests read what each rank left behind."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (the test extra)")
pytest.importorskip("peft", reason="the PEFT test needs peft (the test extra)")
pytest.importorskip("trl", reason="the TRL test needs trl (the test extra)")
pytest.importorskip("datasets", reason="the TRL test needs datasets (the test extra)")
import torch  # noqa: E402
from conftest import crew, write_script  # noqa: E402

from crew.runtime.checkpoint.exporting import read_fp32_module  # noqa: E402

# WarmupLR from min lr 0 runs the first two steps at lr 0: checkpoint-3 is the first with trained weights.
LORA_STEPS, SAVE_STEPS, SFT_STEPS = 5, 3, 3

# In the shape of PEFT's and TRL's DeepSpeed guides: a ZeRO-2 config whose values Trainer fills ("auto"),
# TrainingArguments/SFTConfig(deepspeed=...), get_peft_model with a LoraConfig, SFTTrainer on a text dataset.
SCRIPT = """
    import argparse, json, os
    import torch
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int, nargs=3)
    parser.add_argument("--local_rank", type=int, default=-1)
    cli = parser.parse_args()
    out, (lora_steps, save_steps, sft_steps) = cli.out, cli.steps
    rank = int(os.environ["RANK"])
    ds_config = {
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "overlap_comm": True,
                              "reduce_scatter": True, "contiguous_gradients": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    }

    def base_model(vocab_size=100, **ids):
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab_size, n_positions=32,
                                          **ids))

    def lora_trainer(folder):
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["c_attn"], fan_in_fan_out=True,
                          task_type="CAUSAL_LM")
        model = get_peft_model(base_model(), lora)
        tokens = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(1))
        args = TrainingArguments(output_dir=folder, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 max_steps=lora_steps, save_steps=save_steps, logging_steps=1, learning_rate=1e-2,
                                 deepspeed=ds_config, report_to=[], seed=0)
        return Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens])

    def losses(trainer, after=0):
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after}

    # PEFT: train, save (checkpoint-N/global_stepN and the adapter), resume from the first checkpoint
    full = lora_trainer(f"{out}/lora")
    full.train()
    full.save_model(f"{out}/lora/final")
    resumed = lora_trainer(f"{out}/lora-resumed")
    resumed.train(resume_from_checkpoint=f"{out}/lora/checkpoint-{save_steps}")
    result = {"world_size": full.args.world_size, "lora_losses": losses(full),
              "resumed_losses": losses(resumed, after=save_steps),
              "trainable": [n for n, p in full.model.named_parameters() if p.requires_grad],
              "frozen": [n for n, p in full.model.named_parameters() if not p.requires_grad]}
    tensors = {"lora": get_peft_model_state_dict(full.model), "resumed": get_peft_model_state_dict(resumed.model),
               "base": {n: p.detach().clone() for n, p in full.model.named_parameters() if not p.requires_grad}}
    if rank == 0:
        loaded = PeftModel.from_pretrained(base_model(), f"{out}/lora/final")
        tensors["loaded"] = get_peft_model_state_dict(loaded)
        tensors["fresh_base"] = {n: p for n, p in loaded.named_parameters() if "lora_" not in n}

    # TRL: a word-level tokenizer built here (no download), a text dataset in memory, SFTConfig's defaults but
    # bf16 (transformers refuses bf16 without a GPU unless use_cpu, which would turn DeepSpeed off)
    words = "the a cat dog sat ran on under mat log red blue big small".split()
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    generator = torch.Generator().manual_seed(2)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (8,), generator=generator))
             for _ in range(48)]
    sft_args = SFTConfig(output_dir=f"{out}/sft", per_device_train_batch_size=4, max_steps=sft_steps,
                         logging_steps=1, learning_rate=1e-3, max_length=16, deepspeed=ds_config, report_to=[],
                         save_strategy="no", bf16=False, seed=0)
    sft_model = base_model(len(vocab), pad_token_id=0, bos_token_id=1, eos_token_id=1)
    sft = SFTTrainer(model=sft_model, args=sft_args, train_dataset=Dataset.from_dict({"text": texts}),
                     processing_class=tokenizer)
    initial = {n: p.detach().clone() for n, p in sft_model.named_parameters()}
    sft.train()
    result.update(sft_losses=losses(sft), sft_steps=sft.state.global_step, sft_world_size=sft.args.world_size,
                  sft_checkpointing=sft.args.gradient_checkpointing, sft_moved=max((p - initial[n]).abs().max().item()
                                                       for n, p in sft.model.named_parameters()))
    tensors["sft"] = {n: p.detach().float().clone() for n, p in sft.model.named_parameters()}
    torch.save(tensors, f"{out}/tensors{rank}.pt")
    with open(f"{out}/result{rank}.json", "w") as file:
        json.dump(result, file)
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The one crew job of this module: per rank, its result JSON and its tensors."""
    folder = tmp_path_factory.mktemp("peft_trl")
    write_script(folder, "train.py", SCRIPT)
    run = crew("run", "--as_deepspeed", "--num_gpus", "2", "train.py", "out", str(LORA_STEPS), str(SAVE_STEPS),
               str(SFT_STEPS), cwd=folder, timeout=300)
    assert run.code == 0, run.out[-3000:] + run.err[-5000:]
    out = folder / "out"
    results = [json.loads((out / f"result{rank}.json").read_text()) for rank in range(2)]
    tensors = [torch.load(out / f"tensors{rank}.pt", weights_only=True) for rank in range(2)]
    return out, results, tensors


def assert_same(left: dict, right: dict) -> None:
    assert left.keys() == right.keys() and left
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_lora_trains_at_zero2_on_both_ranks(job):
    _, results, tensors = job
    result = results[0]
    assert result["world_size"] == 2
    assert sorted(map(int, result["lora_losses"])) == list(range(1, LORA_STEPS + 1))
    assert all(math.isfinite(loss) for loss in result["lora_losses"].values())
    assert result["trainable"] and all("lora_" in name for name in result["trainable"])
    assert_same(tensors[0]["lora"], tensors[1]["lora"])  # one model on both ranks
    # it trained (lora_B starts at zero) and the frozen base did not move
    assert any(value.abs().max() > 0 for name, value in tensors[0]["lora"].items() if "lora_B" in name)
    assert_same(tensors[0]["base"], tensors[0]["fresh_base"])


def test_lora_checkpoint_leaves_out_the_frozen_base(job):
    out, results, _ = job
    step_folder = out / "lora" / f"checkpoint-{SAVE_STEPS}"
    assert (step_folder / "latest").read_text().strip() == f"global_step{SAVE_STEPS}"
    saved = read_fp32_module(step_folder / f"global_step{SAVE_STEPS}")
    # Trainer saves PEFT models with save_checkpoint(dir, exclude_frozen_parameters=True)
    assert set(results[0]["trainable"]) <= saved.keys()
    assert not saved.keys() & set(results[0]["frozen"])
    assert any(saved[name].abs().max() > 0 for name in results[0]["trainable"] if "lora_B" in name)


def test_lora_resume_repeats_the_uninterrupted_run(job):
    _, results, tensors = job
    # Trainer resumes a PEFT model with load_checkpoint(..., load_module_strict=False)
    for result in results:
        resumed = result["resumed_losses"]
        assert sorted(map(int, resumed)) == list(range(SAVE_STEPS + 1, LORA_STEPS + 1))
        assert resumed == {step: result["lora_losses"][step] for step in resumed}
    for rank_tensors in tensors:
        assert_same(rank_tensors["resumed"], rank_tensors["lora"])


def test_saved_adapter_loads_with_the_trained_weights(job):
    out, _, tensors = job
    assert (out / "lora" / "final" / "adapter_model.safetensors").is_file()
    assert_same(tensors[0]["loaded"], tensors[0]["lora"])


def test_sft_trainer_trains_on_both_ranks(job):
    _, results, tensors = job
    for result in results:
        assert (result["sft_world_size"], result["sft_steps"]) == (2, SFT_STEPS)
        assert sorted(map(int, result["sft_losses"])) == list(range(1, SFT_STEPS + 1))
        assert all(math.isfinite(loss) for loss in result["sft_losses"].values())
        assert result["sft_moved"] > 0
    assert_same(tensors[0]["sft"], tensors[1]["sft"])
