"""A Hugging Face Trainer script at ZeRO stage 3 (transformers' DeepSpeed docs' "auto" config), unchanged, under
`crew run --as_deepspeed --num_gpus 2`. The test writes a small pretrained GPT-2 checkpoint (trained here for a
few steps so that its eval loss is far from a random model's) and its evaluation loss computed without crew;
one job (scripts/trainer_zero3.py) loads it with from_pretrained under zero.Init, evaluates, trains, resumes,
saves with and without stage3_gather_16bit_weights_on_model_save, and trains a PEFT LoRA model on it."""

from __future__ import annotations

import json
import math
import runpy
import sys

import pytest

pytest.importorskip("transformers", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("accelerate", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("peft", reason="the PEFT test needs peft (the test extra)")
import torch  # noqa: E402
from conftest import REPO, crew  # noqa: E402

from crew.runtime.checkpoint.exporting import read_fp32_module  # noqa: E402

SCRIPT = REPO / "tests" / "hf" / "scripts" / "trainer_zero3.py"
VOCAB, LENGTH, EVAL_ROWS, EVAL_BATCH = 100, 16, 16, 4


def sequences(count: int, seed: int) -> torch.Tensor:
    """Rows of an arithmetic progression mod VOCAB (random start, step 1-3): learnable in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    step = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + step * torch.arange(LENGTH)) % VOCAB


def pretrained_checkpoint(folder) -> tuple[dict, float]:
    """Write folder/pretrained (a tiny GPT-2 trained for 60 steps) and folder/data.pt; return the checkpoint's
    tensors and its eval loss as Trainer reports it: the mean over batches of EVAL_BATCH rows of each batch's
    loss. The eval labels' first token is -100 (never a target after the shift anyway), so that Trainer's
    token count for the loss is the model's own."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(60):
        batch = sequences(32, 100 + step)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    rows = sequences(EVAL_ROWS, 2)
    labels = rows.clone()
    labels[:, 0] = -100
    with torch.no_grad():
        losses = [model(input_ids=rows[i:i + EVAL_BATCH], labels=labels[i:i + EVAL_BATCH]).loss.item()
                  for i in range(0, EVAL_ROWS, EVAL_BATCH)]
    model.save_pretrained(folder / "pretrained")
    torch.save({"train": sequences(64, 1), "eval": rows, "eval_labels": labels}, folder / "data.pt")
    return {name: value.detach().clone() for name, value in model.named_parameters()}, sum(losses) / len(losses)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The one crew job of this module: per rank its result JSON, rank 0's gathered tensors, the pretrained
    weights and eval loss."""
    folder = tmp_path_factory.mktemp("trainer_zero3")
    pretrained, eval_loss = pretrained_checkpoint(folder)
    run = crew("run", "--num_gpus", "2", "--as_deepspeed", str(SCRIPT), "pretrained", "data.pt", cwd=folder,
               timeout=300)
    assert run.code == 0, run.out[-3000:] + run.err[-5000:]
    results = [json.loads((folder / f"result{rank}.json").read_text()) for rank in range(2)]
    tensors = torch.load(folder / "tensors.pt", weights_only=True)
    return folder, results, tensors, pretrained, eval_loss


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def assert_same(left: dict, right: dict) -> None:
    assert left.keys() == right.keys() and left
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_from_pretrained_under_zero_init_loads_the_checkpoint_partitioned(job):
    _, results, tensors, pretrained, eval_loss = job
    for result in results:
        assert result["world"] == 2 and result["zero3_enabled"]
        held = result["held"]
        # every parameter partitioned at construction: no rank holds the model whole (padding aside)
        assert held["partitioned"] == held["params"] and held["numel"] == sum(p.numel() for p in pretrained.values())
        assert held["partition"] + held["data"] <= held["numel"] / 2 + 2 * held["params"], held
        # the first evaluation, before any step: the checkpoint's loss, not a random model's (about ln 100)
        first_step, first_loss = result["full"]["evals"][0]
        assert first_step == 0 and close(first_loss, eval_loss, 1e-5), (first_loss, eval_loss)
    assert_same(tensors["loaded"], pretrained)


def test_trainer_trains_the_same_model_on_both_ranks(job):
    _, (rank0, rank1), tensors, pretrained, _ = job
    assert rank0["full"]["engine"] and rank0["lora"]["engine"]  # Trainer's model_wrapped is a DeepSpeedEngine
    assert [log["step"] for log in rank0["full"]["steps"]] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"]) for log in rank0["full"]["steps"])
    assert rank0["full"]["digest"] == rank1["full"]["digest"]
    assert any(not torch.equal(tensors["full"][name], pretrained[name]) for name in pretrained)


def test_resume_from_checkpoint_continues_exactly(job):
    folder, results, tensors, _, _ = job
    step_folder = folder / "out" / "checkpoint-3"
    assert (step_folder / "latest").read_text().strip() == "global_step3"
    assert (step_folder / "global_step3").is_dir()
    for result in results:
        full, resumed = result["full"], result["resumed"]
        assert [log for log in resumed["steps"] if log["step"] > 3] == full["steps"][3:]  # losses, norms, lr
        # the evaluation on resuming (step 3, the loaded weights) and at step 6 repeat the uninterrupted run's
        assert resumed["evals"][-2:] == full["evals"][-2:] and full["evals"][-2][0] == 3
        assert resumed["digest"] == full["digest"]
    assert_same(tensors["resumed"], tensors["full"])


def test_save_model_writes_a_model_from_pretrained_loads(job):
    from transformers import GPT2LMHeadModel

    folder, results, tensors, _, _ = job
    loaded = GPT2LMHeadModel.from_pretrained(folder / "out" / "final")
    assert_same({name: value.detach() for name, value in loaded.named_parameters()}, tensors["full"])
    # generate() on the trained ZeRO-3 model, on both ranks, gives the saved model's tokens
    prompt = torch.load(folder / "data.pt", weights_only=True)["eval"][:2, :4]
    expected = loaded.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    assert results[0]["generated"] == results[1]["generated"] == expected


def test_save_model_without_gathering_leaves_a_checkpoint_zero_to_fp32_recovers(job, monkeypatch):
    # stage3_gather_16bit_weights_on_model_save false: Accelerate's get_state_dict raises ValueError, and Trainer
    # saves a checkpoint instead (no model.safetensors) for zero_to_fp32.py, which DeepSpeed's docs point to
    folder, _, tensors, _, _ = job
    final = folder / "out-resumed" / "final"
    assert (final / "latest").read_text().strip() == "global_step6"
    assert not (final / "model.safetensors").exists()
    # (DeepSpeed 0.19.8's own script refuses --safe_serialization for a model with tied weights: the default)
    monkeypatch.setattr(sys, "argv", ["zero_to_fp32.py", str(final), str(folder / "recovered")])
    runpy.run_path(str(final / "zero_to_fp32.py"), run_name="__main__")
    recovered = torch.load(folder / "recovered" / "pytorch_model.bin", weights_only=True)
    assert_same({name: recovered[name] for name in tensors["resumed"]}, tensors["resumed"])


def test_lora_trains_its_adapters_on_a_frozen_pretrained_base(job):
    _, (rank0, rank1), tensors, pretrained, _ = job
    trainable = rank0["lora"]["trainable"]
    assert trainable and all("lora_" in name for name in trainable)
    assert rank0["lora"]["digest"] == rank1["lora"]["digest"]
    lora = tensors["lora"]
    base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): value
            for name, value in lora.items() if "lora_" not in name}
    assert_same(base, pretrained)
    assert any(lora[name].abs().max() > 0 for name in trainable if "lora_B" in name)  # lora_B starts at zero


def test_lora_checkpoint_leaves_out_the_frozen_base(job):
    # Trainer saves a PEFT model with save_checkpoint(dir, exclude_frozen_parameters=True)
    folder, results, _, _, _ = job
    step_folder = folder / "lora" / "checkpoint-2"
    assert (step_folder / "latest").read_text().strip() == "global_step2"
    saved = read_fp32_module(step_folder / "global_step2")
    trainable = set(results[0]["lora"]["trainable"])
    assert trainable <= saved.keys()
    # nothing of the frozen base, the tied lm_head (the frozen wte) included: DeepSpeed 0.19.8 keeps that name
    # at stage 3 with an empty placeholder
    assert not {name: tuple(value.shape) for name, value in saved.items() if name not in trainable and value.numel()}


def test_lora_resume_repeats_the_uninterrupted_run(job):
    # Trainer resumes a PEFT model with load_checkpoint(..., load_module_strict=False): the base comes from
    # from_pretrained, the adapters and optimizer from the checkpoint
    _, results, tensors, _, _ = job
    for result in results:
        full, resumed = result["lora"], result["lora_resumed"]
        assert [log for log in resumed["steps"] if log["step"] > 2] == full["steps"][2:]
    assert_same(tensors["lora_resumed"], tensors["lora"])


def test_lora_adapter_saved_at_stage3_loads_with_the_trained_weights(job):
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    folder, _, tensors, _, _ = job
    base = GPT2LMHeadModel.from_pretrained(folder / "pretrained")
    loaded = PeftModel.from_pretrained(base, folder / "lora" / "final")
    assert_same({name: value.detach() for name, value in loaded.named_parameters()}, tensors["lora"])
