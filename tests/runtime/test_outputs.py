"""What rank 0's engine tells its agent it wrote (crew/outputs.py), for `crew run`'s closing line: checkpoints,
16-bit weights and monitor folders, read back as the agent reads them."""

from __future__ import annotations

import pytest
import torch

from crew import outputs


@pytest.fixture
def outputs_file(tmp_path, monkeypatch):
    path = tmp_path / "rank0.outputs"
    monkeypatch.setenv(outputs.OUTPUTS_FILE_ENV, str(path))
    return path


def test_the_engine_reports_its_saves_and_monitor_folders(tmp_path, outputs_file, monkeypatch):
    import crew

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    engine, *_ = crew.initialize(model=torch.nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": "runs", "job_name": "first"}})
    for step in range(2):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        engine.save_checkpoint("ckpt", client_state={"step": step})
    engine.save_16bit_model("export", "model.bin")
    engine.destroy()
    assert outputs.read(outputs_file) == [
        {"kind": "monitor", "path": str(tmp_path / "runs" / "first"), "writer": "csv_monitor"},
        {"kind": "checkpoint", "path": str(tmp_path / "ckpt"), "tag": "global_step2"},
        {"kind": "weights", "path": str(tmp_path / "export" / "model.bin")}]


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(outputs.OUTPUTS_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    outputs.report("checkpoint", "ckpt", tag="t")
    assert list(tmp_path.iterdir()) == []


def test_read_keeps_the_newest_of_each_and_skips_damage(tmp_path, outputs_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outputs.report("monitor", "runs/a", writer="tensorboard")
    outputs.report("checkpoint", "one", tag="global_step1")
    outputs.report("checkpoint", "two", tag="global_step2")
    outputs.report("checkpoint", "one", tag="global_step3")  # a newer save into the first folder
    with open(outputs_file, "a") as file:
        file.write('{"kind": "checkpoint"}\nnot json\n{"kind": "checkpoint", "path": "/half')  # a rank killed mid-write
    assert [(e["kind"], e["path"], e.get("tag")) for e in outputs.read(outputs_file)] == [
        ("monitor", str(tmp_path / "runs/a"), None), ("checkpoint", str(tmp_path / "two"), "global_step2"),
        ("checkpoint", str(tmp_path / "one"), "global_step3")]
    assert outputs.read(tmp_path / "missing") == []


def test_read_keeps_every_monitor_and_the_last_saves(tmp_path, outputs_file):
    outputs.report("monitor", "/runs/curves", writer="csv_monitor")
    for step in range(outputs.MAX_ENTRIES + 5):
        outputs.report("checkpoint", f"/out/checkpoint-{step}", tag=f"global_step{step}")
    found = outputs.read(outputs_file)
    assert found[0]["path"] == "/runs/curves" and len(found) == 1 + outputs.MAX_ENTRIES
    assert found[-1]["path"] == f"/out/checkpoint-{outputs.MAX_ENTRIES + 4}"


def test_a_write_that_fails_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv(outputs.OUTPUTS_FILE_ENV, str(tmp_path / "no such folder" / "file"))
    outputs.report("checkpoint", "ckpt", tag="t")  # must not raise
