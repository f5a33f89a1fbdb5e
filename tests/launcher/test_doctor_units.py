"""The doctor's rules that need no nodes: interface names, device counts, where checkpoints go."""

from __future__ import annotations

import argparse

import pytest

from crew.launcher.preflight import doctor

from crew.launcher.preflight import probe
from crew.launcher.plan.plan import NodePlan

NAMES = ["docker0", "eth0", "eth1", "ib0", "lo"]


@pytest.mark.parametrize("value, ok", [
    ("eth", True), ("eth0", True), ("=eth0", True), ("=eth", False), ("ib", True), ("wlan", False),
    ("wlan,ib", True), ("^docker,lo", True), ("^=eth0", True), ("^docker0,eth,ib0,lo", False),
])
def test_nccl_socket_ifname_follows_nccl_syntax(value, ok):
    assert probe._nccl_matches(value, NAMES) is ok


def test_interface_problems_name_the_variable_and_what_exists():
    env = {"NCCL_SOCKET_IFNAME": "nosuch", "GLOO_SOCKET_IFNAME": "lo,eth9"}
    found = probe.interface_problems(env)
    assert len(found) == 2
    assert found[0].startswith("NCCL_SOCKET_IFNAME=nosuch matches no interface (interfaces here: ")
    assert "lo" in found[0]
    assert found[1].startswith("GLOO_SOCKET_IFNAME=lo,eth9: no interface named eth9 (")
    assert probe.interface_problems({"GLOO_SOCKET_IFNAME": "lo"}) == []


def node(slots):
    return NodePlan(1, "gpu-2", None, tuple(slots), tuple(range(len(slots))))


@pytest.mark.parametrize("slots, count, others, status, value", [
    ([0, 1], 2, [2], "ok", "2 GPU"),
    ([0, 1, 2, 3], 2, [2], "fail", "2 < 4"),
    ([4], 4, [8], "fail", "4 < 1"),  # device id 4 needs at least 5 GPUs
    ([0], 0, [0], "ok", "cpu"),
    ([0], 0, [8], "fail", "no GPU"),
    ([0], None, [8], "skip", "-"),
])
def test_devices_must_cover_the_slots(slots, count, others, status, value):
    every = {0: {"devices": others[0]}, 1: {"devices": count}}
    check = doctor._devices(node(slots), {"devices": count}, every)
    assert (check.status, check.value) == (status, value)
    if status == "fail" and count:
        assert f"at most slots={count}" in check.fix


@pytest.mark.parametrize("flag, script_args, expected", [
    ("mine", ["--save_dir", "x"], "mine"),
    (None, ["--deepspeed", "--save_dir", "ckpt"], "ckpt"),
    (None, ["--output_dir=out/run1"], "out/run1"),
    (None, ["--checkpoint_dir", "c", "--save_dir", "s"], "c"),
    (None, ["--lr", "1e-3"], None),
    (None, ["--save_dir"], None),
])
def test_save_dir_comes_from_the_flag_or_the_scripts_arguments(flag, script_args, expected):
    args = argparse.Namespace(save_dir=flag, script_args=script_args)
    assert doctor.save_dir_of(args) == expected


def test_table_marks_failures_and_skips():
    ok = doctor.NodeReport(0, "a", None, {"ssh": doctor.Check("ssh", "ok", "ok"),
                                          "disk": doctor.Check("disk", "skip", "-")})
    bad = doctor.NodeReport(1, "bb", 2222, {"ssh": doctor.Check("ssh", "fail", "FAIL", "refused", "start it")})
    assert doctor.format_table([ok, bad]).splitlines() == [
        "node  host  ssh     disk", "0     a     ok      -", "1     bb    ✗ FAIL  -"]
    assert doctor.format_problems([ok, bad]) == "✗ bb (node 1) ssh: refused\n    fix: start it"


FAKE_TORCH_INIT = """
import os
open(os.environ["IMPORTED"], "w").close()
class cuda:
    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 3)
    class nccl:
        version = staticmethod(lambda: (2, 21, 5))
"""


@pytest.mark.parametrize("build, imported, runtime", [
    ({"cuda": None, "hip": None}, False, {"nccl": None, "devices": 0}),  # a CPU build: nothing to import for
    ({"cuda": "12.1", "hip": None}, True, {"nccl": "2.21.5", "devices": 3}),
    ({"cuda": None, "hip": "6.0"}, True, {"nccl": "2.21.5", "devices": 3}),  # ROCm's GPUs are torch.cuda's too
])
def test_the_full_probe_imports_torch_only_for_a_gpu_build(tmp_path, build, imported, runtime):
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH_INIT)
    (tmp_path / "torch" / "version.py").write_text(
        "__version__ = '2.9.0'\n" + "".join(f"{key} = {value!r}\n" for key, value in build.items()))
    marker = tmp_path / "imported"
    code = "import json; from crew.launcher.preflight import probe; print(json.dumps(probe.versions(full=True)))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "IMPORTED": str(marker)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert (found["torch"], found["cuda"]) == ("2.9.0", build["cuda"])
    assert {key: found[key] for key in runtime} == runtime
    assert marker.exists() is imported
