"""`crew estimate`: per-rank model-state memory at ZeRO stages 0-3, its parsing, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from contextlib import nullcontext

import pytest
from conftest import REPO

from crew.cli import main
from crew.errors import CrewError
from crew.runtime.estimate import (
    Row,
    count_parameters,
    model_states_per_rank,
    world_size_from,
)
from crew.units import parse_bytes, parse_count

G = 10**9


def by_stage(rows: list[Row]) -> dict[tuple[int, bool], Row]:
    return {(r.stage, r.offload): r for r in rows}


# (params, grads, optimizer) bytes per rank, worked out by hand from the module docstring's model.
@pytest.mark.parametrize("num_params, world, precision, expected", [
    (G, 8, "bf16", {0: (2 * G, 2 * G, 12 * G),          # 16 GB
                    1: (2 * G, 2 * G, 1.5 * G),         # 2 + 2 + 12/8 = 5.5 GB
                    2: (2 * G, 0.25 * G, 1.5 * G),      # 2 + (2 + 12)/8 = 3.75 GB
                    3: (0.25 * G, 0.25 * G, 1.5 * G)}),  # 16/8 = 2 GB
    (G, 4, "fp32", {0: (4 * G, 4 * G, 8 * G),            # 16 GB
                    1: (4 * G, 4 * G, 2 * G),            # 10 GB
                    2: (4 * G, G, 2 * G),                # 7 GB
                    3: (G, G, 2 * G)}),                  # 4 GB
    (10, 4, "fp16", {0: (20, 20, 120),                   # shards round up: 10 / 4 -> 3
                     1: (20, 20, 36),
                     2: (20, 6, 36),
                     3: (6, 6, 36)}),
    (1000, 1, "bf16", {s: (2000, 2000, 12000) for s in range(4)}),
])
def test_bytes_per_stage(num_params, world, precision, expected):
    rows = by_stage(model_states_per_rank(num_params, world, precision))
    assert set(rows) == {(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)}
    for stage, parts in expected.items():
        row = rows[stage, False]
        assert (row.params, row.grads, row.optimizer) == tuple(int(n) for n in parts)
        assert (row.device_bytes, row.cpu_bytes) == (int(sum(parts)), 0)


def test_totals_for_one_billion_on_eight_ranks_bf16():
    totals = [r.device_bytes for r in model_states_per_rank(G, 8, "bf16") if not r.offload]
    assert totals == [16 * G, int(5.5 * G), int(3.75 * G), 2 * G]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_stage3_on_two_ranks_is_at_most_55_percent_of_stage0(precision):
    rows = by_stage(model_states_per_rank(7 * G, 2, precision))
    assert rows[3, False].device_bytes <= 0.55 * rows[0, False].device_bytes


def test_offload_moves_optimizer_and_stage3_params_to_cpu():
    rows = by_stage(model_states_per_rank(G, 8, "bf16"))
    for stage in (1, 2, 3):
        plain, off = rows[stage, False], rows[stage, True]
        assert (off.params, off.grads, off.optimizer) == (plain.params, plain.grads, plain.optimizer)
        moved = off.optimizer + (off.params if stage == 3 else 0)
        assert off.cpu_bytes == moved == plain.device_bytes - off.device_bytes
    assert (rows[2, True].device_bytes, rows[2, True].cpu_bytes) == (int(2.25 * G), int(1.5 * G))
    assert (rows[3, True].device_bytes, rows[3, True].cpu_bytes) == (int(0.25 * G), int(1.75 * G))


@pytest.mark.parametrize("args, words", [
    ((0, 8, "bf16"), "at least 1"),
    ((G, 0, "bf16"), "world size 0"),
    ((G, 8, "int8"), "fp32, fp16, bf16"),
])
def test_model_states_rejects_bad_input(args, words):
    with pytest.raises(CrewError, match=words):
        model_states_per_rank(*args)


@pytest.mark.parametrize("text, expected", [
    ("7B", 7 * G), ("7b", 7 * G), ("1.3e9", 1_300_000_000), ("350M", 350_000_000), ("125k", 125_000),
    ("1000", 1000), (" 1.5T ", 1_500_000_000_000), ("0.5k", 500), ("1_000", 1000), ("6.7B", 6_700_000_000),
])
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("text, words", [
    ("", "expected a number"), ("7x", "expected a number"), ("seven", "expected a number"),
    ("-5", "expected a number"), ("1.5", "whole number"), ("0", "at least 1"), ("1e", "expected a number"),
    ("7BB", "expected a number"), ("..", "expected a number"),
])
def test_parse_count_errors(text, words):
    with pytest.raises(CrewError, match=words) as info:
        parse_count(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * 2**30), ("80GiB", 80 * 2**30), ("80g", 80 * 2**30), ("80", 80 * 2**30),
    ("24576MB", 24 * 2**30), ("512B", 512), ("1.5T", int(1.5 * 2**40)),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["eighty", "80 GBs", "-1GB", "0GB"])
def test_parse_bytes_errors(text):
    with pytest.raises(CrewError, match="device memory"):
        parse_bytes(text)


@pytest.mark.parametrize("world, gpus, nodes, local, expected", [
    (16, None, None, 0, 16), (None, 8, 2, 0, 16), (None, 8, None, 0, 8), (None, None, 4, 2, 8),
    (None, None, None, 0, 1),
])
def test_world_size_from(world, gpus, nodes, local, expected):
    assert world_size_from(world, gpus, nodes, local) == expected


@pytest.mark.parametrize("world, gpus, nodes, words", [
    (8, 8, None, "not both"), (0, None, None, "at least 1 rank"), (None, 0, 1, "at least 1 rank"),
    (None, 8, 0, "at least 1 rank"),
])
def test_world_size_errors(world, gpus, nodes, words):
    with pytest.raises(CrewError, match=words):
        world_size_from(world, gpus, nodes, 0)


# count_parameters imports a factory by name: a tiny module on sys.path for the test.

MODELS = """
    import torch

    def small_model():
        return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))

    def tied_model():
        emb = torch.nn.Embedding(100, 16)
        head = torch.nn.Linear(16, 100, bias=False)
        head.weight = emb.weight
        return torch.nn.ModuleList([emb, head])

    def needs_values():  # fails on the meta device: reads a tensor value
        layer = torch.nn.Linear(4, 4)
        if layer.weight.sum().item() != 12345:
            return layer

    def broken():
        raise RuntimeError("no config file")

    def not_a_module():
        return 42

    NOT_CALLABLE = 3
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    name = f"crew_test_models_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_count_parameters_matches_the_real_count(models):
    import torch

    real = sum(p.numel() for p in torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))
               .parameters())
    assert count_parameters(f"{models}:small_model") == real == 10 * 20 + 20 + 20 * 5 + 5


