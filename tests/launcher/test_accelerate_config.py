"""`--config_file`: Accelerate's launch YAML read as crew's options, and real `accelerate` scripts under crew.

The YAML mapping is tested in process (no ranks start). Two jobs run real `accelerate.Accelerator` scripts:
`crew run --num_gpus 2` on this CPU machine with no YAML at all, and seed 002's YAML (adapted to two
loopback ssh nodes) under `crew run --config_file`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import crew, write_script

from crew import cli
from crew.errors import CrewError
from crew.launcher.plan import accelerate as acc
from crew.launcher.node.agent import rank_env
from crew.launcher.plan.env import parse_env_flags
from crew.launcher.transport.protocol import JobSpec, NodeSpec

# Seed 002's `accelerate config` YAML, as the seed wrote it (its hostfile: two 8-GPU machines).
SEED_002 = """\
# accelerate 配置文件
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: ./deepspeed.json
  deepspeed_hostfile: ./hostfile
  deepspeed_multinode_launcher: pdsh
  zero3_init_flag: true
distributed_type: DEEPSPEED
downcast_bf16: 'no'
dynamo_config:
  dynamo_backend: INDUCTOR
machine_rank: 0
main_process_ip: 10.98.115.10
main_process_port: 22
main_training_function: main
num_machines: 2
num_processes: 16
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
SEED_HOSTFILE = "huaweiyun1 slots=8\nhuaweiyun2 slots=8\n"

# The shape of Accelerate's quick tour / examples/nlp_example.py: prepare, backward, gather. Each rank
# also computes the one-process reference (the same model on the whole first global batch) and writes
# what it saw to rank<N>.json.
TRAIN = """
    import copy, json, os, sys
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(16, 1)
    model = torch.nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    xb, yb = next(iter(loader))
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    accelerator.backward(loss)
    grad = torch.cat([p.grad.flatten() for p in accelerator.unwrap_model(model).parameters()])
    losses = accelerator.gather(loss.detach()[None])
    full = 4 * accelerator.num_processes  # the first batch of every rank, together
    torch.nn.functional.mse_loss(reference(x[:full]), y[:full]).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    seen = {"world": accelerator.num_processes, "index": accelerator.process_index,
            "type": str(accelerator.distributed_type), "grad": grad.tolist(), "expected": expected.tolist(),
            "losses": losses.tolist(), "argv": sys.argv[1:],
            "mixed_precision": accelerator.mixed_precision,
            "env": {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}}
    json.dump(seen, open(f"rank{accelerator.process_index}.json", "w"))
    # Release the DDP model before the group goes (as crew's engine does at exit): left to interpreter shutdown,
    # gloo can abort a rank that finished fine once rank 0, which holds the store, is gone (docs/accelerate.md).
    del model, optimizer, loader
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()
"""

needs_accelerate = pytest.mark.skipif(
    not acc._installed("accelerate"), reason="accelerate not installed (the test extra has it)")


def yaml_file(folder: Path, text: str, name: str = "accelerate_config.yaml") -> str:
    (folder / name).write_text(text)
    return name


def applied(*argv: str, command: str = "plan", for_run: bool = False):
    """The parsed options after the config file is applied, and the lines crew said."""
    args = cli.build_parser().parse_args([command, *argv])
    said: list[str] = []
    acc.apply_config_file(args, said.append, for_run)
    return args, said


def env_of(args) -> dict[str, str]:
    return parse_env_flags(args.env)


