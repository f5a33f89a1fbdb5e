"""`crew doctor` and `crew run`'s preflight against real loopback ssh nodes (sshd on 127.0.0.2/.3).

A node gets a view of its own where a test needs one node to differ: its sshd runs in a mount
namespace with bind mounts (a different script at the same path, another virtual environment at the
interpreter's path), as on a second machine.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import crew, processes_in, write_script
from sshnodes import _keygen

import crew as crew_package

TRAIN = """
    import os
    open(f"ran_on_{os.environ['CREW_HOST']}", "w").close()
"""


def doctor(cluster, job_dir, *args, ssh_args=None, slots=1):
    return crew("doctor", "--ssh_args", ssh_args or cluster.ssh_args, "-H",
                str(cluster.hostfile(slots=slots)), *args, cwd=job_dir)


def problems(result) -> list[str]:
    return [line for line in result.out.splitlines() if line.startswith("✗ ")]


def test_healthy_nodes_pass_every_check(make_cluster, job_dir):
    cluster = make_cluster()
    write_script(job_dir, "train.py", TRAIN)
    (job_dir / "model.py").write_text("WIDTH = 4\n")
    result = doctor(cluster, job_dir, "--json", "--env", "GLOO_SOCKET_IFNAME=lo", "train.py",
                    "--save_dir", "ckpt", slots=2)
    assert result.code == 0, result.out + result.err
    report = json.loads(result.out)
    assert report["ok"] and [n["host"] for n in report["nodes"]] == cluster.addresses
    for node in report["nodes"]:
        checks = node["checks"]
        assert {name: c["status"] for name, c in checks.items()} == {
            "ssh": "ok", "python": "ok", "torch": "ok", "crew": "ok", "cuda": "ok", "nccl": "ok",
            "script": "ok", "files": "ok", "devices": "ok", "master_port": "ok", "interfaces": "ok",
            "disk": "ok"}
        assert checks["crew"]["value"] == crew_package.__version__
        assert checks["files"]["detail"] == "2 file(s) the same"
        assert checks["master_port"]["detail"] == f"127.0.0.2:{report['master_port']} reached"
        assert str(job_dir) in checks["disk"]["detail"]  # ckpt does not exist yet: its parent


def test_sshd_down_names_the_node_and_the_fix(make_cluster, job_dir):
    cluster = make_cluster()
    cluster.stop_node("127.0.0.3")
    write_script(job_dir, "train.py", TRAIN)
    result = doctor(cluster, job_dir, "train.py")
    assert result.code == 1
    assert problems(result) == ["✗ 127.0.0.3 (node 1) ssh: ssh: connect to host 127.0.0.3 port "
                                f"{cluster.port}: Connection refused"]
    assert "fix: nothing listens for ssh there. Start sshd on 127.0.0.3" in result.out
    table = result.out.splitlines()
    assert re.match(r"1\s+127\.0\.0\.3\s+✗ FAIL\s+-", next(line for line in table if line.startswith("1 ")))


def test_unauthorised_key_gets_ssh_copy_id_and_config_lines(make_cluster, job_dir):
    cluster = make_cluster()
    stranger = job_dir.parent / "stranger_key"
    _keygen(stranger)
    config = job_dir.parent / "stranger_config"
    config.write_text(cluster.config.read_text().replace(str(cluster.root / "client_key"), str(stranger)))
    write_script(job_dir, "train.py", TRAIN)
    result = doctor(cluster, job_dir, "train.py", ssh_args=f"-F {config}")
    assert result.code == 1
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    lines = [line.strip() for line in result.out.splitlines()]
    for node, host in enumerate(cluster.addresses):
        assert f"✗ {host} (node {node}) ssh: {user}@{host}: Permission denied (publickey)." in lines
        start = lines.index(f"ssh-copy-id -F {config} -i {stranger}.pub -p {cluster.port} {user}@{host}")
        assert lines[start + 2:start + 8] == [f"Host {host}", f"HostName {host}", f"Port {cluster.port}",
                                              f"User {user}", f"IdentityFile {stranger}",
                                              f"Then 'ssh -p {cluster.port} {user}@{host} true' must work "
                                              "without a password."]
    run = crew("run", "--ssh_args", f"-F {config}", "-H", str(cluster.hostfile(slots=1)), "train.py", cwd=job_dir)
    assert run.code == 1 and "preflight found problems; no rank was started" in run.err
    assert f"ssh-copy-id -F {config} -i {stranger}.pub -p {cluster.port} {user}@127.0.0.3" in run.err
    assert not list(job_dir.glob("ran_on_*"))


def _second_venv(root: Path) -> tuple[Path, list[tuple[Path, Path]]]:
    """Another virtual environment at this interpreter's path, where crew says another version.

    The node sees it in place of sys.prefix; torch comes from this environment, bound elsewhere.
    """
    other = root / "other_venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(other)], check=True)
    here_site = Path(sysconfig.get_paths()["purelib"])
    other_site = other / here_site.relative_to(sys.prefix)
    shutil.copytree(Path(crew_package.__file__).parent, other_site / "crew",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = other_site / "crew" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{crew_package.__version__}"',
                                             '__version__ = "0.0.1+other"'))
    real_view = root / "real_venv"
    real_view.mkdir()
    (other_site / "torch_from_real.pth").write_text(f"{real_view / here_site.relative_to(sys.prefix)}\n")
    return other, [(Path(sys.prefix), real_view), (other, Path(sys.prefix))]


def test_a_node_with_another_environment_is_named(make_cluster, job_dir, tmp_path):
    _, binds = _second_venv(tmp_path)
    cluster = make_cluster(binds={"127.0.0.3": binds})
    write_script(job_dir, "train.py", TRAIN)
    result = doctor(cluster, job_dir, "train.py")
    assert result.code == 1, result.out
    assert problems(result) == [f"✗ 127.0.0.3 (node 1) crew: crew 0.0.1+other here ({sys.prefix}/lib/"
                                f"python{sys.version_info.major}.{sys.version_info.minor}/site-packages/crew), "
                                f"{crew_package.__version__} on 127.0.0.2"]
    assert (f"fix: on 127.0.0.3: install crew {crew_package.__version__} for {sys.executable}"
            in result.out)
    run = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "train.py",
               cwd=job_dir)
    assert run.code == 1 and "preflight found problems; no rank was started" in run.err
    assert "127.0.0.3 (node 1) crew: crew 0.0.1+other here" in run.err
    assert not list(job_dir.glob("ran_on_*"))


def test_a_script_that_differs_on_one_node_is_named(make_cluster, job_dir, tmp_path):
    write_script(job_dir, "train.py", TRAIN)
    write_script(job_dir, "data.py", "SEED = 1\n")
    stale = tmp_path / "stale"
    stale.mkdir()
    write_script(stale, "train.py", TRAIN.replace("ran_on_", "stale_copy_ran_on_"))
    cluster = make_cluster(binds={"127.0.0.3": [(stale / "train.py", job_dir / "train.py")]})
    result = doctor(cluster, job_dir, "train.py")
    assert result.code == 1
    found = problems(result)
    assert len(found) == 2 and all(line.startswith("✗ 127.0.0.3 (node 1) ") for line in found)
    assert re.fullmatch(r"✗ 127\.0\.0\.3 \(node 1\) script: train\.py differs from this machine's copy "
                        r"\(sha256 [0-9a-f]{12} there, [0-9a-f]{12} here\)", found[0])
    assert found[1] == "✗ 127.0.0.3 (node 1) files: differ: train.py"
    assert "fix: copy the code to every node: crew sync (or crew run --sync)" in result.out

    run = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "train.py",
               cwd=job_dir)
    assert run.code == 1 and "script: train.py differs from this machine's copy" in run.err
    assert not list(job_dir.glob("ran_on_*"))
    forced = crew("run", "--skip_preflight", "--ssh_args", cluster.ssh_args, "-H",
                  str(cluster.hostfile(slots=1)), "train.py", cwd=job_dir)
    assert forced.code == 0, forced.err
    assert sorted(p.name for p in job_dir.glob("*ran_on_*")) == ["ran_on_127.0.0.2",
                                                                 "stale_copy_ran_on_127.0.0.3"]


def test_master_port_taken_is_named(make_cluster, job_dir):
    cluster = make_cluster()
    write_script(job_dir, "train.py", TRAIN)
    with socket.socket() as holder:
        holder.bind(("127.0.0.2", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        result = doctor(cluster, job_dir, "--master_port", str(port), "train.py")
    assert result.code == 1
    assert problems(result) == [
        f"✗ 127.0.0.2 (node 0) master_port: port {port} is already in use on 127.0.0.2 (Address already in use)",
        f"✗ 127.0.0.3 (node 1) master_port: 127.0.0.2:{port} cannot be reached from 127.0.0.3 (another "
        "program holds that port)"]
    assert "fix: pass a free --master_port, or leave it out and crew picks a free one" in result.out


def test_interfaces_and_disk_are_checked(make_cluster, job_dir):
    cluster = make_cluster()
    write_script(job_dir, "train.py", TRAIN)
    result = doctor(cluster, job_dir, "--env", "NCCL_SOCKET_IFNAME=nosuch", "--env", "GLOO_SOCKET_IFNAME=lo,eth9",
                    "--min_free_disk", "1000000TB", "--json", "train.py", "--output_dir=out")
    assert result.code == 1
    node = json.loads(result.out)["nodes"][1]["checks"]
    assert node["interfaces"]["status"] == "fail"
    assert node["interfaces"]["detail"].startswith(
        "NCCL_SOCKET_IFNAME=nosuch matches no interface (interfaces here: ")
    assert "GLOO_SOCKET_IFNAME=lo,eth9: no interface named eth9" in node["interfaces"]["detail"]
    assert node["disk"]["status"] == "fail" and node["disk"]["detail"].startswith("only ")
    assert f"GiB free at {job_dir}" in node["disk"]["detail"]


def test_preflight_is_quick_and_says_what_it_checked(make_cluster, job_dir):
    cluster = make_cluster()
    write_script(job_dir, "train.py", TRAIN)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "train.py",
                  cwd=job_dir)
    assert result.code == 0, result.err
    said = re.search(r"preflight: 2 node\(s\) agree \(python [\d.]+, torch \S+, crew \S+, same script\) in "
                     r"([\d.]+) s", result.err)
    assert said, result.err
    assert float(said.group(1)) < 5.0
    assert sorted(p.name for p in job_dir.glob("ran_on_*")) == ["ran_on_127.0.0.2", "ran_on_127.0.0.3"]


def test_preflight_refuses_an_unreachable_node_before_any_rank_starts(make_cluster, job_dir):
    cluster = make_cluster()
    cluster.stop_node("127.0.0.2")
    write_script(job_dir, "train.py", TRAIN)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "train.py",
                  cwd=job_dir)
    assert result.code == 1
    assert "✗ 127.0.0.2 (node 0) ssh:" in result.err and "Start sshd on 127.0.0.2" in result.err
    assert not list(job_dir.glob("ran_on_*")) and not processes_in(job_dir)


@pytest.mark.skipif(not shutil.which("pdsh"), reason="pdsh is not installed")
def test_doctor_over_pdsh(make_cluster, job_dir):
    cluster = make_cluster()
    write_script(job_dir, "train.py", TRAIN)
    result = doctor(cluster, job_dir, "--launcher", "pdsh", "--json")  # no script named: not checked
    assert result.code == 0, result.out + result.err
    nodes = json.loads(result.out)["nodes"]
    assert [n["checks"]["script"] for n in nodes] == [{"status": "skip", "value": "-", "detail": "no script named",
                                                       "fix": ""}] * 2
    assert all(n["checks"]["files"]["status"] == "ok" for n in nodes)
