"""Preemption: SIGUSR1/SIGTERM to `crew run` (or scancel --signal=USR1 --batch to an sbatch job) -> the ranks
finish their step, save, exit 75; the same command resumes with exactly the losses of an uninterrupted run.
Real ranks over gloo, crew's own launcher, and the one-machine Slurm cluster of tests/slurmcluster.py."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import pytest
import slurmcluster
from conftest import crew, crew_command, start_crew, wait_for_file, write_script
from dist import run_ranks

from crew.errors import PREEMPTED_EXIT_CODE, PREEMPTED_MARK
from crew.launcher.job import preempt
from crew.launcher.transport.proc import children

# crew's loader with resume_data_position, load_checkpoint at the start, `while global_steps < N`; a first save
# at step 2 (its folder is where a preemption saves); rank 0 marks step --mark_at, after which the steps of a
# run that did not resume are slow enough for a test to signal mid-run.
TRAIN = """
    import argparse, json, time
    import torch
    import crew

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--mark_at", type=int, default=3)
    crew.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, _, loader, _ = crew.initialize(args=args, model=model, model_parameters=model.parameters(),
                                           training_data=data)
    path, client_state = engine.load_checkpoint("ckpt")
    print("resumed from", path, "client_state", client_state, flush=True)
    loss = None
    while engine.global_steps < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            if engine.global_steps == before:
                continue
            if engine.global_steps == 2:
                engine.save_checkpoint("ckpt", client_state={"saved_at": 2})
            if engine.global_steps == args.mark_at and engine.global_rank == 0:
                open("reached", "w").close()
            if engine.global_steps >= args.mark_at and path is None:
                time.sleep(0.15)
            if engine.global_steps >= args.steps:
                break
    with open(f"final{engine.global_rank}.json", "w") as out:
        json.dump({"loss": loss.item(), "steps": engine.global_steps}, out)
