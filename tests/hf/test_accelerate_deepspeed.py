"""An Accelerate training loop with a DEEPSPEED launch YAML, unchanged, on crew's engine:
`crew run --as_deepspeed --num_gpus 2 --config_file accelerate_ds.yaml train.py` (scripts/accelerate_deepspeed.py).

Two jobs, one per DeepSpeed config in the shape of Accelerate's DeepSpeed docs: ZeRO-1 with the optimizer and
scheduler in the config (DummyOptim, DummyScheduler), and ZeRO-2 with optimizer offload and the script's own
AdamW and scheduler. Each trains 6 steps, saves its state at step 3 (save_state), loads it back (load_state)
and trains steps 4-6 again; each rank also trains a one-process reference on the whole global batches.
And the GPU-shaped start, without a GPU: Accelerate's `deepspeed.comm.init_distributed(...)` on crew's comm.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, crew

pytest.importorskip("transformers", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")
pytest.importorskip("accelerate", reason="the Hugging Face tests need the test extra: pip install 'crew[test]'")

from crew.launcher.node.agent import DEEPSPEED_SHIM  # noqa: E402
from crew.launcher.plan.ports import free_port  # noqa: E402

SCRIPT = REPO / "tests" / "hf" / "scripts" / "accelerate_deepspeed.py"

# What `accelerate config` writes for DeepSpeed with a config file, on one machine with two processes.
ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_config_file: ds.json
  zero3_init_flag: false
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
COMMON = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
          "steps_per_print": 2000, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "wall_clock_breakdown": False}
CONFIGS = {
    1: {**COMMON, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True,
                                                   "adam_w_mode": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 1}},
    2: {**COMMON, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True}},
}
# ZeRO-3 as accelerate's deepspeed_with_config_support.py runs it (zero3_init_flag, get_state_dict for
# save_pretrained on every rank): the model is sharded, the rest as at stage 2
CONFIGS[3] = {**CONFIGS[2], "zero_optimization": {**CONFIGS[2]["zero_optimization"], "stage": 3,
                                                  "stage3_gather_16bit_weights_on_model_save": True,
                                                  # the weights sharded, the biases and norms whole (the default,
                                                  # 1e5 elements, keeps all of this small model's whole)
                                                  "stage3_param_persistence_threshold": 100}}
# The lr each of the 6 steps used. Stage 1: DeepSpeed's WarmupDecayLR as Accelerate fills it (min 0, max the
# DummyOptim's 0.01, warmup 2 steps, total 6 / 2 processes), its log warmup at 0 for two steps. Stage 2:
# transformers' linear schedule, which Accelerate steps once per process at each optimizer step.
LRS = {1: [0.0, 0.0, 0.01, 0.01, 0.0, 0.0], 2: [0.01 * (12 - 2 * k) / 12 for k in range(6)]}
LRS[3] = LRS[2]


@pytest.fixture(scope="module", params=[1, 2, 3],
                ids=["zero1-config-optimizer", "zero2-client-optimizer", "zero3-client-optimizer"])
def job(request, tmp_path_factory):
    stage = request.param
    folder = tmp_path_factory.mktemp(f"zero{stage}")
    (folder / "accelerate_ds.yaml").write_text(ACCELERATE_YAML.replace("zero3_init_flag: false",
                                                                       f"zero3_init_flag: {str(stage == 3).lower()}"))
    (folder / "ds.json").write_text(json.dumps(CONFIGS[stage], indent=2))
    run = crew("run", "--as_deepspeed", "--num_gpus", "2", "--config_file", "accelerate_ds.yaml", str(SCRIPT),
               cwd=folder)
    assert run.code == 0, run.err[-4000:]
    results = [json.loads((folder / f"result{rank}.json").read_text()) for rank in range(2)]
    if stage == 3:  # the script's own from_pretrained is under zero.Init there (as under DeepSpeed): load it here
        from transformers import GPT2LMHeadModel
        loaded = GPT2LMHeadModel.from_pretrained(folder / "out" / "model")
        results[0]["loaded_digest"] = hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in loaded.parameters())).hexdigest()
    return stage, run, results


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def test_one_world_of_two_ranks_on_crews_engine(job):
    stage, run, results = job
    assert "an Accelerate script needs" not in run.err  # no pre-start warning: crew's engine is DeepSpeed
    for rank, seen in enumerate(results):
        assert (seen["world"], seen["rank"]) == (2, rank)
        assert seen["distributed_type"] == "DistributedType.DEEPSPEED"
        assert seen["engine"].startswith("crew.")
    seen = results[0]
    accumulation = CONFIGS[stage]["gradient_accumulation_steps"]
    assert seen["gradient_accumulation_steps"] == accumulation
    assert seen["global_batch"] == 2 * accumulation * 2  # micro batch x accumulation x ranks
    config = seen["ds_config"]  # the "auto" values as Accelerate fills them
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_clipping"]) == (2, 1.0)
    if stage == 1:
        assert config["optimizer"]["params"]["lr"] == 0.01
        assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                 "warmup_num_steps": 2, "total_num_steps": 3}
    else:
        assert config["zero_optimization"]["reduce_bucket_size"] == 32 * 32  # hidden size squared
        assert "offload_optimizer to cpu has no effect, training already runs on the CPU" in run.out


def test_each_step_equals_one_process_on_the_global_batch(job):
    """The lr schedule, the gradient norm (before clipping, of the gradient averaged over both ranks and the
    accumulated micro batches) and the parameters after the first steps, against torch alone."""
    stage, _, (seen, _) = job
    assert [step["lr"] for step in seen["full"]] == pytest.approx(LRS[stage])
    steps = len(seen["reference_norms"])
    for step, norm in zip(seen["full"][:steps], seen["reference_norms"]):
        assert close(step["grad_norm"], norm, 1e-5), (step["grad_norm"], norm)
    assert seen["moved"] > 5e-3  # the parameters moved (by about the lr per step, under Adam)...
    # ... as torch's own AdamW moved them; a lost weight decay group would differ by 1e-3 (lr 0.01 x 0.1)
    assert seen["reference_max_difference"] < 1e-4


def test_unwrapped_parameters_are_whole_and_equal_on_both_ranks(job):
    stage, _, (rank0, rank1) = job
    assert rank0["whole"] == rank1["whole"] == (stage < 3)  # ZeRO-3: sharded (the digest gathers them)
    assert rank0["final"] == rank1["final"]
    assert rank0["loaded_digest"] == rank0["resumed_digest"]  # save_pretrained of get_state_dict -> from_pretrained


def test_save_state_and_load_state_resume_exactly(job):
    stage, _, (seen, _) = job
    assert seen["latest"] == "pytorch_model"  # DeepSpeed's tag under save_state's folder, where load_state looks
    files = set(seen["files"])
    assert {"pytorch_model", "pytorch_model/crew_checkpoint.json", "random_states_0.pkl",
            "random_states_1.pkl"} <= files
    # Accelerate saves a scheduler it steps itself; DeepSpeed's scheduler is in the engine's checkpoint
    assert ("scheduler.bin" in files) == (stage != 1)
    assert seen["finite"] and seen["full"][-1]["loss"] < seen["full"][0]["loss"]  # it trains
    uninterrupted = seen["full"][3:]
    for a, b in zip(uninterrupted, seen["resumed"], strict=True):
        assert close(a["loss"], b["loss"]) and close(a["grad_norm"], b["grad_norm"]) and a["lr"] == b["lr"], (a, b)
    assert seen["resumed_digest"] == seen["final"]["digest"]


# Accelerate's PartialState on a GPU machine under `accelerate launch` with DeepSpeed: LOCAL_RANK is set, so it
# starts the group through `deepspeed.comm.init_distributed(dist_backend=..., auto_mpi_discovery=False,
# timeout=...)`. Without a GPU it would pick no backend; here it picks gloo with the GPU's distributed type.
GPU_SHAPED = """
    import datetime, json, sys
    sys.path.insert(0, sys.argv[1])  # crew's shim, first on the path as `crew run --as_deepspeed` puts it
    import torch, torch.distributed as dist
    from accelerate.state import DistributedType, PartialState
    from accelerate.utils import is_deepspeed_available

    PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: (
        "gloo", DistributedType.MULTI_GPU)
    state = PartialState(timeout=datetime.timedelta(seconds=123))
    import deepspeed

    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    print(json.dumps({"available": is_deepspeed_available(), "type": str(state.distributed_type),
                      "group": [dist.get_backend(), dist.get_rank(), dist.get_world_size()],
                      "processes": state.num_processes, "comm": deepspeed.comm.__name__,
                      "comm_initialized": deepspeed.comm.is_initialized(), "timeout": timeout.total_seconds()}))
"""


def test_accelerates_gpu_start_creates_the_group_through_crews_comm(tmp_path):
    port = free_port("127.0.0.1")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_TORCH_DEVICE": "cpu"}  # where a GPU machine would use cuda:LOCAL_RANK
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(GPU_SHAPED), DEEPSPEED_SHIM], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen == {"available": True, "type": "DistributedType.DEEPSPEED", "group": ["gloo", 0, 1],
                    "processes": 1, "comm": "crew.runtime.comm", "comm_initialized": True, "timeout": 123.0}
    # crew's init_distributed made it, from the launcher's variables (TCP rendezvous, not a world in memory)
    assert f"[crew] initializing gloo process group: rank 0 of 1, master 127.0.0.1:{port}" in proc.stdout