def plan_json(capsys, *argv: str) -> dict:
    code = cli.main(["plan", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def reads(folder: Path, world: int) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


# --------------------------------------------------------------------------------------------
# The mapping

def test_seed_002_yaml_reads_as_deepspeed_launch_options(here):
    (here / "hostfile").write_text(SEED_HOSTFILE)
    args, said = applied("--config_file", yaml_file(here, SEED_002), "--master_port", "29511")
    assert (args.hostfile, args.num_nodes, args.num_gpus) == ("./hostfile", 2, 8)  # 16 over 2 machines
    assert (args.launcher, args.master_addr, args.master_port) == ("pdsh", "10.98.115.10", 29511)
    assert args.no_local_rank  # accelerate launch passes no --local_rank (its DeepSpeed: --no_local_rank)
    assert env_of(args) == {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "./deepspeed.json",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,deepspeed_hostfile,deepspeed_multinode_launcher,"
                                       "zero3_init_flag"}
    assert said[-1] == ("--config_file accelerate_config.yaml: ignoring keys crew has no use for: "
                        "dynamo_config")
    assert said[0] == ("--config_file accelerate_config.yaml: as --master_addr 10.98.115.10 --no_local_rank "
                       "--hostfile ./hostfile --launcher pdsh --num_gpus 8 --num_nodes 2")  # not --master_port: given


def test_seed_002_port_22_is_refused_unless_a_flag_overrides_it(here, capsys):
    (here / "hostfile").write_text(SEED_HOSTFILE)
    name = yaml_file(here, SEED_002)
    assert cli.main(["plan", "--config_file", name]) == 2
    err = capsys.readouterr().err
    assert "accelerate_config.yaml: main_process_port: 22 is ssh's port" in err and "--master_port" in err
    data = plan_json(capsys, "--config_file", name, "--master_port", "29511")
    assert data["world_size"] == 16 and data["launcher"] == "pdsh"
    assert [n["host"] for n in data["nodes"]] == ["huaweiyun1", "huaweiyun2"]
    assert data["env"]["ACCELERATE_USE_DEEPSPEED"] == "true"


def test_deepspeed_notes_what_an_accelerate_script_lacks(here, monkeypatch):
    (here / "hostfile").write_text(SEED_HOSTFILE)
    (here / "deepspeed.json").write_text("{}")
    name = yaml_file(here, SEED_002)
    run = ("--config_file", name, "--master_port", "29511")
    monkeypatch.setattr(acc, "_installed", lambda package: package == "transformers")  # DeepSpeed missing
    said = applied(*run, command="run", for_run=True)[1]
    assert said[-1].endswith("distributed_type: DEEPSPEED: an Accelerate script needs deepspeed and transformers "
                             "on every node; not installed here: deepspeed (pass --as_deepspeed to train on crew's "
                             "engine as DeepSpeed, or use MULTI_GPU)")
    args, said = applied(*run, "--as_deepspeed", command="run", for_run=True)
    assert not any("an Accelerate script" in line for line in said)  # crew's engine stands in for DeepSpeed
    assert env_of(args)["ACCELERATE_USE_DEEPSPEED"] == "true"
    monkeypatch.setattr(acc, "_installed", lambda package: False)
    said = applied(*run, command="run", for_run=True)[1]
    assert "not installed here: deepspeed, transformers (pass --as_deepspeed" in said[-1]
    said = applied(*run, "--as_deepspeed", command="run", for_run=True)[1]
    assert said[-1].endswith("an Accelerate script needs transformers on every node (Accelerate's DeepSpeed plugin "
                             "builds transformers' HfDeepSpeedConfig, also on crew's engine); not installed here: "
                             "transformers (pip install transformers, or use MULTI_GPU)")
    monkeypatch.setattr(acc, "_installed", lambda package: package == "deepspeed")
    said = applied(*run, command="run", for_run=True)[1]
    assert said[-1].endswith("not installed here: transformers (or use MULTI_GPU)")
    (here / "train.py").write_text("import deepspeed\n")  # a script on DeepSpeed's engine: no note
    said = applied("--config_file", name, "--master_port", "29511", "train.py", command="run", for_run=True)[1]
    assert not any("an Accelerate script" in line for line in said)
    (here / "deepspeed.json").unlink()
    with pytest.raises(CrewError, match="deepspeed_config.deepspeed_config_file: ./deepspeed.json not found"):
        applied("--config_file", name, "--master_port", "29511", command="run", for_run=True)


def test_command_line_options_win_over_the_yaml(here):
    (here / "hosts").write_text("a slots=2\nb slots=2\nc slots=2\n")
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_machines: 3\nnum_processes: 6\n"
                     "main_process_ip: 10.0.0.1\nmain_process_port: 29600\nmixed_precision: bf16\n"
                     "deepspeed_config:\n  deepspeed_hostfile: hosts\n  deepspeed_multinode_launcher: pdsh\n")
    args, _ = applied("--config_file", name, "--num_gpus", "1", "--launcher", "ssh", "--master_addr", "m",
                      "--env", "ACCELERATE_MIXED_PRECISION=no")
    assert (args.num_gpus, args.launcher, args.master_addr) == (1, "ssh", "m")
    assert (args.num_nodes, args.master_port, args.hostfile) == (3, 29600, "hosts")  # still the YAML's
    assert env_of(args)["ACCELERATE_MIXED_PRECISION"] == "no"  # the user's --env comes last: it wins


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "mvapich"])
def test_the_yamls_mpi_launcher_is_crews_mpi_runner(here, launcher):
    (here / "hosts").write_text("a slots=2\nb slots=2\n")
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 4\n"
                     f"deepspeed_config:\n  deepspeed_hostfile: hosts\n  deepspeed_multinode_launcher: {launcher}\n")
    args, _ = applied("--config_file", name)
    assert (args.launcher, args.hostfile, args.num_nodes, args.num_gpus) == (launcher, "hosts", 2, 2)
    without_hostfile = yaml_file(here, "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 4\n"
                                 f"deepspeed_config:\n  deepspeed_multinode_launcher: {launcher}\n", "b.yaml")
    with pytest.raises(CrewError, match=f"deepspeed_multinode_launcher: {launcher} starts the machines"):
        applied("--config_file", without_hostfile)