"""

# 2 ranks x 24 samples: 6 micro batches, 3 optimizer steps per epoch; 24 steps cross 8 epochs
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "checkpoint": {"resume_data_position": True}}
PREEMPTION = {"preemption": {"enabled": True}}


def prepare(folder: Path, config: dict) -> list[str]:
    """The script and config in `folder`; the arguments of `crew run` for them (2 local ranks)."""
    write_script(folder, "train.py", TRAIN)
    (folder / "ds.json").write_text(json.dumps(config))
    return ["train.py", "--deepspeed_config", "ds.json"]


def finals(folder: Path) -> list[dict]:
    return [json.loads((folder / f"final{rank}.json").read_text()) for rank in range(2)]


def saved_tags(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "ckpt").iterdir() if p.is_dir())


def _train(rank: int, folder: str, args: list[str]) -> None:
    """The script, run as crew run's rank `rank` would run it (its folder, its arguments, --local_rank)."""
    os.chdir(folder)
    sys.argv = [args[0], *args[1:], f"--local_rank={rank}"]
    runpy.run_path(args[0], run_name="__main__")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """Each rank's final loss when nothing interrupts the run (the marker changes only the pace). Only numbers to
    compare with: the ranks fork from run_ranks's server (one thread each, as crew run's on this machine)
    instead of starting a crew job; the tests that signal crew run start their own."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    run_ranks(_train, 2, str(folder), [*prepare(folder, {**CONFIG, **PREEMPTION}), "--mark_at", "99"])
    return finals(folder)


def signal_at_mark(folder: Path, args: list[str], sig: signal.Signals, log_dir: str = "logs"):
    proc = start_crew("run", "--num_gpus", "2", "--log_dir", log_dir, *args, cwd=folder)
    try:
        wait_for_file(folder / "reached", timeout=60)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def test_signal_saves_exits_75_and_the_same_command_resumes_exactly(job_dir, uninterrupted):
    args = prepare(job_dir, {**CONFIG, **PREEMPTION})
    code, out, err = signal_at_mark(job_dir, args, signal.SIGUSR1)
    assert code == PREEMPTED_EXIT_CODE, out + err
    tags = saved_tags(job_dir)
    assert len(tags) == 2 and tags[0] == "global_step2", tags  # the script's save and the preemption's
    step = int(tags[1].removeprefix("global_step"))
    assert 3 <= step < 24
    assert (job_dir / "ckpt" / "latest").read_text() == tags[1]
    assert f"crew: preempted: a checkpoint was saved in {job_dir / 'ckpt' / tags[1]}; the same command resumes " \
           "(exit code 75)." in err
    assert "crew: SIGTERM received: finishing this optimizer step, then saving a checkpoint" in out + err
    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    assert (record["status"], record["exit_code"]) == ("preempted", 75)
    assert not (job_dir / "final0.json").exists()

    again = crew("run", "--num_gpus", "2", *args, cwd=job_dir)
    assert again.code == 0, again.out + again.err
    assert f"resumed from {job_dir / 'ckpt' / tags[1]} client_state {{'saved_at': 2}}" in again.out
    assert finals(job_dir) == uninterrupted


def test_without_the_key_a_signal_stops_the_ranks_as_before(job_dir):
    code, out, err = signal_at_mark(job_dir, prepare(job_dir, CONFIG), signal.SIGTERM)
    assert code == 143, out + err
    assert saved_tags(job_dir) == ["global_step2"]
    assert "no checkpoint was saved: the ranks stopped at once on SIGTERM: their config does not enable" in err
    assert "finishing this optimizer step" not in out + err
    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    assert (record["status"], record["exit_code"]) == ("interrupted", 143)


# -- an sbatch job on the one-machine Slurm cluster -------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurmcluster.slurm_missing_reason()
    if reason:
        pytest.skip(reason)
    # a requeued job starts again some 2 minutes later by Slurm's defaults; here 9 s
    nodes = slurmcluster.start_cluster(tmp_path_factory.mktemp("slurm"), nodes=2, loopback_names=True,
                                       requeue_wait=8)
    yield nodes
    nodes.stop()


def test_sbatch_job_signalled_is_requeued_and_resumes_exactly(cluster, job_dir, uninterrupted):
    args = prepare(job_dir, {**CONFIG, **PREEMPTION})
    script = write_script(job_dir, "job.sh", f"""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        #SBATCH --requeue
        #SBATCH --signal=B:USR1@120
        #SBATCH --open-mode=append
        echo "start $SLURM_RESTART_COUNT"
        exec {" ".join(crew_command("run", "--num_gpus", "1", *args))}
        """)
    submitted = cluster.run("sbatch", "--parsable", "-o", str(job_dir / "job.out"), str(script), cwd=job_dir)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        wait_for_file(job_dir / "reached", timeout=60)
        # what --signal=B:USR1@120 sends before the time limit: USR1 to the batch shell, which `exec` made crew
        signalled = cluster.run("scancel", "--signal=USR1", "--batch", job)
        assert signalled.returncode == 0, signalled.stderr
        wait_for_file(job_dir / "final1.json", timeout=90)
        wait_for_file(job_dir / "final0.json", timeout=10)
        deadline = time.monotonic() + 15  # the job's output is whole once crew, its batch step, has ended
        while cluster.run("squeue", "-h", "-j", job).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        output = (job_dir / "job.out").read_text() if (job_dir / "job.out").exists() else ""
        print(output)
    tags = saved_tags(job_dir)
    assert len(tags) == 2, (tags, output)
    assert "start \n" in output or "start 0" in output
    assert "start 1" in output, output
    assert f"preempted: a checkpoint was saved in {job_dir / 'ckpt' / tags[1]}" in output
    assert f"requeueing Slurm job {job}" in output
    assert f"resumed from {job_dir / 'ckpt' / tags[1]}" in output
    assert finals(job_dir) == uninterrupted
    assert not cluster.run("squeue", "-h", "-j", job).stdout.strip()


# -- the agents' side, with ranks that need no torch ---------------------------------------------------------

# A rank with a helper process in its group (as a DataLoader worker): on SIGTERM it says whether the helper
# was spared, rank 0 says where it "saved", and it exits 75.
STUB_RANK = f"""
    import os, signal, subprocess, sys, time
    rank = os.environ["RANK"]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    def on_notice(number, frame):
        print("helper alive at the notice:", helper.poll() is None, flush=True)
        helper.kill()
        if rank == "0":
            print({PREEMPTED_MARK!r} + "/data/ckpt/global_step7", file=sys.stderr, flush=True)
        sys.exit({PREEMPTED_EXIT_CODE})
    signal.signal(signal.SIGTERM, on_notice)
    open(f"started{{rank}}", "w").close()
    time.sleep(60)
