"""What crew needs of the installed torch and Python (docs/versions.md): the floor (crew/runtime/comm.py), an
older torch being one clear error naming it, the floor and the fix; FSDP2's records read on every torch from the
floor on; a sharded checkpoint's metadata read whichever Python wrote it."""

from __future__ import annotations

import io
import pickle
import re
import subprocess
import sys
from pathlib import PosixPath

import pytest
import torch
from conftest import REPO
from dist import run_ranks

from crew.errors import CrewError
from crew.runtime.comm import TORCH_FLOOR, require_torch_floor


@pytest.mark.parametrize("version", ["2.9.0", "2.9.0a0+5228986c39", "2.10.0", "2.14.1+cu130", "3.0.0"])
def test_the_floor_and_newer_pass_compared_as_numbers(version):
    require_torch_floor(version)


@pytest.mark.parametrize("version", ["2.8.0+cu128", "2.7.1", "1.13.1"])
def test_an_older_torch_names_itself_the_floor_and_the_fix(version):
    with pytest.raises(CrewError) as error:
        require_torch_floor(version)
    message = str(error.value)
    assert f"torch {version}" in message and "torch >= 2.9" in message and "pip install 'torch>=2.9'" in message
    assert sys.executable in message


def test_pyproject_declares_the_same_floor():
    declared = re.search(r'"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert tuple(int(part) for part in declared.split(".")) == TORCH_FLOOR


def test_initialize_on_an_older_torch_fails_at_import_with_the_message():
    script = "import torch; torch.__version__ = '2.8.0'; import crew; crew.initialize"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("crew.errors.CrewError: crew needs torch >= 2.9; ")


def whole_inside_forward(rank: int) -> list[tuple[int, str]]:
    import crew
    from crew.runtime.zero import stage3
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, _, _, _ = crew.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    units = [m for m in engine.module.modules() if isinstance(m, FSDPModule) and m is not engine.module]
    seen = []
    for unit in units:  # after FSDP2's hook, which unshards, and crew's, which tags
        unit.register_forward_pre_hook(lambda m, args: seen.append(
            (len(stage3.fsdp_params(m)), getattr(getattr(m, "weight", None), "ds_status", None))))
    engine(torch.randn(1, 8))
    return [(count, getattr(status, "name", str(status))) for count, status in seen]


def test_a_units_parameters_are_found_and_tagged_whole_inside_its_forward():
    # FSDP2 keeps a unit's records in _fsdp_param_group before torch 2.11, in _fsdp_param_groups since
    for seen in run_ranks(whole_inside_forward, 2):
        assert seen and all(count > 0 and status == "AVAILABLE" for count, status in seen), seen


def test_a_path_pickled_by_python_3_13_reads_as_a_path():
    from crew.runtime.checkpoint.sharded import _MetadataUnpickler

    # protocol 2 by hand: GLOBAL 'pathlib._local PosixPath', the argument tuple, REDUCE, STOP
    pickled = b"\x80\x02cpathlib._local\nPosixPath\nX\x04\x00\x00\x00/tmp\x85R."
    assert _MetadataUnpickler(io.BytesIO(pickled)).load() == PosixPath("/tmp")
    with pytest.raises(pickle.UnpicklingError, match="has no place"):
        _MetadataUnpickler(io.BytesIO(b"\x80\x02cpathlib._local\nPurePath\n.")).load()