def test_crew_env_defaults_win_over_the_yaml(here, monkeypatch):
    monkeypatch.setenv("CREW_NUM_GPUS", "1")
    args, _ = applied("--config_file", yaml_file(here, "distributed_type: MULTI_CPU\nnum_processes: 4\n"))
    assert args.num_gpus == 1


def test_plan_json_shows_the_world_the_yaml_gives(here, capsys):
    name = yaml_file(here, "distributed_type: MULTI_CPU\nnum_processes: 3\nuse_cpu: true\n"
                     "deepspeed_config:\n  gradient_accumulation_steps: 4\n")
    data = plan_json(capsys, "--config_file", name, "train.py")
    assert data["world_size"] == 3 and data["launcher"] == "local"
    assert data["env"]["ACCELERATE_USE_CPU"] == "true"
    assert data["env"]["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert "--local_rank=0" not in data["nodes"][0]["command"]


@pytest.mark.parametrize("text, env", [
    ("mixed_precision: fp16\n", {"ACCELERATE_MIXED_PRECISION": "fp16"}),
    ("mixed_precision: no\n", {"ACCELERATE_MIXED_PRECISION": "no"}),  # unquoted: YAML's false
    ("fp16: true\n", {"ACCELERATE_MIXED_PRECISION": "fp16"}),  # the old spelling
    ("gradient_accumulation_steps: 2\n", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}),
    ("use_cpu: true\ndebug: true\nenable_cpu_affinity: true\n",
     {"ACCELERATE_USE_CPU": "true", "ACCELERATE_DEBUG_MODE": "true", "ACCELERATE_CPU_AFFINITY": "1"}),
    ("use_cpu: false\n", {}),  # the agent decides per node (test_rank_env_tells_accelerate_to_use_the_cpu)
])
def test_yaml_keys_to_accelerate_env(text, env):
    config = acc.parse_config("a.yaml", acc.yaml.safe_load("distributed_type: MULTI_GPU\n" + text))
    assert config.env == env and config.ignored == []


def test_deepspeed_block_to_accelerate_env():
    config = acc.parse_config("a.yaml", acc.yaml.safe_load(
        "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 2\n"
        "  gradient_accumulation_steps: 3\n  gradient_clipping: 1.0\n  offload_optimizer_device: cpu\n"
        "  offload_param_device: none\n  zero3_init_flag: false\n  zero3_save_16bit_model: true\n"))
    assert config.deepspeed and config.env == {
        "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3",
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_GRADIENT_CLIPPING": "1.0",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
        "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,gradient_accumulation_steps,gradient_clipping,"
                                       "offload_optimizer_device,offload_param_device,zero3_init_flag,"
                                       "zero3_save_16bit_model,mixed_precision"}


def test_deepspeed_on_the_cpu_leaves_deepspeed_out_and_says_so():
    config = acc.parse_config("a.yaml", acc.yaml.safe_load(SEED_002.replace("use_cpu: false", "use_cpu: true")))
    assert not config.deepspeed
    assert config.env == {"ACCELERATE_USE_CPU": "true"}
    assert config.notes == ["use_cpu: true: Accelerate trains with DDP on the CPU, where DeepSpeed is not used; "
                            "not set: deepspeed_config_file, zero3_init_flag (with --as_deepspeed crew's engine "
                            "trains with them on the CPU)"]