"""


def test_an_agent_signalled_passes_the_notice_to_every_rank_process_alone(job_dir):
    write_script(job_dir, "stub.py", STUB_RANK)
    proc = start_crew("run", "--num_gpus", "2", "--log_dir", "logs", "stub.py", cwd=job_dir)
    try:
        for rank in range(2):
            wait_for_file(job_dir / f"started{rank}", timeout=30)
        (agent,) = [pid for pid in children(proc.pid) if b"crew.launcher.node.agent" in cmdline(pid)]
        os.kill(agent, signal.SIGUSR1)  # as Slurm's --signal=USR1@N without B: signals the step's tasks
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == PREEMPTED_EXIT_CODE, out + err
    assert "crew: preemption notice (localhost: SIGUSR1 to the crew agent): passing it to every node." in err
    assert "helper alive at the notice: True" in out and "False" not in out
    assert "crew: preempted: a checkpoint was saved in /data/ckpt/global_step7; the same command resumes" in err
    assert json.loads((job_dir / "logs" / "crew_job.json").read_text())["status"] == "preempted"


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_closing_line_says_what_happened():
    saved = preempt.closing_line({0: 75, 1: 75}, "/c/global_step9", 120)
    assert saved == "preempted: a checkpoint was saved in /c/global_step9; the same command resumes (exit code 75)."
    assert "did not finish their step and save within 30s and were killed; give them longer with " \
           "--preempt_grace" in preempt.closing_line({0: -9, 1: -9}, None, 30)
    assert "their config does not enable crew's preemption" in preempt.closing_line({0: -15}, None, 120)
    assert "their output above says why" in preempt.closing_line({0: 1, 1: 143}, None, 120)
    assert "stopped before its ranks started" in preempt.closing_line({}, None, 120)
    assert [preempt.exit_code(c) for c in ({0: 75, 1: 143}, {0: 143}, {})] == [75, 143, 143]


def fake_scontrol(folder: Path, requeue: int, refuse: str = "") -> dict[str, str]:
    """A `scontrol` on PATH that shows a job with Requeue=`requeue` and logs its calls; `refuse`: what it
    says (exit 1) to `requeue`."""
    script = folder / "scontrol"
    script.write_text(f"""#!/bin/sh
echo "$@" >> {folder}/calls
if [ "$1" = show ]; then echo "JobId=$4 JobName=job.sh Requeue={requeue} Restarts=0"; exit 0; fi
if [ -n "{refuse}" ]; then echo "{refuse}" >&2; exit 1; fi
""")
    script.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


@pytest.mark.parametrize("requeue, refuse, said", [
    (1, "", "requeueing Slurm job 42 (scontrol requeue 42): it starts again, and the same command resumes."),
    (0, "", "Slurm job 42 may not be requeued (Requeue=0): resubmit the batch script to continue, or add "
            "`#SBATCH --requeue`"),
    (1, "Requested operation is presently disabled", "scontrol requeue 42 failed: Requested operation is "
                                                      "presently disabled. Resubmit the batch script"),
])
def test_requeue_in_a_batch_job(tmp_path, monkeypatch, requeue, refuse, said):
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, requeue, refuse)["PATH"])
    lines: list[str] = []
    preempt.requeue_slurm_job(lines.append, {"SLURM_JOB_ID": "42", "ENVIRONMENT": "BATCH"})
    assert any(said in line for line in lines), lines
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["show job --oneliner 42", *(["requeue 42"] if requeue else [])]
    lines.clear()
    preempt.requeue_slurm_job(lines.append, {"SLURM_JOB_ID": "42"})  # salloc: an interactive job, left alone
    assert lines == [] and len((tmp_path / "calls").read_text().splitlines()) == len(calls)


def test_ranks_that_do_not_save_within_the_grace_are_killed(job_dir):
    write_script(job_dir, "stubborn.py", """
        import os, signal, time
        signal.signal(signal.SIGTERM, lambda *_: print("still working", flush=True))
        open(f"started{os.environ['RANK']}", "w").close()
        time.sleep(60)
    """)
    proc = start_crew("run", "--num_gpus", "2", "--preempt_grace", "1", "stubborn.py", cwd=job_dir)
    try:
        for rank in range(2):
            wait_for_file(job_dir / f"started{rank}", timeout=30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, out + err
    assert 1 <= time.monotonic() - started < 10
    assert "still working" in out
    assert "preempted: no checkpoint was saved: the ranks did not finish their step and save within 1s and were " \
           "killed; give them longer with --preempt_grace SECONDS." in err
