"""Slurm's compressed node lists and per-node counts (crew/launcher/plan/slurm.py), checked against scontrol."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from crew.errors import LaunchError
from crew.launcher.plan.slurm import expand_nodelist, expand_tasks_per_node


@pytest.mark.parametrize("text, hosts", [
    ("node7", ["node7"]),
    ("gpu[01-04,07],cpu7", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu7"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("a[01-3],b[1-02]", ["a01", "a02", "a03", "b1", "b2"]),  # the first number sets the width
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
    ("a[1,2]-b[3,4],c", ["a1-b3", "a1-b4", "a2-b3", "a2-b4", "c"]),
    ("n[1-2]-[01-02]-x[7]", ["n1-01-x7", "n2-01-x7", "n1-02-x7", "n2-02-x7"]),  # Slurm's order
    ("a[1-2],a1", ["a1", "a2", "a1"]),
    ("a,,b c", ["a", "b", "c"]),
    ("[1-2]", ["1", "2"]),
    ("a[1-]", ["a1"]),
    ("host-a.example.com", ["host-a.example.com"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, complaint", [
    ("", "names no host"),
    (",", "names no host"),
    ("a[3-1]", "goes down (write 1-3)"),
    ("a[1-3]b", "text after its last ']'"),
    ("a[1-2", "never closed"),
    ("a]", "without its '['"),
    ("a[[1-2]]", "nested brackets"),
    ("a[]", "'' in [] is not a number"),
    ("a[1-2,]", "is not a number"),
    ("a[x-y]", "'x-y' in [x-y] is not a number"),
    ("a[0-70000]", "more than 65536 hosts"),
])
def test_malformed_nodelist_names_the_text_and_the_problem(text, complaint):
    with pytest.raises(LaunchError) as error:
        expand_nodelist(text, "SLURM_JOB_NODELIST")
    assert f"SLURM_JOB_NODELIST={text!r}" in str(error.value)
    assert complaint in str(error.value)


@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("3,1(x2)", [3, 1, 1]),
    ("1(x2),8(x1)", [1, 1, 8]),
])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x3", "2x3", "a", "2(x0)", "1,,2", "-1"])
def test_malformed_counts_name_the_text(text):
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE="):
        expand_tasks_per_node(text, "SLURM_TASKS_PER_NODE")


TRICKY = ["gpu[01-04,07],cpu7", "a[1-2]-b[3-4]", "a[1,2]-b[3,4],c[5-6]", "n[1-2]-[001-002]-x[7]",
          "node[098-101]", "a[01-3],b[1-02]", "a[1-2],a1", "[1-2]", "a,,b", "x[1,3-4,7],y[009-011]",
          "a[1-2]b[3-4]c[5-6]", "r[1-2]-n[1-2]-g[1-2]-p[1-2]"]
REJECTED = ["a[3-1]", "a[1-3]b", "a[[1-2]]", "a[]", "a[1-2,]", "a[x-y]", "a[0-70000]"]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """`scontrol show hostnames` runs without a cluster, but needs a slurm.conf to read."""
    if not shutil.which("scontrol"):
        pytest.skip("scontrol is not installed (apt-get install slurm-client)")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=hostlist\nSlurmctldHost=localhost\n")

    def hostnames(text: str) -> list[str] | None:
        """scontrol's hosts, or None where it says the list is invalid (it still exits 0)."""
        done = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                              env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}, timeout=30)
        if "Invalid hostlist" in done.stdout + done.stderr:
            return None
        assert done.returncode == 0, done.stderr
        return done.stdout.split()
    return hostnames


@pytest.mark.parametrize("text", TRICKY)
def test_expansion_matches_scontrol(scontrol, text):
    assert expand_nodelist(text) == scontrol(text)


@pytest.mark.parametrize("text", REJECTED)
def test_lists_scontrol_rejects_are_rejected(scontrol, text):
    assert scontrol(text) is None
    with pytest.raises(LaunchError):
        expand_nodelist(text)