def test_count_parameters_counts_tied_weights_once(models):
    assert count_parameters(f"{models}:tied_model") == 100 * 16


def test_count_parameters_falls_back_to_cpu_with_a_warning(models):
    with pytest.warns(UserWarning, match="meta device failed"):
        assert count_parameters(f"{models}:needs_values") == 4 * 4 + 4


@pytest.mark.parametrize("spec, words", [
    ("no_colon", "expected 'package.module:factory'"),
    (":factory", "expected 'package.module:factory'"),
    ("{m}:", "expected 'package.module:factory'"),
    ("{m}:a:b", "expected 'package.module:factory'"),
    ("crew_no_such_module_xyz:build", "cannot import 'crew_no_such_module_xyz'"),
    ("{m}:missing", "has no attribute 'missing'"),
    ("{m}:NOT_CALLABLE", "int, not a callable"),
    ("{m}:not_a_module", "returned a int, expected a torch.nn.Module"),
    ("{m}:broken", r"broken\(\) failed: RuntimeError: no config file"),
])
def test_count_parameters_errors(models, spec, words):
    with pytest.warns(UserWarning) if spec.endswith("broken") else nullcontext():
        with pytest.raises(CrewError, match=words):
            count_parameters(spec.format(m=models))


# The command line.

def crew_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table(capsys):
    code, out, err = crew_main(capsys, "--params", "1B", "--world_size", "8", "--precision", "bf16")
    assert (code, err) == (0, "")
    assert "1.00B parameters (1,000,000,000), world size 8, bf16" in out
    lines = out.splitlines()
    assert lines[1].split() == ["stage", "offload", "params", "grads", "optimizer", "per", "device",
                                "per", "rank", "CPU"]
    # 1e9 bytes = 0.93 GiB: stage 0 = 16e9 B = 14.90 GiB; stage 3 offload = 0.25e9 on device, 1.75e9 on CPU
    assert lines[2].split() == ["0", "no", "1.86", "1.86", "11.18", "14.90", "0.00"]
    assert lines[8].split() == ["3", "cpu", "0.23", "0.23", "1.40", "0.23", "1.63"]
    assert "Not included: activations" in out
    assert "fits" not in lines[1]