def test_as_deepspeed_keeps_deepspeed_on_the_cpu(here):
    """crew's engine trains on the CPU: under --as_deepspeed use_cpu does not drop the DeepSpeed variables, and
    ACCELERATE_USE_CPU (with which Accelerate would ignore them) is not set."""
    (here / "hostfile").write_text(SEED_HOSTFILE)
    name = yaml_file(here, SEED_002.replace("use_cpu: false", "use_cpu: true"))
    args, said = applied("--config_file", name, "--master_port", "29511", "--as_deepspeed")
    assert env_of(args)["ACCELERATE_USE_DEEPSPEED"] == "true" and "ACCELERATE_USE_CPU" not in env_of(args)
    assert said[-1].endswith("ACCELERATE_USE_CPU is not set, as with it Accelerate would drop the DeepSpeed config")
    config = acc.parse_config("a.yaml", acc.yaml.safe_load((here / name).read_text()), as_deepspeed=True)
    assert config.deepspeed and config.as_deepspeed
    assert config.env == {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "./deepspeed.json",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,deepspeed_hostfile,deepspeed_multinode_launcher,"
                                       "zero3_init_flag"}
    assert config.notes == ["use_cpu: true: under --as_deepspeed Accelerate trains with DeepSpeed on crew's engine "
                            "(on the CPU where a machine has no GPU); ACCELERATE_USE_CPU is not set, as with it "
                            "Accelerate would drop the DeepSpeed config"]
    multi_cpu = acc.parse_config("a.yaml", {"distributed_type": "MULTI_CPU", "use_cpu": True}, as_deepspeed=True)
    assert multi_cpu.env == {"ACCELERATE_USE_CPU": "true"} and not multi_cpu.deepspeed  # no DeepSpeed asked for


def test_filters_replace_num_gpus_as_in_deepspeed(here):
    (here / "hosts").write_text("a slots=2\nb slots=2\n")
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 4\n"
                     "deepspeed_config:\n  deepspeed_hostfile: hosts\n  deepspeed_inclusion_filter: a:1@b\n")
    args, _ = applied("--config_file", name)
    assert (args.include, args.num_gpus, args.num_nodes) == ("a:1@b", None, None)
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_machines: 2\ndeepspeed_config:\n"
                     "  deepspeed_hostfile: hosts\n  deepspeed_exclusion_filter: a\n", "x.yaml")
    assert applied("--config_file", name)[0].exclude == "a"


