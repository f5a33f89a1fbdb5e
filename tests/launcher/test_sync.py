"""`crew sync` and `crew run --sync` onto real sshd nodes, where node 127.0.0.3 has its own view of the job folder.

Node .3 runs in a mount namespace in which `node3_view` is mounted over the job folder: what it sees at
the job folder's path is `node3_view`, as a second machine would see its own disk. Node .2 sees the real
job folder, as a node on a shared filesystem does.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

import pytest
from conftest import crew, write_script

from crew.launcher.transport.ignore import list_files
from crew.launcher.transport.sync import _remote_path

NODE3 = "127.0.0.3"
SHARED = "127.0.0.2: sees the same files as this machine (shared filesystem or this machine): nothing to copy"
RSYNC = pytest.mark.skipif(not shutil.which("rsync"), reason="rsync is not installed (apt-get install rsync)")
TOOLS = [pytest.param("rsync", marks=RSYNC), "tar"]


@pytest.fixture
def node3_view(tmp_path: Path) -> Path:
    folder = tmp_path / "node3_view"
    folder.mkdir()
    return folder


@pytest.fixture
def nodes(make_cluster, job_dir, node3_view):
    return make_cluster(count=2, binds={NODE3: [(node3_view, job_dir)]})


def sync(cluster, job_dir: Path, *args: str):
    return crew("sync", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), *args, cwd=job_dir)


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (posix path relative to it) and its text."""
    return {path.relative_to(folder).as_posix(): path.read_text()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def make_files(folder: Path, names: list[str]) -> None:
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"contents of {name}\n")


def copied_line(err: str, host: str = NODE3) -> re.Match:
    found = re.search(rf"{re.escape(host)}: copied (\d+) files \((\d+\.\d) MB\) with (\w+) in (\d+\.\d) s", err)
    assert found, err
    return found


