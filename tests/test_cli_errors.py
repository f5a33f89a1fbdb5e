"""`crew`'s own errors come early and once: a bad command line in one line (crew.cliparser), a missing
script or a DeepSpeed config that cannot work found before anything starts (crew.precheck)."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
from conftest import crew, write_script

from crew import cli, precheck

USES_CREW = """
    import crew
    open("ran", "w").close()
"""


def main_error(capsys, *argv: str) -> str:
    """`crew ARGV` in this process, which must refuse it with exit code 2; its stderr."""
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


# -- the command line ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, line", [
    (["run", "--master_port", "99999", "train.py"],
     "crew run: error: --master_port: '99999' is not a port number (1-65535). See 'crew run --help'."),
    (["run", "--hostfil", "hosts", "train.py"],
     "crew run: error: unknown option --hostfil; did you mean --hostfile? See 'crew run --help'."),
    (["run", "--deepspeed_config", "ds.json", "train.py"],
     "crew run: error: unknown option --deepspeed_config (the script's own options go after the script's "
     "name). See 'crew run --help'."),
    (["run", "--launcher", "sssh", "train.py"],
     "crew run: error: --launcher: invalid choice: 'sssh' (choose from 'local', 'ssh', 'pdsh', 'standalone', "
     "'slurm', 'openmpi', 'mpich', 'impi', 'mvapich'); did you mean 'ssh'? See 'crew run --help'."),
    (["run", "--num_nodes", "two", "train.py"],
     "crew run: error: --num_nodes: invalid int value: 'two'. See 'crew run --help'."),
    (["doctor", "--jsn"], "crew doctor: error: unknown option --jsn; did you mean --json? See 'crew doctor --help'."),
    (["export", "ckpt"],
     "crew export: error: the following arguments are required: out. See 'crew export --help'."),
    (["plot", "--bogus", "dir"], "crew plot: error: unknown option --bogus. See 'crew plot --help'."),
    (["rnu", "train.py"], "crew: error: COMMAND: invalid choice: 'rnu' (choose from 'run', 'doctor', 'sync', "
                          "'plan', 'export', 'estimate', 'plot', 'config'); did you mean 'run'? See 'crew --help'."),
])
def test_a_bad_command_line_is_one_line_with_the_flag_and_the_help(capsys, here, argv, line):
    assert main_error(capsys, *argv) == line + "\n"


def test_the_scripts_own_options_still_go_to_it():
    args = cli.build_parser().parse_args(["run", "train.py", "--deepspeed_config", "ds.json", "--bogus"])
    assert args.script == "train.py" and args.script_args == ["--deepspeed_config", "ds.json", "--bogus"]


# -- the script ------------------------------------------------------------------------------------------

def test_a_missing_script_is_said_with_close_names(capsys, here):
    write_script(here, "train.py", USES_CREW)
    err = main_error(capsys, "run", "trian.py")
    assert err == f"crew: error: crew run: script trian.py not found in {here} on this machine; did you mean " \
                  "train.py?\n"
    (here / "src").mkdir()
    in_src = precheck.missing_script("src/train.py")
    assert in_src == f"script src/train.py not found in {here / 'src'} on this machine."
    write_script(here, "src/train.py", USES_CREW)
    assert precheck.missing_script("src/trian.py").endswith("; did you mean src/train.py?")
    assert "there is no folder" in precheck.missing_script("nowhere/train.py")
    (here / "pkg").mkdir()
    (here / "pkg" / "__main__.py").write_text("")
    assert precheck.missing_script("pkg") is None  # python runs a folder with a __main__.py


def test_over_ssh_a_missing_script_is_said_before_any_connection_with_the_way_out(capsys, here):
    (here / "hosts").write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    err = main_error(capsys, "run", "-H", "hosts", "train.py")
    assert err.startswith("crew: error: crew run: script train.py not found in ")
    assert err.endswith("If only the nodes have it, --skip_preflight starts anyway.\n")


def run_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["run", *argv])


@pytest.mark.parametrize("argv, launcher", [
    (["--skip_preflight", "train.py"], "ssh"), (["--skip_preflight", "train.py"], "slurm"),
    (["--module", "pkg.train"], "local"), (["--no_python", "train.sh"], "local"),
])
def test_the_script_is_not_looked_for_where_it_need_not_be_here(here, argv, launcher):
    precheck.check_run(run_args(*argv), launcher, 2)


def test_the_local_launcher_always_needs_the_script_here(here):
    with pytest.raises(precheck.CrewError, match="script train.py not found"):
        precheck.check_run(run_args("--skip_preflight", "train.py"), "local", 2)


# -- the DeepSpeed config --------------------------------------------------------------------------------

def write_config(folder, name: str, data) -> str:
    (folder / name).write_text(data if isinstance(data, str) else json.dumps(data))
    return name


def test_a_config_error_is_said_once_and_nothing_starts(here):
    write_script(here, "train.py", USES_CREW)
    write_config(here, "ds.json", '{\n  "train_batch_size": 8,\n  "train_micro_batch_size_per_gpu": 2,,\n}\n')
    result = crew("run", "--num_gpus", "2", "train.py", "--deepspeed", "--deepspeed_config", "ds.json", cwd=here)
    assert result.code == 2
    assert result.err == ("crew: error: ds.json, line 3, column 39: invalid JSON: Expecting property name enclosed "
                          "in double quotes; nor is it hjson (line 3, column 39: Found ',' where a key name was "
                          "expected (check your syntax or use quotes if the key name includes {}[],: or whitespace))."
                          " Nothing was started (--skip_preflight starts without this check).\n")
    assert not (here / "ran").exists()


def check(here, data, world_size: int = 2, *argv: str, script: str = USES_CREW) -> None:
    write_script(here, "train.py", script)
    write_config(here, "ds.json", data)
    precheck.check_run(run_args(*argv, "train.py", "--deepspeed_config=ds.json"), "local", world_size)


def test_batch_sizes_that_disagree_at_the_jobs_world_size(capsys, here):
    write_script(here, "train.py", USES_CREW)
    write_config(here, "ds.json", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                   "gradient_accumulation_steps": 2})
    err = main_error(capsys, "run", "--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json")
    assert err.startswith("crew: error: ds.json: train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
                          "gradient_accumulation_steps 2 x world size 2 = 16. Set train_batch_size to 16")
    assert err.count("\n") == 1
    check(here, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4)
    assert main_error(capsys, "run", "train.py", "--deepspeed_config", "missing.json").startswith(
        "crew: error: missing.json: no such config file")


@pytest.mark.parametrize("data", [
    {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
     "fp16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
     "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},   # Hugging Face fills these
    {"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"},  # ... and checks them itself
    {"train_batch_size": 32, "train_micro_batch_size_per_rank": [12, 4]},
    {"train_batch_size": 32, "train_micro_batch_size_per_rank": "auto"},
    {"train_batch_size": 8, "not_a_deepspeed_key": 1, "zero_optimization": {"stage": 3, "overlap_comm": True}},
])
def test_configs_the_ranks_accept_pass_without_a_word(here, capsys, data):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here would be said again by every rank
        check(here, data)
    assert capsys.readouterr().err == ""


def test_per_rank_micro_batches_are_checked_at_the_jobs_world_size(here):
    with pytest.raises(precheck.CrewError, match="train_micro_batch_size_per_rank has 2 entries but the job has "
                                                 "3 ranks"):
        check(here, {"train_batch_size": 32, "train_micro_batch_size_per_rank": [12, 4]}, 3)


BAD = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}


@pytest.mark.parametrize("script, argv, checked", [
    (USES_CREW, [], True),
    ("import deepspeed\n", ["--as_deepspeed"], True),
    ("import deepspeed\n", [], False),  # DeepSpeed's own engine: its rules, not crew's
    ("import torch\n", [], False),      # no engine at all
    (USES_CREW, ["--skip_preflight"], False),
])
def test_the_config_is_checked_only_where_the_ranks_run_crews_engine(here, script, argv, checked):
    if checked:
        with pytest.raises(precheck.CrewError, match="world size 2 = 16"):
            check(here, BAD, 2, *argv, script=script)
    else:
        check(here, BAD, 2, *argv, script=script)


def test_the_config_argument_in_either_spelling_the_last_one_wins():
    assert precheck.config_argument(["--deepspeed_config", "a.json", "--x"]) == "a.json"
    assert precheck.config_argument(["--deepspeed_config=a.json", "--deepspeed_config", "b.json"]) == "b.json"
    assert precheck.config_argument(["--deepspeed", "--deepspeed_config"]) is None
    # Hugging Face's TrainingArguments take the config as --deepspeed FILE; DeepSpeed's --deepspeed is a switch
    assert precheck.config_argument(["--deepspeed", "ds_z2.json", "--output_dir", "out"]) == "ds_z2.json"
    assert precheck.config_argument(["--deepspeed=ds.json"]) == "ds.json"
    assert precheck.config_argument(["--deepspeed", "--lr", "0.1", "data.txt"]) is None