def test_gpu_ids_choose_this_machines_devices(here, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: 1,3\n")
    data = plan_json(capsys, "--config_file", name)
    assert [(n["host"], n["slots"]) for n in data["nodes"]] == [("localhost", [1, 3])]
    yaml_file(here, "distributed_type: MULTI_GPU\nnum_processes: 3\ngpu_ids: 1,3\n")
    with pytest.raises(CrewError, match="gpu_ids: 1,3 names 2 device"):
        applied("--config_file", name)


def test_one_machine_runs_here_whatever_the_hostfile_says(here):
    (here / "hosts").write_text("a slots=2\n")
    args, said = applied("--config_file", yaml_file(here, "distributed_type: MULTI_CPU\nnum_processes: 2\n"
                         "deepspeed_config:\n  deepspeed_hostfile: hosts\n"))
    assert (args.hostfile, args.launcher, args.num_gpus) == (None, None, 2)
    assert said[-1].endswith("ignoring keys crew has no use for: deepspeed_config.deepspeed_hostfile "
                             "(num_machines is 1)")


def test_standard_launcher_runs_each_machine_by_hand(here, capsys):
    name = yaml_file(here, "distributed_type: MULTI_CPU\nnum_machines: 2\nnum_processes: 4\nmachine_rank: 1\n"
                     "main_process_ip: 10.0.0.1\n")
    args, _ = applied("--config_file", name)
    assert (args.launcher, args.node_rank, args.master_port) == ("standalone", 1, acc.ACCELERATE_PORT)
    data = plan_json(capsys, "--config_file", name)
    assert data["world_size"] == 4 and data["master_addr"] == "10.0.0.1"
    assert [(n["host"], n["ranks"]) for n in data["nodes"]][0] == ("10.0.0.1", [0, 1])
    assert data["nodes"][1]["ranks"] == [2, 3]


@pytest.mark.parametrize("text, words", [
    ("distributed_type: MULTI_CPU\nnum_machines: 2\nnum_processes: 4\n", "main_process_ip: needed"),
    ("distributed_type: MULTI_CPU\nnum_machines: 2\nmain_process_ip: m\n", "num_processes: needed"),
    ("distributed_type: MULTI_CPU\nnum_machines: 2\nnum_processes: 4\nmain_process_ip: m\n"
     "deepspeed_config:\n  deepspeed_multinode_launcher: pdsh\n", "starts the machines of deepspeed_hostfile"),
])
def test_several_machines_need_what_accelerate_needs(here, text, words):
    with pytest.raises(CrewError, match=words):
        applied("--config_file", yaml_file(here, text))


@pytest.mark.parametrize("text, words", [
    ("- a\n- b\n", "a.yaml: expected Accelerate's launch config, a mapping"),
    ("num_processes: [\n", "a.yaml is not valid YAML"),
    ("num_process: 2\ndistributed_type: NO\n", "a.yaml: num_process: not a key of Accelerate's launch config. "
                                               "Did you mean 'num_processes'?"),
    ("num_processes: 2\n", "a.yaml: distributed_type: missing"),
    ("distributed_type: FSDP\n", "a.yaml: distributed_type: FSDP: crew does not set up Accelerate's FSDP"),
    ("distributed_type: MULTIGPU\n", "a.yaml: distributed_type: unknown value 'MULTIGPU'. .*Did you mean MULTI_GPU"),
    ("distributed_type: NO\ncompute_environment: AMAZON_SAGEMAKER\n", "a.yaml: compute_environment:"),
    ("distributed_type: NO\nnum_machines: two\n", "a.yaml: num_machines: expected a whole number .* got 'two'"),
    ("distributed_type: NO\nnum_processes: 3\nnum_machines: 2\n", "a.yaml: num_processes: 3 processes do not "
                                                                  "divide over num_machines 2"),
    ("distributed_type: MULTI_CPU\nmachine_rank: 2\nnum_machines: 2\n", "a.yaml: machine_rank: .* at most 1"),
    ("distributed_type: NO\nuse_cpu: maybe\n", "a.yaml: use_cpu: expected true or false, got 'maybe'"),
    ("distributed_type: NO\nmixed_precision: fp32\n", "a.yaml: mixed_precision: unknown value 'fp32'"),
    ("distributed_type: NO\nmain_process_port: 70000\n", "a.yaml: main_process_port: .* at most 65535"),
    ("distributed_type: NO\ndeepspeed_config: 3\n", "a.yaml: deepspeed_config: expected a mapping"),
    ("distributed_type: NO\nnum_machines: 2\nnum_processes: 2\ndeepspeed_config:\n"
     "  deepspeed_multinode_launcher: mpi\n", "a.yaml: deepspeed_multinode_launcher: unknown launcher 'mpi'"),
    ("distributed_type: MULTI_CPU\nnum_machines: 2\ndeepspeed_config:\n  deepspeed_inclusion_filter: a\n"
     "  deepspeed_exclusion_filter: b\n", "a.yaml: deepspeed_config: .*both set"),
    ("distributed_type: DEEPSPEED\nparallelism_config: 2\n", "a.yaml: parallelism_config: expected a mapping"),
    ("distributed_type: DEEPSPEED\nparallelism_config:\n  parallelism_config_sp_size: two\n",
     "a.yaml: parallelism_config.parallelism_config_sp_size: expected a whole number of at least 1, got 'two'"),
    ("distributed_type: MULTI_GPU\nparallelism_config:\n  parallelism_config_dp_shard_size: 0\n",
     "a.yaml: parallelism_config.parallelism_config_dp_shard_size: expected a whole number of at least 1, got 0"),
    ("distributed_type: DEEPSPEED\nparallelism_config:\n  sp_size: 2\n",  # Accelerate would leave SP off
     "a.yaml: parallelism_config.sp_size: not a key of Accelerate's parallelism_config. "
     "Did you mean 'parallelism_config_sp_size'?"),
    ("distributed_type: DEEPSPEED\nparallelism_config:\n  parallelism_config_sp_backend: torch\n",
     "a.yaml: parallelism_config.parallelism_config_sp_backend: unknown value 'torch'. Use deepspeed."),
    ("distributed_type: DEEPSPEED\nparallelism_config:\n  parallelism_config_sp_size: 2\n"
     "  parallelism_config_sp_attn_implementation: eager\n",
     "parallelism_config_sp_attn_implementation: 'eager' cannot run under sequence parallelism. Use one of"),
    ("distributed_type: DEEPSPEED\nparallelism_config:\n  parallelism_config_sp_size: 2\n"
     "  parallelism_config_sp_seq_length_is_variable: false\n",
     "parallelism_config_sp_seq_length_is_variable: false needs the fixed length of every batch. Set "
     "parallelism_config_sp_seq_length"),
    ("distributed_type: DEEPSPEED\nparallelism_config:\n  parallelism_config_sp_size: 2\n"
     "  parallelism_config_cp_size: 2\n", "a.yaml: parallelism_config: cp_size 2 and sp_size 2: .*exclude"),
    ("distributed_type: MULTI_GPU\nparallelism_config:\n  parallelism_config_tp_size: 2\n"
     "  parallelism_config_dp_replicate_size: 2\n", "a.yaml: parallelism_config: .*FSDP sharding only"),
])
def test_errors_name_the_file_the_key_and_the_fix(here, text, words):
    yaml_file(here, text, "a.yaml")
    with pytest.raises(CrewError, match=words):
        applied("--config_file", "a.yaml")


def test_missing_file_is_an_error(here, capsys):
    assert cli.main(["plan", "--config_file", "nope.yaml"]) == 2
    assert "--config_file nope.yaml: no such file" in capsys.readouterr().err


def test_keys_with_no_effect_are_named_in_one_line():
    config = acc.parse_config("a.yaml", acc.yaml.safe_load(
        "distributed_type: MULTI_GPU\nnum_machines: 2\ngpu_ids: 0,1\ndynamo_config:\n  dynamo_backend: NO\n"
        "rdzv_backend: c10d\nsame_network: false\ntpu_env: [X]\ndeepspeed_config:\n  zero_stage: 2\n  foo: 1\n"))
    assert config.ignored == ["gpu_ids (num_machines > 1)", "deepspeed_config.zero_stage", "rdzv_backend",
                              "tpu_env", "deepspeed_config.foo"]


@pytest.mark.parametrize("gpu, as_deepspeed, base, expected, on_cpu", [
    (False, False, {}, "true", None),
    (False, False, {"ACCELERATE_USE_CPU": "false"}, "false", None),  # the user's own wins
    (True, False, {}, None, None),  # never where there is a GPU
    (False, True, {}, None, "1"),  # --as_deepspeed: crew's rank site gives Accelerate gloo, DeepSpeed config kept
    (True, True, {}, None, None),
])
def test_rank_env_tells_accelerate_to_use_the_cpu(monkeypatch, gpu, as_deepspeed, base, expected, on_cpu):
    monkeypatch.setattr("crew.launcher.node.agent.has_gpu", lambda: gpu)
    job = JobSpec(job_id="j", nodes=(NodeSpec("n0", (0, 1), (0, 1)),), master_addr="m", master_port=1,
                  program=("t.py",), cwd="/", env={}, as_deepspeed=as_deepspeed)
    env = rank_env(job, 0, 0, base)
    assert (env.get("ACCELERATE_USE_CPU"), env.get("CREW_DEEPSPEED_ON_CPU")) == (expected, on_cpu)


# --------------------------------------------------------------------------------------------
# parallelism_config: Accelerate's ParallelismConfig in every rank, e.g. DeepSpeed's Ulysses SP

# accelerate's DeepSpeed Ulysses SP check, as a launch YAML (its test passes --parallelism_config_sp_backend
# deepspeed --parallelism_config_sp_size 2 to `accelerate launch --use_deepspeed`)
SP_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 2
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
parallelism_config:
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_size: 2
"""
SIZES_1 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "1",
           "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_CP_BACKEND": "torch",
           "PARALLELISM_CONFIG_SP_SIZE": "1", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
SP_2 = {**SIZES_1, "PARALLELISM_CONFIG_SP_SIZE": "2", "PARALLELISM_CONFIG_SP_SEQ_LENGTH": "None",
        "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE": "True", "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa"}
# parallelism_config blocks -> what every rank gets, with the launcher's defaults for the keys left out
PARALLELISM_CASES = {
    "sp": (SP_YAML.split("parallelism_config:\n")[1], SP_2),
    "sp fixed length": ("  parallelism_config_sp_size: 2\n  parallelism_config_sp_seq_length: 256\n"
                        "  parallelism_config_sp_seq_length_is_variable: false\n"
                        "  parallelism_config_sp_attn_implementation: flash_attention_2\n",
                        {**SP_2, "PARALLELISM_CONFIG_SP_SEQ_LENGTH": "256",
                         "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE": "False",
                         "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "flash_attention_2"}),
    "cp": ("  parallelism_config_dp_shard_size: 2\n  parallelism_config_cp_size: 2\n",
           {**SIZES_1, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "2",
            "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "allgather"}),
    "sizes of 1": ("  parallelism_config_tp_size: 1\n", SIZES_1),  # any key turns it on, as in Accelerate
}
PARALLELISM_TYPES = ("DEEPSPEED", "MULTI_GPU")


def parallelism_yaml(kind: str, block: str) -> str:
    return SP_YAML.replace("DEEPSPEED", kind).split("parallelism_config:\n")[0] + "parallelism_config:\n" + block


def parallelism_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if "PARALLELISM" in k}


def test_parallelism_config_reaches_the_ranks(here, capsys):
    name = yaml_file(here, SP_YAML)
    args, said = applied("--config_file", name, "--as_deepspeed", command="run")
    assert parallelism_env(env_of(args)) == SP_2
    assert env_of(args)["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert not any("ignoring" in line for line in said)
    assert parallelism_env(plan_json(capsys, "--config_file", name, "train.py")["env"]) == SP_2


@pytest.mark.parametrize("kind", PARALLELISM_TYPES)
@pytest.mark.parametrize("case", PARALLELISM_CASES)
def test_parallelism_config_to_accelerate_env(kind, case):
    block, env = PARALLELISM_CASES[case]
    config = acc.parse_config("a.yaml", acc.yaml.safe_load(parallelism_yaml(kind, block)))
    assert parallelism_env(config.env) == env
    assert not any("parallelism" in name for name in config.ignored)


def accelerate_launch_env(path: str) -> dict[str, str]:
    """What `accelerate launch --config_file path` gives its ranks: Accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch

    args = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "t.py"]))[0]
    if not args.use_deepspeed:
        return launch.prepare_multi_gpu_env(args)
    args.deepspeed_fields_from_accelerate_config = ""
    return launch.prepare_deepspeed_cmd_env(args)[1]