def test_cli_device_memory_column(capsys):
    code, out, _ = crew_main(capsys, "--params", "7B", "--num_gpus", "8", "--device_memory", "80GB")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].endswith("fits 80 GiB")
    fits = [line.split()[-1] for line in lines[2:9]]
    assert fits == ["no", "yes", "yes", "yes", "yes", "yes", "yes"]   # stage 0 needs 104 GiB
    assert "20% left for activations" in out


def test_cli_marks_tight_fit(capsys):
    # 1B bf16 on one rank = 14.90 GiB: more than 80% of 16 GiB, less than 16 GiB.
    code, out, _ = crew_main(capsys, "--params", "1B", "--world_size", "1", "--device_memory", "16GB")
    assert code == 0
    assert out.splitlines()[2].split()[-1] == "tight"


def test_cli_json(capsys):
    code, out, _ = crew_main(capsys, "--params", "1e9", "--num_gpus", "4", "--num_nodes", "2",
                             "--device_memory", "4GiB", "--json")
    assert code == 0
    data = json.loads(out)
    assert (data["num_params"], data["world_size"], data["precision"]) == (G, 8, "bf16")
    assert data["device_memory"] == 4 * 2**30
    assert [(r["stage"], r["offload"]) for r in data["rows"]] == [
        (0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
    assert data["rows"][0] == {"stage": 0, "offload": False, "params": 2 * G, "grads": 2 * G,
                               "optimizer": 12 * G, "device_bytes": 16 * G, "cpu_bytes": 0, "fits": "no"}
    assert data["rows"][5]["device_bytes"] == 2 * G and data["rows"][5]["fits"] == "yes"


def test_cli_json_without_device_memory_has_no_fits(capsys):
    code, out, _ = crew_main(capsys, "--params", "350M", "--world_size", "2", "--precision", "fp32", "--json")
    data = json.loads(out)
    assert code == 0 and data["device_memory"] is None
    assert all("fits" not in row for row in data["rows"])
    assert data["rows"][0]["device_bytes"] == 16 * 350_000_000


def test_cli_model(capsys, models):
    code, out, _ = crew_main(capsys, "--model", f"{models}:small_model", "--world_size", "2", "--json")
    assert code == 0
    assert json.loads(out)["num_params"] == 325


@pytest.mark.parametrize("argv, words", [
    (["--params", "7 billion"], "parameter count '7 billion'"),
    (["--params", "7B", "--world_size", "8", "--num_gpus", "8"], "not both"),
    (["--params", "7B", "--device_memory", "lots"], "device memory 'lots'"),
    (["--model", "nonsense"], "expected 'package.module:factory'"),
])
def test_cli_errors_are_one_message(capsys, argv, words):
    code, out, err = crew_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("crew: error: ") and words in err
    assert "Traceback" not in err


def test_cli_needs_params_or_model(capsys):
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--world_size", "8"])
    assert info.value.code == 2
    assert "--params" in capsys.readouterr().err


def test_cli_estimate_params_does_not_import_torch():
    script = ("import sys, crew.cli; "
              "code = crew.cli.main(['estimate', '--params', '7B', '--num_gpus', '8']); "
              "assert code == 0, code; "
              "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world size 8" in proc.stdout
