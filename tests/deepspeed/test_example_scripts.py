"""DeepSpeed example scripts, unchanged in their shape (tests/deepspeed/scripts/, origins noted in each),
run by `crew run --as_deepspeed` on 2 CPU ranks at ZeRO stages 0 and 3: they train, and resume (each
resuming script at one stage, the two stages between them). The cifar10 script's two stages run in one job."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import REPO, crew, wait_until_gone
from runs_in_turn import split_runs

SCRIPTS = REPO / "tests" / "deepspeed" / "scripts"
RUNNER = REPO / "tests" / "runs_in_turn.py"


@pytest.fixture(scope="module")
def cifar10_runs(tmp_path_factory):
    """The cifar10 script at stages 0 and 3, one after the other in one job (runs_in_turn.py: one start of the
    ranks instead of two): the job's result and each run's output lines and failure."""
    folder = tmp_path_factory.mktemp("cifar10")
    script = str(SCRIPTS / "cifar10_style.py")
    runs = {f"stage{stage}": [script, "--deepspeed", "--stage", str(stage)] for stage in (0, 3)}
    (folder / "runs.json").write_text(json.dumps(runs))
    # DeepSpeedExamples' run_ds.sh: `deepspeed --bind_cores_to_rank cifar10_deepspeed.py --deepspeed $@`
    job = crew("run", "--num_gpus", "2", "--as_deepspeed", "--bind_cores_to_rank", str(RUNNER), "runs.json",
               cwd=folder, timeout=240)
    left = wait_until_gone(folder, timeout=15)
    assert not left, f"processes left running after the job: {left}"
    return job, split_runs(job.out, runs)


@pytest.mark.parametrize("stage", [0, 3])
def test_cifar10_script_trains(cifar10_runs, stage):
    job, runs = cifar10_runs
    out, failed = runs[f"stage{stage}"]
    assert job.code == 0 and not failed, job.out[-3000:] + job.err[-3000:]
    assert "cores per rank (--bind_cores_to_rank): localhost 0|1" in job.err
    losses = [float(x) for x in re.findall(r"\] \[\s*\d+,\s+\d+\] loss:\s+([0-9.]+)", out)]
    assert len(losses) == 6 and losses[-1] < losses[0] * 0.7, out
    assert "Accuracy of the network on the 40 test images" in out
    assert "final steps 64" in out  # 2 epochs x 512 samples / 16


@pytest.mark.parametrize("stage", [0])  # stage 3 resumes in the hello_deepspeed script's test
def test_getting_started_script_trains_and_resumes_from_its_client_state(job_dir, stage):
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 0.02}}, "zero_optimization": {"stage": stage}}
    (job_dir / "ds_config.json").write_text(json.dumps(config))
    script = shutil.copy(SCRIPTS / "getting_started_style.py", job_dir)
    args = ["run", "--num_gpus", "2", "--as_deepspeed", script, "--deepspeed", "--deepspeed_config",
            "ds_config.json"]
    whole = crew(*args, cwd=job_dir)
    assert whole.code == 0, whole.err
    uninterrupted = json.loads((job_dir / "losses0.json").read_text())
    assert sum(uninterrupted[-10:]) < sum(uninterrupted[:10]) / 3  # it learns
    resumed = crew(*args, "--load_dir", "ckpt", "--ckpt_id", "step20", cwd=job_dir)
    assert resumed.code == 0, resumed.err
    assert json.loads((job_dir / "losses0.json").read_text()) == uninterrupted[20:]  # exactly, unchanged


def _per_step_losses(rows: list[dict]) -> list[float]:
    """Each step's loss from one run's `Train/loss` scalars, logged every step: the script logs the mean
    of all its losses so far (np.mean(losses)), so step n's loss is n * mean_n - (n - 1) * mean_(n-1)."""
    means = [row["value"] for row in rows]
    return [n * mean - (n - 1) * previous for n, (mean, previous) in enumerate(zip(means, [0.0, *means]), 1)]


@pytest.mark.parametrize("stage", [3])  # stage 0 resumes in the getting-started script's test
def test_hello_deepspeed_script_trains_and_resumes_from_its_checkpoint_step(job_dir, stage):
    script = str(SCRIPTS / "hello_deepspeed_style.py")
    args = ["run", "--num_gpus", "2", "--as_deepspeed", script, "--zero_stage", str(stage), "--log_every", "1"]
    first = crew(*args, "--checkpoint_dir", "ckpts", "--num_iterations", "40", cwd=job_dir)
    assert first.code == 0, first.err
    [exp_dir] = (job_dir / "ckpts").glob("bert_pretrain.*")  # one experiment folder, for both ranks
    assert json.loads((exp_dir / "hparams.json").read_text())["num_iterations"] == 40
    scalars = exp_dir / "tb_dir" / "scalars.jsonl"
    rows = [json.loads(line) for line in scalars.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 40))  # its loop: steps 1..num_iterations-1
    losses = _per_step_losses(rows)
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:5]) / 5, losses  # it learns
    assert (first.out + first.err).count("Saved model to") == 3, first.out  # steps 10, 20, 30
    assert (exp_dir / "latest").read_text().strip() == "global_step30"

    # resume: client_state['checkpoint_step'] 30 from `latest`, so steps 31..49 (num_iterations 50)
    resumed = crew(*args, "--load_checkpoint_dir", str(exp_dir), "--num_iterations", "50", cwd=job_dir)
    assert resumed.code == 0, resumed.err
    assert "Loading from Experiment Directory" in resumed.out + resumed.err
    rows_after = [json.loads(line) for line in scalars.read_text().splitlines()][len(rows):]
    assert [row["step"] for row in rows_after] == list(range(31, 50))
    resumed_losses = _per_step_losses(rows_after)
    # the trained weights came back: it goes on near where it was, not from the untrained start
    assert sum(resumed_losses[:5]) / 5 < 0.75 * sum(losses[:5]) / 5, resumed_losses
    # and the engine's step counter too: the step-40 save is tag global_step40 (30 loaded + 10)
    assert (exp_dir / "latest").read_text().strip() == "global_step40"
    assert (exp_dir / "global_step40").is_dir()