@needs_accelerate
@pytest.mark.parametrize("kind", PARALLELISM_TYPES)
@pytest.mark.parametrize("case", PARALLELISM_CASES)
def test_parallelism_env_is_accelerate_launchs(here, kind, case):
    text = parallelism_yaml(kind, PARALLELISM_CASES[case][0])
    config = acc.parse_config("a.yaml", acc.yaml.safe_load(text))
    assert parallelism_env(config.env) == parallelism_env(accelerate_launch_env(yaml_file(here, text)))


@needs_accelerate
@pytest.mark.parametrize("case, seq_length, variable", [("sp", None, True), ("sp fixed length", 256, False)])
def test_the_ranks_parallelism_config_is_sp_2_on_deepspeed(monkeypatch, case, seq_length, variable):
    """Accelerator() without a parallelism_config builds ParallelismConfig() when ACCELERATE_USE_PARALLELISM_CONFIG
    is true (accelerator.py), which reads PARALLELISM_CONFIG_*, its sp_handler the SP_* ones."""
    from accelerate.parallelism_config import ParallelismConfig

    config = acc.parse_config("a.yaml", acc.yaml.safe_load(parallelism_yaml("DEEPSPEED", PARALLELISM_CASES[case][0])))
    for name, value in config.env.items():
        monkeypatch.setenv(name, value)
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"].lower() == "true"
    parallelism = ParallelismConfig()
    assert (parallelism.sp_size, parallelism.sp_backend, parallelism.sp_enabled) == (2, "deepspeed", True)
    assert (parallelism.dp_replicate_size, parallelism.dp_shard_size, parallelism.tp_size, parallelism.cp_size) == \
        (1, 1, 1, 1)
    handler = parallelism.sp_handler
    assert (handler.sp_seq_length, handler.sp_seq_length_is_variable) == (seq_length, variable)


