"""DeepSpeed's monitors (crew/runtime/monitor.py): csv_monitor and TensorBoard files written by rank 0
of two real gloo ranks, read back and checked against the engine's own loss and lr."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from dist import run_ranks

from crew.errors import ConfigError

MICRO, ACCUMULATION, STEPS, PRINT_EVERY = 4, 2, 7, 3  # 7 steps: the last one is written at exit
GLOBAL = MICRO * ACCUMULATION * 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def monitored(folder: str, job: str, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "steps_per_print": PRINT_EVERY, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5}},
            "csv_monitor": {"enabled": True, "output_path": folder, "job_name": job},
            "tensorboard": {"enabled": True, "output_path": folder, "job_name": job}, **extra}


def train(rank: int, folder: str) -> dict:
    """fp16 training, the engine's loss per step as the script sees it, and a script's own event."""
    import crew

    engine, *_ = crew.initialize(model=make_model(), config=monitored(
        folder, "fp16", fp16={"enabled": True, "initial_scale_power": 4}))
    generator = torch.Generator().manual_seed(rank)
    losses, lrs = [], []
    for _ in range(STEPS):
        step_loss = 0.0
        for _ in range(ACCUMULATION):
            inputs = torch.randn(MICRO, 6, generator=generator)
            loss = torch.nn.functional.mse_loss(engine(inputs.half()).float(), inputs.sum(dim=1, keepdim=True))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / ACCUMULATION
        losses.append(step_loss)
        lrs.append(engine.get_lr()[0])
    engine.monitor.write_events([("Custom/my metric", 2.5, 99)])
    shares, *_ = crew.initialize(model=make_model(), config={
        **monitored(folder, "shares"), "train_micro_batch_size_per_gpu": None,
        "train_micro_batch_size_per_rank": [3, 5], "gradient_accumulation_steps": 1})
    inputs = torch.randn(shares.train_micro_batch_size_per_gpu(), 6)
    shares.backward(shares(inputs).sum())
    shares.step()
    return {"losses": losses, "lrs": lrs, "scale": engine.loss_scale}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list]:
    folder = tmp_path_factory.mktemp("monitors")
    return folder, run_ranks(train, 2, str(folder))


def read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    header, *rows = list(csv.reader(path.open()))
    return header, [(int(step), float(value)) for step, value in rows]


def test_csv_monitor_files_hold_the_engines_values_at_each_step(written):
    folder, ranks = written
    job = folder / "fp16"
    assert sorted(p.name for p in job.glob("*.csv")) == [
        "Custom_my_metric.csv", "Train_Samples_loss_scale.csv", "Train_Samples_lr.csv",
        "Train_Samples_samples_per_sec.csv", "Train_Samples_train_loss.csv"]
    samples = [GLOBAL * (step + 1) for step in range(STEPS)]  # DeepSpeed's step axis: the sample count
    header, loss_rows = read_csv(job / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"] and [step for step, _ in loss_rows] == samples  # rank 0 only, once
    assert [value for _, value in loss_rows] == pytest.approx(ranks[0]["losses"], rel=1e-6)
    assert read_csv(job / "Train_Samples_lr.csv") == (["step", "lr"], list(zip(samples, ranks[0]["lrs"])))
    _, scales = read_csv(job / "Train_Samples_loss_scale.csv")
    assert scales[-1] == (samples[-1], ranks[0]["scale"])
    _, rates = read_csv(job / "Train_Samples_samples_per_sec.csv")
    assert [step for step, _ in rates] == samples[1:] and all(rate > 0 for _, rate in rates)
    assert read_csv(job / "Custom_my_metric.csv") == (["step", "my metric"], [(99, 2.5)])


def test_tensorboard_events_read_back_with_tensorboards_reader(written):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, ranks = written
    events = EventAccumulator(str(folder / "fp16"))
    events.Reload()
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale",
            "Train/Samples/samples_per_sec", "Custom/my metric"} <= set(events.Tags()["scalars"])
    losses = events.Scalars("Train/Samples/train_loss")
    assert [event.step for event in losses] == [GLOBAL * (step + 1) for step in range(STEPS)]
    assert [event.value for event in losses] == pytest.approx(ranks[0]["losses"], rel=1e-6)
    assert [event.value for event in events.Scalars("Train/Samples/lr")] == pytest.approx(ranks[0]["lrs"])


def test_each_ranks_micro_batch_with_unequal_shares(written):
    folder, _ = written
    job = folder / "shares"
    assert read_csv(job / "Train_Samples_micro_batch_rank0.csv") == (["step", "micro_batch_rank0"], [(8, 3.0)])
    assert read_csv(job / "Train_Samples_micro_batch_rank1.csv")[1] == [(8, 5.0)]


def test_a_resumed_run_appends_without_a_second_header(tmp_path):
    import crew

    for run in range(2):
        engine, *_ = crew.initialize(model=make_model(), config={
            **monitored(str(tmp_path), "resumed"), "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1, "tensorboard": {"enabled": False}})
        engine.global_samples = 2 * run
        engine.backward(engine(torch.randn(2, 6)).sum())
        engine.step()
        engine.destroy()
    header, rows = read_csv(tmp_path / "resumed" / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and [step for step, _ in rows] == [2, 4]


def test_a_monitor_without_its_package_names_the_extra(tmp_path):
    import crew
    from crew.runtime.monitor import missing_extra

    if missing_extra("wandb", "wandb", "wandb") is None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ConfigError, match=r"wandb.enabled is true but the 'wandb' package is not installed: "
                                          r"pip install 'wandb'"):
        crew.initialize(model=make_model(), config={"train_batch_size": 2, "wandb": {"enabled": True},
                                                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert "crew[tensorboard]" in str(missing_extra("no_such_module_here", "tensorboard", "crew[tensorboard]"))


def test_wandb_gets_deepspeeds_init_and_one_log_per_event(tmp_path, monkeypatch, request):
    import sys

    import crew

    stub = tmp_path / "stub" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("calls = []\n"
                                      "def init(**kwargs): calls.append(('init', kwargs))\n"
                                      "def log(data, step=None, commit=None): calls.append(('log', data, step))\n")
    monkeypatch.syspath_prepend(str(stub.parent))
    request.addfinalizer(lambda: sys.modules.pop("wandb", None))  # the stub must not outlive the test
    engine, *_ = crew.initialize(model=make_model(), config={
        "train_batch_size": 2, "steps_per_print": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "wandb": {"enabled": True, "project": "p", "team": "t", "group": "g"}})
    engine.backward(engine(torch.randn(2, 6)).sum())
    engine.step()
    import wandb

    assert wandb.calls[0] == ("init", {"project": "p", "group": "g", "entity": "t"})
    assert [(list(data), step) for _, data, step in wandb.calls[1:]] == [
        (["Train/Samples/train_loss"], 2), (["Train/Samples/lr"], 2)]
    assert wandb.calls[2][1] == {"Train/Samples/lr": 0.1}


def test_an_output_path_that_cannot_be_created_names_the_keys(tmp_path):
    import crew

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"csv_monitor.output_path / csv_monitor.job_name: cannot create "
                                          r".*a_file/job.*point csv_monitor.output_path at a folder"):
        crew.initialize(model=make_model(), config={
            "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "csv_monitor": {"enabled": True, "output_path": str(blocker), "job_name": "job"}})
