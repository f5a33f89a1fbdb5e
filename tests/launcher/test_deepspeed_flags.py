"""DeepSpeed 0.19.8's launcher flags under crew: --bind_cores_to_rank/--bind_core_list, --no_ssh,
--no_ssh_check, --venv_script, --launcher_args, --log_level/-q, --save_pid, --autotuning, and the
PDSH_SSH_ARGS_APPEND variable."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import crew, ranks_saying, write_script

from crew import cli
from crew.errors import CrewError
from crew.launcher.console.console import Console
from crew.launcher.node import binding, pidfile
from crew.launcher.node.binding import Binding
from crew.launcher.plan import dsflags
from crew.launcher.plan.ports import free_port
from crew.launcher.transport import runners
from crew.launcher.transport.protocol import JobSpec, NodeSpec


def fake_sys(root: Path, numa: dict[int, str], siblings: dict[int, str] | None = None) -> Path:
    """A /sys tree: NUMA node -> its cpulist, and each CPU's thread_siblings_list (none: unreadable)."""
    for node, cpus in numa.items():
        folder = root / "devices/system/node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpus + "\n")
    for cpu, text in (siblings or {}).items():
        folder = root / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return root


def no_ht(cpus: range) -> dict[int, str]:
    return {cpu: str(cpu) for cpu in cpus}


# Two sockets, 4 cores each, 2 threads per core: CPU n and n+8 share a core (Intel's numbering).
TWO_NUMA_HT = ({0: "0-3,8-11", 1: "4-7,12-15"}, {cpu: f"{cpu % 8},{cpu % 8 + 8}" for cpu in range(16)})


# -------------------------------------------------------------------------------------------------
# --bind_core_list syntax (DeepSpeed's parse_range_list)

