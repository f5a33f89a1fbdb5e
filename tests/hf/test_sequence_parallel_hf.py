"""Ulysses sequence parallelism (DeepSpeed's ALST) as Hugging Face users reach it, unchanged under
`crew run --as_deepspeed`, SP 2 on 2 ranks and SP 2 x DP 2 on 4:

* scripts/accelerate_ulysses_sp.py, in the shape of accelerate's own check
  (test_utils/scripts/external_deps/test_ds_alst_ulysses_sp.py): ParallelismConfig(sp_backend="deepspeed",
  sp_size=2) on an Accelerator, the loop's own SP loss, ZeRO-2 from the launch YAML (as accelerate's test
  runs it with `--zero_stage`), `--num_gpus 2`: SP over both ranks, one data-parallel rank;
* scripts/trainer_ulysses_sp.py: transformers' Trainer with TrainingArguments(deepspeed=..., parallelism_config=
  ParallelismConfig(sp_size=2, dp_replicate_size=2, ...)), ZeRO-3, `--num_gpus 4`: two SP groups, {0, 1} and
  {2, 3}, beside each other as data parallelism, through Trainer's own SP path (adapter, batch count, loss).
  The loss's all_gather backward runs in the group {2, 3}, which torch's gloo fails without crew's gloo_fix.

Each trains a tiny Llama a few steps; rank 0 also trains a copy of the initial model in one process, without
SP, on the sequences the steps saw: under DP a step's sequences from both data-parallel groups, as one batch.
Asserted: every step's loss and gradient norm equal that reference's, every sequence is trained on once, and
the weights saved load with from_pretrained and equal the reference's.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO, crew

pytest.importorskip("transformers", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("accelerate", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")

SCRIPTS = REPO / "tests" / "hf" / "scripts"
SP = 2

# What `accelerate config` writes for DeepSpeed without a config file (accelerate's test passes the same as
# `accelerate launch --use_deepspeed --zero_stage=2`), fp32
ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_clipping: 1.0
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def load(folder):
    from transformers import LlamaForCausalLM

    return dict(LlamaForCausalLM.from_pretrained(folder).named_parameters())


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def run(job_dir, ranks: int, *args):
    result = crew("run", "--as_deepspeed", "--num_gpus", str(ranks), *args, cwd=job_dir, timeout=300)
    assert result.code == 0, result.err[-4000:]
    seen = json.loads((job_dir / "result.json").read_text())
    out = job_dir / "out"
    return seen, {name: load(out / name) for name in ("initial", "final", "reference")}


@pytest.fixture(scope="module")
def accelerate_job(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("accelerate_sp")
    (job_dir / "accelerate_ds.yaml").write_text(ACCELERATE_YAML)
    return run(job_dir, 2, "--config_file", "accelerate_ds.yaml", str(SCRIPTS / "accelerate_ulysses_sp.py"))


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("trainer_sp")
    return run(job_dir, 4, str(SCRIPTS / "trainer_ulysses_sp.py"), "--stage", "3")


def assert_steps_equal_the_reference(seen):
    """Loss and gradient norm of each step equal the one-process reference's: crew's gradient under SP is the
    one-process gradient at every ZeRO stage. DeepSpeed 0.19.8's is too at ZeRO-3, but SP times it at ZeRO
    0-2 with these scripts' loss (measured, 2 CPU ranks, SP 2): the loss is the whole sequence's on every SP
    rank, gathered with torch.distributed.nn.functional.all_gather, whose backward sums the SP ranks'
    gradients, and DeepSpeed's ZeRO 0-2 all-reduce then divides by world / SP. Clipping and Adam hide that
    factor from the losses and the weights; the norm shows it."""
    assert len(seen["steps"]) == len(seen["reference"]) > 1
    for step, reference in zip(seen["steps"], seen["reference"], strict=True):
        assert math.isclose(step["loss"], reference["loss"], rel_tol=1e-5), (step, reference)
        assert math.isclose(step["grad_norm"], reference["grad_norm"], rel_tol=1e-4), (step, reference)


def assert_weights_equal_the_reference(weights, learning_rate: float):
    moved = largest_difference(weights["final"], weights["initial"])
    assert moved > learning_rate  # it trained: Adam moves a weight by about the lr per step
    # Adam divides each gradient by its own size, so float noise on a near-zero one moves its weight by up to
    # the lr: a few ulp-level differences a step, not lr-sized ones
    assert largest_difference(weights["final"], weights["reference"]) < learning_rate / 10


def test_accelerate_alst_script_trains_as_one_process_without_sp(accelerate_job):
    seen, weights = accelerate_job
    assert seen["engine"].startswith("crew.")
    assert (seen["world"], seen["sp_size"], seen["zero_stage"]) == (2, SP, 2)
    # the prepared loader shards the 4 samples over the 2 ranks; the adapter turns each rank's 2 batches into
    # SP x 2 steps, one whole sample each, every sample once and in order
    assert seen["batches"] == 4
    assert [step["input_ids"][0] for step in seen["steps"]] == [101, 133, 165, 197]
    assert all(len(step["input_ids"]) == 32 for step in seen["steps"])
    assert_steps_equal_the_reference(seen)
    assert_weights_equal_the_reference(weights, seen["learning_rate"])


def test_trainer_with_sp_beside_dp_trains_as_one_process_without_sp(trainer_job):
    seen, weights = trainer_job
    assert seen["engine"].startswith("crew.")
    assert (seen["world"], seen["sp_size_seen"]) == (4, SP)
    # Trainer's batch arithmetic: per device x a data-parallel world of world // SP = 2 sequences a step
    data_parallel = seen["world"] // SP
    assert (data_parallel, seen["per_device_train_batch_size"]) == (2, 1)
    assert seen["total_train_batch_size"] == seen["train_batch_size"] == data_parallel
    # the loader shards the 8 sequences over the 4 ranks, each SP group trains its 2 ranks' 4 one at a time
    assert seen["global_step"] == len(seen["dataset"]) // data_parallel == len(seen["steps"])
    assert all(len(step) == data_parallel for step in seen["seen"])  # one sequence per data-parallel group
    assert sorted(sum(seen["seen"], [])) == sorted(seen["dataset"])  # every sequence once, whole
    # Trainer logs the ranks' losses averaged (the SP ranks of a group hold the same one), and the two groups'
    # sequences are as long, so a step's loss is the reference's mean token loss over both; its gradient is
    # DP's average of the groups' gradients, which is that loss's
    assert_steps_equal_the_reference(seen)
    assert_weights_equal_the_reference(weights, seen["learning_rate"])
