"""`crew config`, answered on stdin as a user would type: the files it writes read back with crew's own
readers (hostfile, DeepSpeed config) and as YAML with Accelerate's keys; bad answers asked again; end of
input, --yes, files not replaced; the doctor over two loopback ssh nodes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from conftest import crew_command

from crew.launcher.plan.hostfile import Host, read_hostfile
from crew.runtime.config import Config

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # the same questions and defaults on a machine with GPUs
ACCELERATE_KEYS = {"compute_environment", "distributed_type", "num_machines", "num_processes", "machine_rank",
                   "main_process_ip", "main_process_port", "mixed_precision", "use_cpu", "gpu_ids",
                   "deepspeed_config"}


def config(folder: Path, *args: str, answers: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(crew_command("config", *args), input=answers, cwd=folder, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **CPU_ONLY})


def read_configs(folder: Path, ds_name: str = "ds_config.json") -> tuple[dict, dict]:
    launch = yaml.safe_load((folder / "crew_accelerate.yaml").read_text())
    assert set(launch) <= ACCELERATE_KEYS and launch["compute_environment"] == "LOCAL_MACHINE"
    assert launch["machine_rank"] == 0
    ds = json.loads((folder / ds_name).read_text())
    return launch, ds


def test_this_machine_with_every_default(tmp_path):
    result = config(tmp_path, answers="\n" * 20)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crew_accelerate.yaml", "ds_config.json"]
    launch, ds = read_configs(tmp_path)
    assert launch == {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_machines": 1,
                      "num_processes": 2, "machine_rank": 0, "use_cpu": True}  # on the CPU: no DeepSpeed keys
    resolved = Config.from_dict(ds, world_size=launch["num_processes"])
    assert (resolved.train_batch_size, resolved.zero_optimization.stage) == (8, 2)
    assert "CPU processes to start [2]: " in result.stdout
    assert "accelerate launch --config_file crew_accelerate.yaml train.py" in result.stdout
    assert ("crew run --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json --save_dir checkpoints"
            in result.stdout)
    plan = subprocess.run(crew_command("plan", "--config_file", "crew_accelerate.yaml", "--json"), cwd=tmp_path,
                          capture_output=True, text=True)
    assert plan.returncode == 0 and json.loads(plan.stdout)["world_size"] == 2, plan.stderr
    assert "ignoring keys" not in plan.stderr  # it writes nothing crew would not use


def test_several_machines_bad_answers_asked_again(tmp_path):
    answers = ["2", "hosts", "y", "2",
               "node-a", "2222", "two", "2", "0,1,2", "1,3",  # slots not a number; 3 ids for 2 slots
               "node-a", "node-b", "70000", "", "", "",  # the same host twice; a port out of range
               "", "29501", "3", "bf16", "2", "y", "", "8", "run.py", "ckpt"]
    result = config(tmp_path, "--no_doctor", answers="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "'two' is not a whole number 1 or more. Try again." in result.stdout
    assert "gpu=0,1,2 lists 3 device(s) but slots=2" in result.stdout
    assert "node-a is already listed" in result.stdout
    assert "'70000' is not a port number (1-65535) or 'default'" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert read_hostfile(tmp_path / "hosts") == [Host("node-a", (1, 3), 2222), Host("node-b", (0, 1), None)]
    launch, ds = read_configs(tmp_path)
    assert launch["distributed_type"] == "DEEPSPEED" and "mixed_precision" not in launch  # it is in the JSON
    assert (launch["num_machines"], launch["num_processes"], launch["main_process_port"]) == (2, 4, 29501)
    assert launch["deepspeed_config"] == {"deepspeed_config_file": "ds_config.json", "deepspeed_hostfile": "hosts"}
    assert ds == {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    assert Config.from_dict(ds, world_size=4).train_batch_size == 64
    assert ("crew run -H hosts --master_port 29501 run.py --deepspeed --deepspeed_config ds_config.json --save_dir "
            "ckpt") in result.stdout
    assert "crew run --config_file crew_accelerate.yaml run.py" in result.stdout
    assert "(accelerate launch cannot read this hostfile: ssh ports and GPU ids" in result.stdout
    # the launch config it wrote is the world crew runs: Accelerate's format, read by `crew run --config_file`
    plan = subprocess.run(crew_command("plan", "--config_file", "crew_accelerate.yaml", "--json"), cwd=tmp_path,
                          capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    world = json.loads(plan.stdout)
    assert (world["world_size"], world["master_port"], world["launcher"]) == (4, 29501, "ssh")  # a port per host
    assert [(n["host"], n["ssh_port"], n["slots"]) for n in world["nodes"]] == [("node-a", 2222, [1, 3]),
                                                                               ("node-b", None, [0, 1])]


def test_end_of_input_writes_nothing(tmp_path):
    result = config(tmp_path, answers="2\nhosts\n")
    assert result.returncode == 1
    assert "(end of input). Nothing written." in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_yes_takes_defaults_and_flags(tmp_path):
    result = config(tmp_path, "--yes", "--num_gpus", "3", "--zero_stage", "1", "--precision", "fp16",
                    "--output_dir", "out")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("\ncrew config: wrote out/ds_config.json, out/crew_accelerate.yaml")
    launch = yaml.safe_load((tmp_path / "out/crew_accelerate.yaml").read_text())
    assert launch["num_processes"] == 3 and "deepspeed_config" not in launch  # CPU: Accelerate has no DeepSpeed
    assert "--deepspeed_config out/ds_config.json" in result.stdout
    ds = json.loads((tmp_path / "out/ds_config.json").read_text())
    assert ds["zero_optimization"] == {"stage": 1} and ds["fp16"] == {"enabled": True}


def test_existing_files_are_not_replaced_without_asking(tmp_path):
    assert config(tmp_path, "--yes").returncode == 0
    (tmp_path / "ds_config.json").write_text("{}\n")
    refused = config(tmp_path, "--yes")
    assert refused.returncode == 1
    assert "ds_config.json, crew_accelerate.yaml already exist(s)" in refused.stderr
    assert "--force" in refused.stderr and (tmp_path / "ds_config.json").read_text() == "{}\n"
    kept = config(tmp_path, answers="\n" * 12 + "n\n")  # every default, then: replace ds_config.json? no
    assert kept.returncode == 1 and "kept ds_config.json" in kept.stderr
    assert (tmp_path / "ds_config.json").read_text() == "{}\n"
    assert config(tmp_path, "--yes", "--force").returncode == 0
    assert json.loads((tmp_path / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"] == 4


def test_doctor_checks_the_machines_of_an_existing_hostfile(make_cluster, tmp_path):
    cluster = make_cluster()
    hostfile = cluster.hostfile(slots=1)
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text("print('hello')\n")
    result = config(job, "--yes", "--hostfile", str(hostfile), "--ssh_args", cluster.ssh_args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "crew doctor: 2 node(s), launcher ssh" in result.stdout
    assert "crew config: crew doctor found no problem." in result.stdout
    assert f"--ssh_args '{cluster.ssh_args}' train.py" in result.stdout
    launch, _ = read_configs(job)
    assert launch["deepspeed_config"]["deepspeed_hostfile"] == str(hostfile)
    assert (launch["num_machines"], launch["num_processes"]) == (2, 2)
    assert not (job / "hostfile").exists()


def test_an_output_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "out").write_text("")
    result = config(tmp_path, "--yes", "--output_dir", "out")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "out is a file, so out/ds_config.json cannot be written under it; choose another --output_dir" in (
        result.stdout + result.stderr)


def test_a_bad_flag_value_is_named():
    result = subprocess.run(crew_command("config", "--yes", "--num_gpus", "0"), capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr == (
        "crew config: error: --num_gpus: '0' is not a whole number 1 or more. See 'crew config --help'.\n")
