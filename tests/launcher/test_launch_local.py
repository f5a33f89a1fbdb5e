"""`crew run` on this machine: real processes through the local runner and the node agent."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import tempfile
import time

import pytest
from conftest import STEPPER, crew, start_crew, wait_for_file, wait_until_gone, write_script

ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "CREW_HOST"]

ENV_DUMP = f"""
    import json, os, sys
    seen = {{k: os.environ.get(k) for k in {ENV_KEYS!r} + sys.argv[1:2]}}
    seen["argv"] = sys.argv[1:]
    with open(f"rank{{os.environ['RANK']}}.json", "w") as f:
        json.dump(seen, f)
"""

def read_ranks(folder, world_size):
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_rank_sees_the_torchrun_environment(job_dir, world_size):
    write_script(job_dir, "dump.py", ENV_DUMP)
    result = crew("run", "--num_gpus", str(world_size), "dump.py", "--flag", cwd=job_dir)
    assert result.code == 0, result.err
    seen = read_ranks(job_dir, world_size)
    threads = str(max(1, len(os.sched_getaffinity(0)) // world_size))
    for rank, env in enumerate(seen):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["NODE_RANK"] == env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(world_size)))
        assert env["OMP_NUM_THREADS"] == threads
        assert env["argv"] == [f"--local_rank={rank}", "--flag"]
    assert len({env["MASTER_PORT"] for env in seen}) == 1
    assert "master 127.0.0.1:" + seen[0]["MASTER_PORT"] in result.err


def test_no_local_rank_and_user_omp_threads_are_respected(job_dir):
    write_script(job_dir, "dump.py", ENV_DUMP)
    result = crew("run", "--num_gpus", "2", "--no_local_rank", "dump.py", "x", cwd=job_dir,
                  env={"OMP_NUM_THREADS": "3"})
    assert result.code == 0, result.err
    for env in read_ranks(job_dir, 2):
        assert env["argv"] == ["x"]
        assert env["OMP_NUM_THREADS"] == "3"


def test_module_and_executable_modes(job_dir):
    write_script(job_dir, "dumpmod.py", ENV_DUMP)
    assert crew("run", "--module", "--no_local_rank", "dumpmod", cwd=job_dir).code == 0
    assert read_ranks(job_dir, 1)[0]["argv"] == []
    (job_dir / "rank0.json").unlink()
    tool = write_script(job_dir, "tool.sh", '#!/bin/sh\necho "$RANK $*" > rank$RANK.txt\n')
    tool.chmod(0o755)
    assert crew("run", "--no_python", "--num_gpus", "2", "./tool.sh", "a b", cwd=job_dir).code == 0
    assert (job_dir / "rank1.txt").read_text() == "1 --local_rank=1 a b\n"


def test_output_lines_are_prefixed_and_never_interleaved(job_dir):
    write_script(job_dir, "chatty.py", """
        import os, sys
        mark = "ab"[int(os.environ["RANK"])]
        for i in range(300):
            sys.stdout.write(mark * 5000 + "\\n")
            sys.stderr.write(f"err {mark} {i}\\n")
        sys.stdout.write(f"tail {mark} without newline")           # each rank's own: not merged
    """)
    result = crew("run", "--num_gpus", "2", "chatty.py", cwd=job_dir)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    whole = re.compile(r"\[localhost:(\d)\] (a{5000}|b{5000}|tail [ab] without newline)")
    assert all(whole.fullmatch(line) for line in lines), "a line was split or interleaved"
    assert sum(line.endswith("without newline") for line in lines) == 2
    for rank, mark in ((0, "a"), (1, "b")):
        assert sum(line == f"[localhost:{rank}] {mark * 5000}" for line in lines) == 300
        assert f"[localhost:{rank}] err {mark} 299" in result.err.splitlines()


def test_a_progress_bar_in_a_file_shows_an_early_and_its_final_state(job_dir):
    write_script(job_dir, "bar.py", """
        import sys
        for i in range(3):
            sys.stderr.write(f"\\r{i}/3 |{'#' * i}")
        sys.stderr.write("\\n")
    """)
    result = crew("run", "bar.py", cwd=job_dir)  # one update every 30 s at most (test_console_run.py)
    assert result.code == 0
    bar = [line for line in result.err.splitlines() if "/3 |" in line]
    # an early state (of the updates it reads at once, the agent sends the newest) and the final one
    assert bar[-1] == "[localhost:0] 2/3 |##" and len(bar) <= 2, bar


def test_log_dir_gets_one_file_per_rank_and_the_closing_line_says_where_results_went(job_dir):
    write_script(job_dir, "hello.py", """
        import os, sys
        from crew import outputs  # what the engine calls on rank 0 when it saves or opens a monitor
        print("hello from", os.environ["RANK"])
        print("warn from", os.environ["RANK"], file=sys.stderr)
        outputs.report("checkpoint", f"ckpt{os.environ['RANK']}", tag="global_step3")
        outputs.report("monitor", "runs/demo", writer="csv_monitor")
    """)
    result = crew("run", "--num_gpus", "2", "--log_dir", "logs", "hello.py", cwd=job_dir)
    assert result.code == 0, result.err
    for rank in range(2):
        text = (job_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"hello from {rank}\n" in text and f"warn from {rank}\n" in text
        assert "[localhost" not in text
    last = result.err.strip().splitlines()[-1]
    assert re.fullmatch(r"crew: job \w+ succeeded · 2 ranks on 1 node · \d+\.\d s · checkpoint ckpt0/global_step3 · "
                        r"curves runs/demo \(crew plot runs/demo\) · rank logs logs/", last), last
    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    assert [(o["kind"], o["path"], o["host"]) for o in record["outputs"]] == [
        ("monitor", str(job_dir / "runs" / "demo"), "localhost"), ("checkpoint", str(job_dir / "ckpt0"), "localhost")]
    job_id = last.split()[2]
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"crew-{job_id}-*.outputs")) == []  # the agent removed it


def test_first_failure_stops_all_ranks_and_is_reported(job_dir):
    write_script(job_dir, "step.py", STEPPER)
    result = crew("run", "--num_gpus", "4", "--log_dir", "logs", "step.py", cwd=job_dir,
                  env={"FAIL_RANK": "2"})
    assert result.code == 7
    assert result.seconds < 10, "the healthy ranks (30 s of work) were not stopped"
    assert "localhost rank 2 (local 2) exited with code 7 (first failure)" in result.err
    assert "fatal: rank 2 gives up at step 3" in result.err.split("first failure")[1]
    assert "logs/rank2.log" in result.err
    assert re.match(r"crew: job \w+ failed \(exit code 7; rank 2 on localhost failed first\) · 4 ranks on 1 node",
                    result.err.strip().splitlines()[-1])


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(job_dir):
    write_script(job_dir, "stubborn.py", """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
        open(f"started{os.environ['RANK']}", "w").close()
        if os.environ["RANK"] == "1":
            while not os.path.exists("started0"):
                time.sleep(0.05)
            sys.exit(3)
        time.sleep(120)
    """)
    result = crew("run", "--num_gpus", "2", "stubborn.py", cwd=job_dir)
    assert result.code == 3
    assert "[localhost:0] ignoring SIGTERM" in result.out
    assert result.seconds < 30


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_crew_run_stops_everything(job_dir, sig, code):
    write_script(job_dir, "step.py", STEPPER)
    proc = start_crew("run", "--num_gpus", "2", "--log_dir", "logs", "step.py", cwd=job_dir)
    wait_for_file(job_dir / "started1")
    wait_for_file(job_dir / "started0")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code
    assert f"{sig.name} received: stopping every rank" in err
    assert not wait_until_gone(job_dir, timeout=5)
    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    assert (record["status"], record["exit_code"], record["first_failure"]) == ("interrupted", code, None)


def test_sigkill_to_crew_run_leaves_nothing_running(job_dir):
    write_script(job_dir, "step.py", STEPPER)
    proc = start_crew("run", "--num_gpus", "2", "step.py", cwd=job_dir)
    wait_for_file(job_dir / "started1")
    wait_for_file(job_dir / "started0")
    proc.kill()
    proc.wait(timeout=10)
    assert not wait_until_gone(job_dir, timeout=15)


def test_max_restarts_reruns_the_job_after_a_failure(job_dir):
    write_script(job_dir, "flaky.py", """
        import os, sys
        print("attempt", os.environ["CREW_RESTART_COUNT"])
        sys.exit(5 if os.environ["CREW_RESTART_COUNT"] == "0" else 0)
    """)
    result = crew("run", "--max_restarts", "2", "flaky.py", cwd=job_dir)
    assert result.code == 0
    assert "[localhost:0] attempt 0" in result.out and "[localhost:0] attempt 1" in result.out
    assert "restarting the job (1 of 2)" in result.err
    assert crew("run", "--max_restarts", "0", "flaky.py", cwd=job_dir).code == 5


def test_deepspeed_env_values_arrive_literally(job_dir):
    marker = job_dir / "INJECTED"
    (job_dir / ".deepspeed_env").write_text(
        f"TRICKY=it's \"quoted\" $(touch {marker}) `touch {marker}`; x\nSPACED=a  b\n")
    write_script(job_dir, "show.py", """
        import json, os
        json.dump({k: os.environ[k] for k in ("TRICKY", "SPACED", "FROM_FLAG")}, open("env.json", "w"))
    """)
    result = crew("run", "--env", "FROM_FLAG=$(x) y", "show.py", cwd=job_dir)
    assert result.code == 0, result.err
    seen = json.loads((job_dir / "env.json").read_text())
    assert seen == {"TRICKY": f"it's \"quoted\" $(touch {marker}) `touch {marker}`; x",
                    "SPACED": "a  b", "FROM_FLAG": "$(x) y"}
    assert not marker.exists()


@pytest.mark.parametrize("args, expected", [
    (["run", "missing.py"], "script missing.py not found"),
    (["run", "-H", "nohosts", "x.py"], "hostfile nohosts not found (--hostfile)"),
    (["run", "--master_addr", "10.1.1.1:2222", "x.py"], "its port is --master_port"),
    (["run", "--include", "localhost:0", "--exclude", "localhost:1", "x.py"], "cannot be used together"),
    (["run", "--num_nodes", "2", "x.py"], "needs a --hostfile"),
    (["run", "--launcher", "standalone", "x.py"], "needs --node_rank"),
    (["run"], "name the training script"),
])
def test_bad_input_is_one_clear_line_not_a_traceback(job_dir, args, expected):
    result = crew(*args, cwd=job_dir)
    assert result.code == 2
    assert expected in result.err
    assert "Traceback" not in result.err


@pytest.mark.parametrize("args, expected", [
    (["--max_restarts", "-1"], "--max_restarts: '-1' is not a whole number >= 0"),
    (["--ssh_port", "70000"], "--ssh_port: '70000' is not a port number (1-65535)"),
    (["--master_port", "0"], "--master_port: '0' is not a port number (1-65535)"),
    (["--init_timeout", "-5"], "--init_timeout: '-5' is not a number of seconds >= 0 (0 turns the check off)"),
    (["--init_timeout", "ten"], "--init_timeout: 'ten' is not a number of seconds >= 0"),
])
def test_numeric_options_are_checked(job_dir, args, expected):
    result = crew("run", *args, "x.py", cwd=job_dir)
    assert result.code == 2 and expected in result.err and "Traceback" not in result.err


def test_a_successful_job_exits_promptly(job_dir):
    write_script(job_dir, "quick.py", "print('done')\n")
    result = crew("run", "--num_gpus", "2", "quick.py", cwd=job_dir)
    assert result.code == 0
    assert result.seconds < 3, f"crew run lingered: {result.seconds:.1f}s for a no-op job"


def test_master_port_in_use_is_reported_before_ranks_start(job_dir):
    import socket
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        write_script(job_dir, "never.py", "open('ran', 'w').close()\n")
        result = crew("run", "--master_port", str(port), "never.py", cwd=job_dir)
    assert result.code == 1
    assert f"master port {port} is already in use on localhost" in result.err
    assert not (job_dir / "ran").exists()


def test_plan_prints_the_layout_without_starting_anything(job_dir):
    started = time.monotonic()
    result = crew("plan", "--num_gpus", "2", "--json", cwd=job_dir)
    assert result.code == 0
    plan = json.loads(result.out)
    assert plan["world_size"] == 2 and plan["nodes"][0]["ranks"] == [0, 1]
    assert time.monotonic() - started < 2


def test_an_agent_that_cannot_be_started_is_reported_not_a_traceback(job_dir):
    write_script(job_dir, "quick.py", "print('never')\n")
    result = crew("run", "--python", str(job_dir / "no-such-python"), "quick.py", cwd=job_dir)
    assert result.code == 127
    assert "localhost: cannot start" in result.err and "no-such-python" in result.err
    assert "Traceback" not in result.err