@pytest.mark.parametrize("text, ignored", [
    ("distributed_type: MULTI_CPU\n", ["parallelism_config (distributed_type MULTI_CPU)"]),  # its simple launcher
    ("distributed_type: NO\n", ["parallelism_config (distributed_type NO)"]),
    ("distributed_type: DEEPSPEED\nparallelism_config: {}\n", []),  # empty: off, as in Accelerate
    ("distributed_type: DEEPSPEED\nparallelism_config:\n", []),
])
def test_parallelism_config_only_where_accelerate_launch_passes_it(text, ignored):
    if "parallelism_config" not in text:
        text += "parallelism_config:\n  parallelism_config_sp_size: 2\n"
    config = acc.parse_config("a.yaml", acc.yaml.safe_load(text))
    assert parallelism_env(config.env) == {} and config.ignored == ignored


# --------------------------------------------------------------------------------------------
# Real accelerate scripts

def check_training(seen: list[dict]) -> None:
    """World 2 everywhere, gradients all-reduced (equal on both ranks) and equal to one process's over the
    whole global batch."""
    assert [s["world"] for s in seen] == [2, 2] and [s["index"] for s in seen] == [0, 1]
    assert {s["type"] for s in seen} == {"DistributedType.MULTI_CPU"}
    assert seen[0]["grad"] == seen[1]["grad"]
    assert seen[0]["grad"] == pytest.approx(seen[0]["expected"], rel=1e-5, abs=1e-6)
    assert seen[0]["losses"] == seen[1]["losses"] and len(seen[0]["losses"]) == 2