@pytest.mark.parametrize("text, cores", [
    ("1,3-5,7", [1, 3, 4, 5, 7]), ("0", [0]), ("2-2", [2]), ("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]),
])
def test_parse_range_list(text, cores):
    assert binding.parse_range_list(text) == cores


@pytest.mark.parametrize("text, words", [
    ("3-1", ["bad range '3-1'", "end must be at least the start", "1-3"]),
    ("1,1", ["ascending order", "must not overlap"]),
    ("4,2", ["ascending order"]),
    ("1-3,3-5", ["must not overlap"]),
    ("a", ["bad range 'a'"]),
    ("1, 2", ["bad range ' 2'", "no spaces"]),
    ("-1", ["bad range '-1'"]),
    ("1-", ["bad range '1-'"]),
    ("1,,2", ["bad range ''"]),
    ("1-2-3", ["bad range '1-2-3'"]),
])
def test_parse_range_list_errors_name_the_flag(text, words):
    with pytest.raises(CrewError) as error:
        binding.parse_range_list(text)
    message = str(error.value)
    assert message.startswith(f"--bind_core_list {text}: ")
    for word in words:
        assert word in message


def test_bad_core_list_is_refused_before_anything_starts(here, capsys):
    assert cli.main(["plan", "--bind_core_list", "5-2", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crew: error: --bind_core_list 5-2: bad range") and "Traceback" not in err


# -------------------------------------------------------------------------------------------------
# the arithmetic, on fake /sys trees

def test_one_numa_node_contiguous_blocks_no_memory_binding(tmp_path):
    root = fake_sys(tmp_path, {0: "0-5"}, no_ht(range(6)))
    bindings = binding.plan_bindings(2, range(6), None, root)
    assert bindings == [Binding((0, 1, 2), ()), Binding((3, 4, 5), ())]


def test_cores_left_over_stay_unused_as_in_deepspeed(tmp_path):
    root = fake_sys(tmp_path, {0: "0-6"}, no_ht(range(7)))
    assert [b.cpus for b in binding.plan_bindings(3, range(7), None, root)] == [(0, 1), (2, 3), (4, 5)]


def test_two_numa_nodes_with_hyperthreads_one_cpu_per_core_memory_on_its_node(tmp_path):
    root = fake_sys(tmp_path, *TWO_NUMA_HT)
    assert binding.physical_cores(range(16), root) == list(range(8))
    assert binding.plan_bindings(2, range(16), None, root) == [
        Binding((0, 1, 2, 3), (0,)), Binding((4, 5, 6, 7), (1,))]
    assert binding.plan_bindings(4, range(16), None, root) == [
        Binding((0, 1), (0,)), Binding((2, 3), (0,)), Binding((4, 5), (1,)), Binding((6, 7), (1,))]


def test_blocks_do_not_straddle_numa_nodes_where_they_fit(tmp_path):
    root = fake_sys(tmp_path, {0: "0-4", 1: "5-9"}, no_ht(range(10)))
    # DeepSpeed's plain slicing would give (4, 5), across both nodes.
    assert binding.plan_bindings(4, range(10), None, root) == [
        Binding((0, 1), (0,)), Binding((2, 3), (0,)), Binding((5, 6), (1,)), Binding((7, 8), (1,))]
    # Five ranks do not fit without one block over both nodes: it comes last, its memory unbound.
    assert binding.plan_bindings(5, range(10), None, root)[-1] == Binding((4, 9), ())


def test_cpuset_that_excludes_cores(tmp_path):
    root = fake_sys(tmp_path, *TWO_NUMA_HT)
    allowed = {2, 3, 4, 5, 10, 11}  # 10 and 11 are the second threads of cores 2 and 3
    assert binding.plan_bindings(2, allowed, None, root) == [Binding((2, 3), (0,)), Binding((4, 5), (1,))]
    # A core reached only through its second thread counts once, by that thread.
    assert binding.physical_cores({1, 8}, root) == [1, 8]


def test_unreadable_topology_uses_every_allowed_cpu(tmp_path):
    assert binding.physical_cores({0, 1, 5}, tmp_path) == [0, 1, 5]
    assert binding.numa_nodes(tmp_path) == {}
    assert binding.plan_bindings(3, {0, 1, 5}, None, tmp_path) == [Binding((0,)), Binding((1,)), Binding((5,))]


def test_too_few_cores_names_the_flag_and_the_counts(tmp_path):
    root = fake_sys(tmp_path, *TWO_NUMA_HT)
    with pytest.raises(CrewError) as error:
        binding.plan_bindings(3, {0, 8, 1, 9}, None, root)  # two cores, four threads
    message = str(error.value)
    assert message.startswith("--bind_cores_to_rank: 2 core(s) here")
    assert "for this node's 3 ranks" in message and "CPUs 0-1,8-9" in message
    assert "Run at most 2 rank(s)" in message and "leave out --bind_cores_to_rank" in message


def test_core_list_divides_the_listed_cpus_hyperthreads_included(tmp_path):
    root = fake_sys(tmp_path, *TWO_NUMA_HT)
    assert binding.plan_bindings(2, range(16), "0,8", root) == [Binding((0,), (0,)), Binding((8,), (0,))]
    with pytest.raises(CrewError) as error:
        binding.plan_bindings(3, range(16), "0,8", root)
    assert str(error.value).startswith("--bind_core_list 0,8: 2 core(s) for this node's 3 ranks")


def test_core_list_outside_the_affinity_names_the_cores(tmp_path):
    with pytest.raises(CrewError) as error:
        binding.plan_bindings(2, {0, 1, 2, 3}, "2-5", tmp_path)
    message = str(error.value)
    assert message.startswith("--bind_core_list 2-5: core(s) 4-5 are not available here")
    assert "CPUs 0-3" in message


def test_memory_binding_only_where_it_means_something(tmp_path):
    fake_numa = {0: frozenset({0, 1, 2, 3}), 1: frozenset({0, 1, 2, 3}), 2: frozenset({4, 5, 6, 7})}
    assert binding.memory_nodes((0, 1), fake_numa) == (0, 1)  # fake NUMA: the nodes sharing those CPUs
    assert binding.memory_nodes((0, 1), {0: frozenset({0, 1, 2, 3}), 1: frozenset()}) == ()  # HBM/CXL node
    assert binding.memory_nodes((0, 1), {0: frozenset({0, 1})}) == ()


def job_with(bind_cores=True, bind_core_list=None, env=None, ranks=(0, 1)) -> JobSpec:
    return JobSpec(job_id="j", nodes=(NodeSpec("h", tuple(range(len(ranks))), ranks),), master_addr="m",
                   master_port=1, program=("t.py",), cwd="/", env=env or {}, bind_cores=bind_cores,
                   bind_core_list=bind_core_list)


def test_for_node_is_nothing_unless_asked_and_a_reason_when_impossible(tmp_path):
    root = fake_sys(tmp_path, {0: "0-3"}, no_ht(range(4)))
    assert binding.for_node(job_with(bind_cores=False), 0, root, {0, 1, 2, 3}) == []
    assert [b.cpus for b in binding.for_node(job_with(), 0, root, {0, 1, 2, 3})] == [(0, 1), (2, 3)]
    reason = binding.for_node(job_with(ranks=(0, 1, 2)), 0, root, {0, 1})
    assert isinstance(reason, str) and reason.startswith("--bind_cores_to_rank: 2 core(s)")


def test_omp_num_threads_is_the_block_size_unless_the_user_set_it():
    bound = Binding((4, 5, 6))
    assert binding.rank_threads({"OMP_NUM_THREADS": "1"}, {}, bound)["OMP_NUM_THREADS"] == "3"
    env = binding.rank_threads({"OMP_NUM_THREADS": "8"}, {"OMP_NUM_THREADS": "8"}, bound)
    assert env["OMP_NUM_THREADS"] == "8"
    assert binding.rank_threads({"OMP_NUM_THREADS": "1"}, {}, None)["OMP_NUM_THREADS"] == "1"


NO_MEMPOLICY = platform.machine() not in binding._SET_MEMPOLICY or not Path("/sys/devices/system/node/node0").exists()


@pytest.mark.skipif(NO_MEMPOLICY, reason="set_mempolicy's number unknown here, or no NUMA node 0")
def test_preexec_sets_affinity_and_binds_memory_for_real():
    cpu = min(os.sched_getaffinity(0))
    code = ("import os; print(sorted(os.sched_getaffinity(0))); "
            "print(any(' bind:0 ' in line for line in open('/proc/self/numa_maps')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=binding.preexec(Binding((cpu,), (0,)))).stdout.split("\n")
    assert out[:2] == [str([cpu]), "True"]


def test_startup_line_sums_up_and_verbose_lists_every_node():
    started = {n: {"host": f"node{n}", "binding": [["0-3", "0"], ["4-7", "1"]]} for n in range(20)}
    (line,) = binding.startup_lines(started)
    assert line.startswith("cores per rank (--bind_cores_to_rank): node0 0-3|4-7 (memory: NUMA 0|1), node1 ")
    assert len(line) <= 200 and "more; --verbose lists every node)" in line
    lines = binding.startup_lines(started, verbose=True)
    assert len(lines) == 21 and lines[20] == "  node 19: node19 0-3|4-7 (memory: NUMA 0|1)"
    assert binding.startup_lines({0: {"host": "a", "binding": [["0", ""]]}}) == [
        "cores per rank (--bind_cores_to_rank): a 0"]
    assert binding.startup_lines({0: {"host": "a"}}) == []


# -------------------------------------------------------------------------------------------------
# --save_pid

def test_pid_file_replaces_a_stale_one_and_goes_however_the_block_ends(tmp_path, capfd):
    path = pidfile.pid_path(4242, tmp_path)
    path.write_text("99999")  # a stale file from an earlier run
    with pytest.raises(RuntimeError):
        with pidfile.saved(4242, tmp_path):
            assert path.read_text() == str(os.getpid())
            assert oct(path.stat().st_mode & 0o777) == "0o644"
            raise RuntimeError("the job failed")
    assert not path.exists()
    assert f"launcher pid: {os.getpid()}\n" in capfd.readouterr().out
    with pidfile.saved(4242, tmp_path):
        path.write_text("12345")  # another agent on this machine took the name: its file stays
    assert path.read_text() == "12345"
    with pidfile.saved(0, tmp_path) as nothing:
        assert nothing is None and list(tmp_path.iterdir()) == [path]


# -------------------------------------------------------------------------------------------------
# --venv_script, --launcher_args: what the runners send

def make_job(hosts=("w1", "w2"), cwd="/work/job") -> JobSpec:
    nodes = tuple(NodeSpec(h, (0,), (i,)) for i, h in enumerate(hosts))
    return JobSpec(job_id="j0b", nodes=nodes, master_addr="m", master_port=29500, program=("t.py",), cwd=cwd)


def test_pdsh_gets_launcher_args_after_its_options_before_the_command(monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: f"/usr/bin/{name}")
    (launch,) = runners.pdsh_launches(make_job(), "python3", [None, None], ("-p", "2200"),
                                      launcher_args=("-u", "60", "-x", "a b"))
    argv = list(launch.argv)
    assert argv[argv.index("-w") + 2:-1] == ["-u", "60", "-x", "a b"]
    assert shlex.split(argv[-1])[:2] == ["cd", "/work/job;"]
    assert launch.env["PDSH_SSH_ARGS_APPEND"].endswith("-p 2200")


def test_srun_gets_launcher_args_before_the_agent_and_sources_the_venv_in_sh(monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: f"/usr/bin/{name}")
    (launch,) = runners.slurm_launches(make_job(), "python3", ["--exclusive", "--mem=0"],
                                       venv="/opt/my env/bin/activate")
    argv = list(launch.argv)
    assert argv[argv.index("--exclusive") + 1] == "--mem=0"
    assert argv.index("--mem=0") + 1 == argv.index("sh")
    assert argv[-3:-1] == ["sh", "-c"]
    words = shlex.split(argv[-1])
    assert words[words.index(".") + 1] == "/opt/my env/bin/activate;"
    head = ["python3", "-u", "-c", runners.entry(runners.AGENT_MODULE)]
    assert words[words.index("exec") + 1:words.index("exec") + 1 + len(head)] == head
    (plain,) = runners.slurm_launches(make_job(), "python3", [])
    assert "sh" not in plain.argv


VENV_BODY = "export FROM_VENV='sourced; \"ok\"'\n"


@pytest.mark.parametrize("folder", ["plain", "with space", "it's \"quoted\" $(x)"])
def test_venv_shell_text_sources_the_script_whatever_its_path(tmp_path, folder):
    script = tmp_path / folder / "activate"
    script.parent.mkdir()
    script.write_text(VENV_BODY)
    text = runners.venv_prelude(str(script), "node-1") + "exec printenv FROM_VENV"
    done = subprocess.run(["sh", "-c", text], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, 'sourced; "ok"\n')
    command = runners.remote_command("python3", make_job(cwd=str(tmp_path)), 0, venv=str(script))
    assert command.startswith(f"cd {shlex.quote(str(tmp_path))}; [ -r {shlex.quote(str(script))} ]")


def test_missing_venv_script_stops_with_a_message_naming_file_and_host(tmp_path):
    missing = str(tmp_path / "no such" / "activate")
    done = subprocess.run(["sh", "-c", runners.venv_prelude(missing, "node-1") + "exec true"],
                          capture_output=True, text=True)
    assert done.returncode == 127
    assert done.stderr == f"crew: --venv_script {missing}: no such readable file on node-1\n"
    fix = runners.ssh_fix(done.stderr.splitlines(), "node-1", None)
    assert "--venv_script file is not at that path on node-1" in fix
    # pdsh and srun run one command for every node: the node names itself.
    done = subprocess.run(["sh", "-c", runners.venv_prelude(missing) + "exec true"], capture_output=True, text=True)
    assert done.stderr.endswith(f"no such readable file on {os.uname().nodename}\n")


# -------------------------------------------------------------------------------------------------
# the options: launcher choice, errors, notes

TWO_HOSTS = "worker-1 slots=1\nworker-2 slots=1\n"


def plan(capsys, folder: Path, *argv: str, hosts: str | None = TWO_HOSTS) -> tuple[int, dict | None, str]:
    hostfile = []
    if hosts:
        (folder / "hosts").write_text(hosts)
        hostfile = ["-H", str(folder / "hosts"), "--master_addr", "m"]
    code = cli.main(["plan", "--json", *hostfile, *argv, "t.py"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


@pytest.mark.parametrize("argv, words", [
    (["--no_ssh", "--launcher", "ssh", "--node_rank", "0"], ["--no_ssh and --launcher ssh", "Leave out one"]),
    (["--no_ssh"], ["--no_ssh needs --node_rank"]),
    (["--launcher", "ssh", "--launcher_args", "-u 5"], ["--launcher_args '-u 5'", "--ssh_args", "--launcher pdsh"]),
    (["--launcher_args", "-x 'a"], ["--launcher_args", "cannot be split", "quoting"]),
    (["--autotuning", "tune"], ["--autotuning tune", "not part of crew", "ds_config_optimal.json"]),
    (["--autotuning", "run"], ["--autotuning run", "DeepSpeed's own launcher"]),
])
def test_option_errors(here, capsys, argv, words):
    code, _, err = plan(capsys, here, *argv)
    assert code == 2 and err.startswith("crew: error: ") and "Traceback" not in err
    for word in words:
        assert word in err


def test_launcher_args_with_a_hostfile_and_no_launcher_mean_pdsh(here, capsys, monkeypatch):
    monkeypatch.setattr(runners.shutil, "which", lambda name: f"/usr/bin/{name}")
    code, data, err = plan(capsys, here, "--launcher_args", "-u 60")
    assert (code, data["launcher"]) == (0, "pdsh")
    assert data["nodes"][0]["command"][9:11] == ["-u", "60"]
    assert "crew: --launcher_args: starting the nodes with pdsh" in err


def test_launcher_args_on_one_local_node_are_ignored_with_a_word(here, capsys):
    code, data, err = plan(capsys, here, "--launcher_args", "-u 60", hosts=None)
    assert (code, data["launcher"]) == (0, "local")
    assert "--launcher_args ignored" in err and "60" not in data["nodes"][0]["command"]


def test_no_ssh_is_the_standalone_launcher_on_deepspeeds_port(here, capsys):
    code, data, err = plan(capsys, here, "--no_ssh", "--node_rank", "1")
    assert (code, data["launcher"], data["master_port"]) == (0, "standalone", 29500)
    assert data["nodes"][1]["command"][-1] == "1"  # this machine runs node 1
    assert "--no_ssh: master port 29500" in err


def test_venv_script_keeps_deepspeeds_python_and_is_not_sourced_locally(here, capsys):
    code, data, _ = plan(capsys, here, "--venv_script", "env/bin/activate")
    remote = data["nodes"][0]["command"][-1]
    flags = shlex.join(["-u", "-c", runners.entry(runners.AGENT_MODULE)])
    assert f". {here}/env/bin/activate; exec {shlex.quote(sys.executable)} {flags} " in remote
    code, data, _ = plan(capsys, here, "--venv_script", "env/bin/activate", "--python", "/opt/py")
    assert f" /opt/py {flags} " in data["nodes"][0]["command"][-1]
    code, data, err = plan(capsys, here, "--venv_script", "env/bin/activate", hosts=None)
    assert data["nodes"][0]["command"][0] == sys.executable
    assert "--venv_script env/bin/activate not sourced: the local launcher" in err


def test_bind_core_list_implies_binding_and_says_so(here, capsys):
    args = dsflags.log_level(cli.build_parser().parse_args(["plan", "--bind_core_list", "0-3", "t.py"]))
    from crew.launcher.plan.launch import job_spec, resolve

    launch = resolve(args)
    job = job_spec(launch, args)
    assert (job.bind_cores, job.bind_core_list, job.save_pid) == (True, "0-3", 0)
    assert ("info", "--bind_core_list 0-3: binding each rank to a block of these cores (--bind_cores_to_rank; "
            "DeepSpeed ignores the list without it)") in launch.notes
    args = cli.build_parser().parse_args(["plan", "--save_pid", "--bind_cores_to_rank", "t.py"])
    job = job_spec(resolve(args), args)
    assert (job.bind_cores, job.bind_core_list, job.save_pid) == (True, None, os.getpid())
    assert JobSpec.from_json(job.to_line()) == job


def test_pdsh_ssh_args_append_comes_first_in_every_ssh_connection(here, capsys, monkeypatch):
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-p 2200 -o 'ProxyCommand=nc %h %p'")
    code, data, _ = plan(capsys, here, "--ssh_args", "-F cfg")
    argv = data["nodes"][0]["command"]
    assert argv[argv.index("-p"):argv.index("-F")] == ["-p", "2200", "-o", "ProxyCommand=nc %h %p"]
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-o 'unclosed")
    code, _, err = plan(capsys, here)
    assert code == 2 and "PDSH_SSH_ARGS_APPEND" in err and "quoting" in err


def test_log_level_quiet_and_debug():
    parse = cli.build_parser().parse_args
    assert dsflags.log_level(parse(["plan", "-q"])).log_level == "error"
    assert dsflags.log_level(parse(["plan", "--log_level", "warning"])).verbose is False
    assert dsflags.log_level(parse(["plan", "--log-level", "debug"])).verbose is True
    with pytest.raises(SystemExit):
        parse(["plan", "--log_level", "loud"])


@pytest.mark.parametrize("level, shown", [("info", True), ("debug", True), ("warning", False), ("error", False)])
def test_console_info_lines_follow_the_level(level, shown):
    import io

    err = io.BytesIO()
    console = Console(io.BytesIO(), err, tty=False, level=level)
    console.info("the layout")
    console.say("rank 1 failed")
    assert err.getvalue() == (b"crew: the layout\n" if shown else b"") + b"crew: rank 1 failed\n"


# -------------------------------------------------------------------------------------------------
# end to end, on this machine

SHOW = """
    import json, os
    json.dump({"cpus": sorted(os.sched_getaffinity(0)), "omp": os.environ.get("OMP_NUM_THREADS")},
              open(f"rank{os.environ['RANK']}.json", "w"))
"""


@pytest.mark.skipif(len(binding.physical_cores(os.sched_getaffinity(0))) < 2, reason="needs two cores")
def test_bind_cores_to_rank_gives_each_rank_its_own_core(job_dir):
    write_script(job_dir, "show.py", SHOW)
    result = crew("run", "--num_gpus", "2", "--bind_cores_to_rank", "show.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = [json.loads((job_dir / f"rank{r}.json").read_text()) for r in range(2)]
    per_rank = len(binding.physical_cores(os.sched_getaffinity(0))) // 2
    assert [len(s["cpus"]) for s in seen] == [per_rank, per_rank]
    assert not set(seen[0]["cpus"]) & set(seen[1]["cpus"])
    assert [s["omp"] for s in seen] == [str(per_rank)] * 2
    assert "crew: cores per rank (--bind_cores_to_rank): localhost " in result.err


def test_save_pid_file_holds_the_agent_while_it_runs_and_goes_after(job_dir):
    write_script(job_dir, "pid.py", """
        import json, os, sys
        agent = os.getppid()
        crew_pid = int(open(f"/proc/{agent}/stat").read().rsplit(")", 1)[1].split()[1])
        json.dump({"agent": agent, "crew": crew_pid, "file": open(f"/tmp/{crew_pid}.deepspeed").read()},
                  open("seen.json", "w"))
        sys.exit(3)  # the failure path removes it too
    """)
    result = crew("run", "--save_pid", "pid.py", cwd=job_dir)
    assert result.code == 3, result.err
    seen = json.loads((job_dir / "seen.json").read_text())
    assert seen["file"] == str(seen["agent"])
    assert f"launcher pid: {seen['agent']}\n" in result.out
    assert not Path(f"/tmp/{seen['crew']}.deepspeed").exists()


def test_quiet_hides_crews_informational_lines_not_the_ranks(job_dir):
    write_script(job_dir, "hello.py", "print('hello from', __import__('os').environ['RANK'])\n")
    result = crew("run", "-q", "--num_gpus", "2", "hello.py", cwd=job_dir)
    assert result.code == 0, result.err
    assert "hello from 0" in result.out and "hello from 1" in result.out
    assert "rank(s) on" not in result.err and "started in" not in result.err and "node 0:" not in result.err
    write_script(job_dir, "fail.py", "raise SystemExit('it broke')\n")
    result = crew("run", "-q", "fail.py", cwd=job_dir)
    assert result.code == 1 and "exited with code 1 (first failure)" in result.err


def test_no_ssh_runs_this_node_as_standalone(job_dir):
    write_script(job_dir, "show.py", SHOW)
    port = str(free_port("127.0.0.1"))
    result = crew("run", "--no_ssh", "--node_rank", "0", "--num_gpus", "2", "--master_port", port,
                  "--no_ssh_check", "show.py", cwd=job_dir)
    assert result.code == 0, result.err
    assert "launcher standalone" in result.err
    assert sorted(p.name for p in job_dir.glob("rank*.json")) == ["rank0.json", "rank1.json"]


# -------------------------------------------------------------------------------------------------
# end to end, over the loopback ssh nodes

def test_venv_script_is_sourced_on_every_node(cluster, job_dir):
    venv = job_dir / "my venv" / "activate"
    venv.parent.mkdir()
    venv.write_text(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"\n{VENV_BODY}")
    write_script(job_dir, "show.py", """
        import os, sys
        print("venv:", os.environ.get("FROM_VENV"), "python:", sys.executable)
    """)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                  "--venv_script", str(venv), "--python", "python3", "show.py", cwd=job_dir)
    assert result.code == 0, result.err
    python = Path(sys.executable).parent / "python3"  # the one the script put first on PATH
    assert ranks_saying(result.out, f'venv: sourced; "ok" python: {python}') == [0, 1], result.out


def test_missing_venv_script_says_which_file_on_which_node(cluster, job_dir):
    write_script(job_dir, "show.py", "print('never')\n")
    missing = job_dir / "nowhere" / "activate"
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                  "--venv_script", str(missing), "show.py", cwd=job_dir)
    assert result.code != 0
    assert f"--venv_script {missing}: no such readable file on 127.0.0.2" in result.err
    assert "--venv_script file is not at that path" in result.err
    assert "interpreter is missing" not in result.err and "never" not in result.out


def test_pdsh_ssh_args_append_reaches_the_ssh_runner(cluster, job_dir):
    config = job_dir / "ssh_config_no_port"
    config.write_text("".join(line for line in cluster.config.read_text().splitlines(keepends=True)
                              if not line.strip().startswith("Port ")))
    write_script(job_dir, "hello.py", "print('hello from', __import__('os').environ['CREW_HOST'])\n")
    hostfile = cluster.hostfile(slots=1, with_port=False)
    result = crew("run", "--ssh_args", f"-F {config}", "-H", str(hostfile), "hello.py",
                  cwd=job_dir, env={"PDSH_SSH_ARGS_APPEND": f"-p {cluster.port}"})
    assert result.code == 0, result.err
    assert "hello from 127.0.0.2" in result.out and "hello from 127.0.0.3" in result.out


@pytest.mark.skipif(not shutil.which("pdsh"), reason="pdsh not installed (apt-get install pdsh)")
def test_launcher_args_reach_pdsh(cluster, job_dir):
    write_script(job_dir, "hello.py", "print('hello from', __import__('os').environ['CREW_HOST'])\n")
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                  "--launcher_args", "-u 60", "hello.py", cwd=job_dir)
    assert result.code == 0, result.err
    assert "starting the nodes with pdsh" in result.err and "launcher pdsh" in result.err
    assert "hello from 127.0.0.2" in result.out and "hello from 127.0.0.3" in result.out


# -------------------------------------------------------------------------------------------------
# end to end, under Slurm (tests/slurmcluster.py: two nodes on this machine)

@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    import slurmcluster

    if reason := slurmcluster.slurm_missing_reason():
        pytest.skip(reason)
    nodes = slurmcluster.start_cluster(tmp_path_factory.mktemp("slurm"), nodes=2, loopback_names=True)
    yield nodes
    nodes.stop()


def test_srun_sources_the_venv_script_and_takes_launcher_args(slurm_cluster, job_dir):
    from conftest import crew_command

    venv = job_dir / "my venv" / "activate"
    venv.parent.mkdir()
    venv.write_text(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"\n{VENV_BODY}")
    write_script(job_dir, "show.py", """
        import os
        print("venv:", os.environ.get("FROM_VENV"), "job name:", os.environ.get("SLURM_JOB_NAME"))
    """)
    argv = ["salloc", "--quiet", "-N2", *crew_command("run", "--venv_script", str(venv), "--launcher_args",
                                                       "--job-name 'crew step'", "show.py")]
    done = subprocess.run(argv, cwd=job_dir, env=slurm_cluster.env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert ranks_saying(done.stdout, 'venv: sourced; "ok" job name: crew step') == [0, 1], done.stdout
