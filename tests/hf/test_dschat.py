"""DeepSpeed-Chat step 1 (supervised fine-tuning) under `crew run --as_deepspeed --num_gpus 2`, offline, on CPU.

The application itself (DeepSpeedExamples@45b4b715 applications/DeepSpeed-Chat) stays out of the
repository: scripts/dschat_sft.py is written in its step 1 main.py's shape and makes the same DeepSpeed and
Hugging Face calls in the same order (no code copied; benchmarks/dschat_step1.py runs the real main.py).
The test writes a tiny OPT model, its tokenizer and local JSON data (dschat_tiny.py), then runs each
configuration in turn in one job (tests/runs_in_turn.py, one start of the ranks): ZeRO 0, ZeRO 2, ZeRO 3 with
--offload (DeepSpeedCPUAdam), and ZeRO 3 with LoRA (--only_optimize_lora) and --gradient_checkpointing. fp32, no
dropout, 2 epochs of 2 optimizer steps.

Checked for each: the job ends with 0, prints its perplexity lines, trains (the eval loss falls); its
eval loss before training is the pretrained model's, computed here without DeepSpeed or crew (so ZeRO-3's
zero.Init + from_pretrained loaded the real weights, not random ones); the throughput line counts every
parameter; the HF-format model it saves (pytorch_model.bin + config.json, LoRA merged) loads with
from_pretrained and gives the run's last eval loss. And the three full-model runs train alike.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import REPO, Result, crew

pytest.importorskip("transformers", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("datasets", reason="the DeepSpeed-Chat test needs datasets (the test extra)")
import torch  # noqa: E402
from dschat_tiny import eval_loss, write_data, write_model  # noqa: E402
from runs_in_turn import split_runs  # noqa: E402

SCRIPT = REPO / "tests" / "hf" / "scripts" / "dschat_sft.py"
RUNNER = REPO / "tests" / "runs_in_turn.py"
MAX_SEQ_LEN = 64
LORA_DIM = 4
COMMON = ["--data_split", "10,0,0", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "1",
          "--max_seq_len", str(MAX_SEQ_LEN), "--dtype", "fp32", "--dropout", "0.0", "--gradient_accumulation_steps",
          "2", "--num_train_epochs", "2", "--learning_rate", "1e-2", "--print_loss", "--deepspeed"]
RUNS = {
    "zero0": ["--zero_stage", "0"],
    "zero2": ["--zero_stage", "2"],
    "zero3_offload": ["--zero_stage", "3", "--offload"],
    "zero3_lora": ["--zero_stage", "3", "--lora_dim", str(LORA_DIM), "--only_optimize_lora",
                   "--gradient_checkpointing", "--lora_learning_rate", "1e-2"],
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
PPL_LINE = re.compile(r"\[[^\]]+:0\] ppl: (\S+), loss: (\S+)")
LOSS_LINE = re.compile(r"\[[^\]]+:(\d)\] Epoch: (\d+), Step: (\d+), Rank: \d, loss = (\S+)")
PARAMS_LINE = re.compile(r"\[[^\]]+:0\] Model Parameters: [\d.]+ B \((\d+) in ")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dschat")
    model, data = write_model(folder / "opt-tiny"), write_data(folder / "data")
    return folder, model, data, eval_loss(model, model, data, MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def runs(setup):
    """Every configuration run once, one after the other in one job (runs_in_turn.py: one start of the ranks
    instead of four); each run's output lines, told apart rank by rank, and its own failure, if any."""
    folder, model, data, _ = setup
    argvs = {name: [str(SCRIPT), "--model_name_or_path", str(model), "--data_path", str(data), "--data_output_path",
                    str(folder / f"cache-{name}"), "--output_dir", str(folder / name), *COMMON, *flags]
             for name, flags in RUNS.items()}
    (folder / "runs.json").write_text(json.dumps(argvs))
    job = crew("run", "--as_deepspeed", "--num_gpus", "2", str(RUNNER), "runs.json", cwd=folder,
               env={**OFFLINE, "HF_DATASETS_CACHE": str(folder / "hf-datasets")}, timeout=600)
    return {name: (Result(job.code or int(failed), out, job.err, job.seconds), folder / name)
            for name, (out, failed) in split_runs(job.out, RUNS).items()}


def finished(runs, name):
    run, out = runs[name]
    assert run.code == 0, f"{name}: exit {run.code}\n{run.out[-3000:]}\n{run.err[-3000:]}"
    eval_losses = [float(loss) for _, loss in PPL_LINE.findall(run.out)]
    return run, out, eval_losses


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel)


@pytest.mark.parametrize("name", RUNS)
def test_it_trains_and_prints_its_perplexity(runs, name):
    run, _, eval_losses = finished(runs, name)
    assert len(eval_losses) == 3, run.out[-3000:]  # before training and after each of the 2 epochs
    assert all(math.isfinite(loss) for loss in eval_losses)
    assert eval_losses[-1] < eval_losses[0] - 0.05, eval_losses
    train_losses = LOSS_LINE.findall(run.out)
    assert sorted({rank for rank, *_ in train_losses}) == ["0", "1"]
    assert len(train_losses) == 2 * 2 * 4  # 2 ranks, 2 epochs, 4 micro batches
    assert all(math.isfinite(float(loss)) for *_, loss in train_losses)


@pytest.mark.parametrize("name", RUNS)
def test_eval_before_training_is_the_pretrained_models(runs, setup, name):
    # under ZeRO-3 the model is built by zero.Init inside from_pretrained: random weights would give about 5.6
    *_, pretrained = setup
    _, _, eval_losses = finished(runs, name)
    assert close(eval_losses[0], pretrained), (eval_losses[0], pretrained)


@pytest.mark.parametrize("name", RUNS)
def test_the_throughput_line_counts_every_parameter(runs, setup, name):
    from transformers import AutoModelForCausalLM

    _, model_folder, *_ = setup
    run, *_ = finished(runs, name)
    model = AutoModelForCausalLM.from_pretrained(model_folder)
    model.resize_token_embeddings(264)
    expected = sum(p.numel() for p in model.parameters())
    if "--lora_dim" in RUNS[name]:
        linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "decoder.layers." in n]
        expected += sum(LORA_DIM * (m.in_features + m.out_features) for m in linears)
    counts = {int(count) for count in PARAMS_LINE.findall(run.out)}
    assert counts == {expected}


@pytest.mark.parametrize("name", RUNS)
def test_the_saved_model_loads_and_gives_the_last_eval_loss(runs, setup, name):
    _, model_folder, data, _ = setup
    _, out, eval_losses = finished(runs, name)
    saved = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert saved and not [key for key in saved if "lora" in key]
    assert all(tensor.numel() > 0 for tensor in saved.values())
    assert close(eval_loss(out, model_folder, data, MAX_SEQ_LEN), eval_losses[-1])


def test_the_stages_train_alike(runs):
    # fp32, no dropout, the same data order: ZeRO 0, 2 and 3 (offloaded) give the same eval losses
    reference = finished(runs, "zero0")[2]
    for name in ("zero2", "zero3_offload"):
        losses = finished(runs, name)[2]
        assert all(close(a, b) for a, b in zip(reference, losses, strict=True)), (name, reference, losses)