@pytest.mark.parametrize("tool", TOOLS)
def test_sync_copies_what_crewignore_keeps(nodes, job_dir, node3_view, tool):
    injected = f"crew-injected-{secrets.token_hex(4)}"
    make_files(job_dir, [
        "train.py", "pkg/model.py", "pkg/__pycache__/model.cpython-311.pyc", ".git/HEAD",
        "data/big.bin", "data/keep.txt", "outputs/run1.log", "outputs/keep.log", "secret.txt",
        "pkg/secret.txt", "with space/it's $(touch " + injected + ") `touch " + injected + "`.py"])
    (job_dir / ".crewignore").write_text("# not for the nodes\ndata/\n*.log\n!keep.log\n/secret.txt\n")
    (job_dir / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (job_dir / "run.sh").chmod(0o755)
    (job_dir / "latest").symlink_to("pkg/model.py")
    result = sync(nodes, job_dir, "--sync_tool", tool)
    assert result.code == 0, result.err
    expected = [".crewignore", "latest", "outputs/keep.log", "pkg/model.py", "pkg/secret.txt", "run.sh",
                "train.py", f"with space/it's $(touch {injected}) `touch {injected}`.py"]
    assert list_files(job_dir) == expected
    local = tree(job_dir)
    assert tree(node3_view) == {name: local[name] for name in expected}
    assert os.readlink(node3_view / "latest") == "pkg/model.py"
    assert os.access(node3_view / "run.sh", os.X_OK)
    assert SHARED in result.err
    line = copied_line(result.err)
    assert (line[1], line[3]) == (str(len(expected)), tool)
    assert not list(job_dir.glob(".crew-sync-marker-*")), "the marker file was left behind"
    for folder in (job_dir, node3_view, Path.home()):
        assert not (folder / injected).exists(), f"a file name ran as a command (in {folder})"


@pytest.mark.parametrize("tool", TOOLS)
def test_named_paths_and_a_second_sync_after_an_edit(nodes, job_dir, node3_view, tmp_path, tool):
    make_files(job_dir, ["train.py", "other.py", "conf/ds.json", "conf/old.bak", "odd $(x) dir/a b.txt"])
    (job_dir / "conf" / ".crewignore").write_text("*.bak\n")
    notes = tmp_path / "notes.txt"  # outside the job folder: node .3 sees it where this machine does
    notes.write_text("shared\n")
    result = sync(nodes, job_dir, "--sync_tool", tool, "train.py", "conf", "odd $(x) dir", str(notes))
    assert result.code == 0, result.err
    local = tree(job_dir)
    assert tree(node3_view) == {name: local[name]
                                for name in ["conf/.crewignore", "conf/ds.json", "odd $(x) dir/a b.txt", "train.py"]}
    assert f"{NODE3}: sees {tmp_path} as this machine does (shared filesystem): not copied" in result.err
    assert copied_line(result.err)[1] == "4"

    (job_dir / "train.py").write_text("edited\n")
    (job_dir / "conf" / "new.json").write_text("{}\n")
    os.utime(job_dir / "train.py", (1, 1))  # even a stale mtime: rsync sees the size differ
    (node3_view / "only-on-the-node.txt").write_text("kept\n")  # a sync never deletes
    result = sync(nodes, job_dir, "--sync_tool", tool, "train.py", "conf")
    assert result.code == 0, result.err
    assert (node3_view / "train.py").read_text() == "edited\n"
    assert (node3_view / "conf" / "new.json").read_text() == "{}\n"
    assert (node3_view / "only-on-the-node.txt").read_text() == "kept\n"
    assert copied_line(result.err)[1] == "4"
    if tool == "rsync":
        assert "(2 new or changed)" in result.err


def test_unreachable_node_fails_after_syncing_the_others(make_cluster, job_dir, node3_view):
    cluster = make_cluster(count=2, binds={NODE3: [(node3_view, job_dir)]})
    make_files(job_dir, ["train.py"])
    cluster.stop_node(NODE3)
    result = sync(cluster, job_dir)
    assert result.code == 2
    assert SHARED in result.err
    assert "could not copy to 1 of 2 node(s)" in result.err
    assert f"{NODE3}: ssh" in result.err and "Connection refused" in result.err
    assert f"nothing listens for ssh there. Start sshd on {NODE3}" in result.err


@RSYNC
def test_node_without_rsync_gets_tar(make_cluster, job_dir, node3_view, tmp_path):
    no_rsync = tmp_path / "no-rsync"  # on node .3 only: what a shell says when rsync is not installed
    no_rsync.write_text("#!/bin/sh\necho 'sh: 1: rsync: not found' >&2\nexit 127\n")
    no_rsync.chmod(0o755)
    rsync = Path(shutil.which("rsync")).resolve()
    cluster = make_cluster(count=2, binds={NODE3: [(node3_view, job_dir), (no_rsync, rsync)]})
    make_files(job_dir, ["train.py", "pkg/model.py"])
    result = sync(cluster, job_dir, "--sync_tool", "rsync")
    assert result.code == 0, result.err
    assert f"{NODE3}: rsync is not installed there; copying with tar instead" in result.err
    assert copied_line(result.err)[3] == "tar"
    assert tree(node3_view) == tree(job_dir)


def test_missing_path_is_an_error(job_dir):
    result = crew("sync", "nope.py", cwd=job_dir)
    assert result.code == 2
    assert f"crew: error: crew sync: nope.py does not exist (looked in {job_dir})" in result.err


def test_nothing_to_copy_without_a_hostfile(job_dir):
    result = crew("sync", cwd=job_dir)
    assert result.code == 0, result.err
    assert "crew: nothing to copy: the plan runs on this machine only." in result.err


def test_run_sync_copies_the_script_then_runs_it(nodes, job_dir, node3_view):
    write_script(job_dir, "only_here.py", """
        import os
        open(f"rank{os.environ['RANK']}.txt", "w").write(os.environ["CREW_HOST"])
    """)
    result = crew("run", "--ssh_args", nodes.ssh_args, "-H", str(nodes.hostfile(slots=1)), "--sync",
                  "--skip_preflight", "only_here.py", cwd=job_dir)
    assert result.code == 0, result.err
    assert SHARED in result.err
    assert (node3_view / "only_here.py").exists()
    assert (job_dir / "rank0.txt").read_text() == "127.0.0.2"
    assert (node3_view / "rank1.txt").read_text() == NODE3
    assert not (job_dir / "rank1.txt").exists()


def test_ipv6_hosts_are_bracketed_for_rsync():
    assert _remote_path("fe80::7", "/srv/job/") == "[fe80::7]:/srv/job/"
    assert _remote_path("worker-1", "/srv/job/") == "worker-1:/srv/job/"