@needs_accelerate
def test_accelerate_script_on_two_cpu_ranks_without_a_config(job_dir):
    write_script(job_dir, "train.py", TRAIN)
    result = crew("run", "--num_gpus", "2", "train.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = reads(job_dir, 2)
    check_training(seen)
    assert seen[0]["env"]["ACCELERATE_USE_CPU"] == "true"  # the agent's: this node has no GPU


@needs_accelerate
def test_deepspeed_yaml_without_deepspeed_stops_at_accelerator(job_dir):
    """What an Accelerate script does under a DEEPSPEED config where DeepSpeed is not installed: crew says
    so before the start, and the rank stops at `Accelerator()` with Accelerate's own one-line ImportError."""
    if acc._installed("deepspeed"):
        pytest.skip("deepspeed is installed here")
    (job_dir / "ds.json").write_text('{"zero_optimization": {"stage": 2}}\n')
    (job_dir / "ds.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 1\n"
                                     "deepspeed_config:\n  deepspeed_config_file: ds.json\n")
    write_script(job_dir, "train.py", TRAIN)
    result = crew("run", "--config_file", "ds.yaml", "train.py", cwd=job_dir)
    assert result.code == 1
    assert "ds.yaml: distributed_type: DEEPSPEED: an Accelerate script needs deepspeed" in result.err
    assert "ImportError: DeepSpeed is not installed" in result.err


@needs_accelerate
def test_seed_002_yaml_on_two_loopback_nodes(cluster, job_dir):
    """Seed 002's YAML with what a loopback test must change: the hostfile's machines (two sshd nodes,
    one process each: num_processes 2), main_process_ip (the first node), and use_cpu: true (no GPUs).
    Its main_process_port 22 stays, overridden on the command line as a user would."""
    text = (SEED_002.replace("10.98.115.10", "127.0.0.2").replace("num_processes: 16", "num_processes: 2")
            .replace("use_cpu: false", "use_cpu: true"))
    launcher = "pdsh" if shutil.which("pdsh") else "ssh"
    (job_dir / "accelerate_config.yaml").write_text(text.replace("launcher: pdsh", f"launcher: {launcher}"))
    (job_dir / "hostfile").write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    (job_dir / "deepspeed.json").write_text('{"zero_optimization": {"stage": 3}}\n')
    write_script(job_dir, "train.py", TRAIN)
    port = str(json.loads(crew("plan", "--json", cwd=job_dir).out)["master_port"])  # a free one
    result = crew("run", "--ssh_args", cluster.ssh_args, "--config_file", "accelerate_config.yaml",
                  "--master_port", port, "train.py", cwd=job_dir)
    assert result.code == 0, result.err
    assert f"launcher {launcher}" in result.err and "master 127.0.0.2" in result.err
    assert "ignoring keys crew has no use for: dynamo_config" in result.err
    assert "DeepSpeed is not used; not set: deepspeed_config_file, zero3_init_flag" in result.err
    seen = reads(job_dir, 2)
    check_training(seen)
    assert [s["argv"] for s in seen] == [[], []]  # no --local_rank, as accelerate launch
    assert seen[1]["env"] == {"ACCELERATE_USE_CPU": "true"}


def test_the_slurm_launcher_takes_the_allocations_nodes(here):
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 8\n"
                     "deepspeed_config:\n  deepspeed_multinode_launcher: slurm\n")
    args, _ = applied("--config_file", name)
    assert (args.launcher, args.num_nodes, args.num_gpus, args.node_rank) == ("slurm", 2, 4, None)
    assert not getattr(args, "machines", None)  # no standalone node list: Slurm says which nodes


def test_bad_gpu_ids_and_a_missing_deepspeed_hostfile_name_their_keys(here):
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: a,b\n")
    with pytest.raises(CrewError, match=r"accelerate_config.yaml: gpu_ids: 'a,b' is not device ids separated"):
        applied("--config_file", name)
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_processes: 1\ngpu_ids: 0\n")
    assert applied("--config_file", name)[0].include == "localhost:0"  # 0 is a device, not "unset"
    name = yaml_file(here, "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 2\n"
                     "deepspeed_config:\n  deepspeed_hostfile: nohosts\n")
    with pytest.raises(CrewError, match=r"accelerate_config.yaml: deepspeed_config.deepspeed_hostfile: nohosts "
                                        r"not found .*Fix the path in the YAML, or pass --hostfile"):
        applied("--config_file", name)
