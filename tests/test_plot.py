"""`crew plot`: monitor folders in DeepSpeed's layout (csv_monitor files written by hand, TensorBoard
event files by torch's SummaryWriter) -> one PNG, opened and checked; run names; each error path."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import crew
from crew import plot
from crew.errors import CrewError

matplotlib_image = pytest.importorskip("matplotlib.image")

SERIES = ("train_loss", "lr", "samples_per_sec")


def value(series: str, step: int, offset: float) -> float:
    return {"train_loss": 2 * math.exp(-step / 300) + offset, "lr": 0.01 * min(1.0, step / 200),
            "samples_per_sec": 900 + 100 * offset + 5 * math.sin(step)}[series]


def write_csv_run(folder: Path, offset: float = 0.0, series=SERIES, steps=range(32, 3200, 32)) -> Path:
    """What DeepSpeed's csv_monitor writes: one file a tag, a `step,<last part of the tag>` header."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in series:
        rows = [f"step,{name}"] + [f"{step},{value(name, step, offset)}" for step in steps]
        (folder / f"Train_Samples_{name}.csv").write_text("\n".join(rows) + "\n")
    return folder


def write_tensorboard_run(folder: Path, offset: float = 0.0, loss_scale: bool = False) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder))
    for step in range(32, 3200, 32):
        for name in SERIES:
            writer.add_scalar(f"Train/Samples/{name}", value(name, step, offset), step)
        if loss_scale:
            writer.add_scalar("Train/Samples/loss_scale", 2.0 ** (16 - step // 1000), step)
    writer.close()
    return folder


def open_png(path: Path, panels: int):
    """The PNG's pixels, checked to be figure size x dpi and not blank."""
    pixels = matplotlib_image.imread(path)
    width, height = plot.figure_size(panels)
    assert pixels.shape[:2] == (round(height * plot.DPI), round(width * plot.DPI))
    assert pixels[..., :3].std() > 0.05  # lines, ticks and text on white
    return pixels


def has_colour(pixels, hex_colour: str) -> bool:
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return bool((abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).sum() > 50)


# -- through the command line ----------------------------------------------------------------------------

def test_two_csv_runs_in_one_output_path_make_one_png_with_both(tmp_path):
    write_csv_run(tmp_path / "runs" / "job_a")
    write_csv_run(tmp_path / "runs" / "job_b", offset=0.5)
    result = crew("plot", "runs", cwd=tmp_path, timeout=60)
    assert result.code == 0, result.err
    assert result.out.strip() == "crew: wrote runs.png"  # default name: the first DIR's, here
    pixels = open_png(tmp_path / "runs.png", panels=3)
    assert has_colour(pixels, "#1f77b4") and has_colour(pixels, "#ff7f0e")  # C0 and C1: one per run


def test_tensorboard_folders_and_a_csv_folder_overlaid_with_o(tmp_path):
    write_tensorboard_run(tmp_path / "tb" / "fp16", loss_scale=True)
    write_csv_run(tmp_path / "csv" / "bf16", offset=0.3)
    result = crew("plot", "tb", "csv/bf16", "-o", "both.png", cwd=tmp_path, timeout=60)
    assert result.code == 0, result.err
    assert result.out.strip() == "crew: wrote both.png"
    open_png(tmp_path / "both.png", panels=4)  # loss_scale is a fourth panel, present in one run


def run_with_hidden(package: str, tmp_path: Path, *args: str):
    """`crew plot` where `package` cannot be imported: a stub ahead of site-packages raises as a
    missing package does."""
    stub = tmp_path / "stubs" / package
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{package}'\", "
                                      f"name='{package}')\n")
    return crew("plot", *args, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "stubs")}, timeout=60)


def test_missing_matplotlib_names_the_extra_and_exits_2(tmp_path):
    write_csv_run(tmp_path / "runs" / "a")
    result = run_with_hidden("matplotlib", tmp_path, "runs")
    assert result.code == 2
    assert "pip install 'crew[plot]'" in result.err and "matplotlib" in result.err
    assert "Traceback" not in result.err
    assert not (tmp_path / "runs.png").exists()


def test_missing_tensorboard_names_the_extra_only_for_event_files(tmp_path):
    write_tensorboard_run(tmp_path / "tb" / "a")
    result = run_with_hidden("tensorboard", tmp_path, "tb")
    assert result.code == 2
    assert "pip install 'crew[tensorboard]'" in result.err and "Traceback" not in result.err
    write_csv_run(tmp_path / "csv" / "a")
    assert run_with_hidden("tensorboard", tmp_path, "csv").code == 0  # csv needs no tensorboard


def test_a_folder_without_monitor_files_is_named_with_what_was_expected(tmp_path):
    (tmp_path / "empty" / "job").mkdir(parents=True)
    (tmp_path / "empty" / "job" / "metrics.csv").write_text("a,b\n")
    result = crew("plot", "empty", cwd=tmp_path, timeout=60)
    assert result.code == 2 and "Traceback" not in result.err
    assert "empty holds no monitor output" in result.err
    assert "Train_Samples_train_loss.csv" in result.err and "events.out.tfevents." in result.err
    assert "(job/metrics.csv)" in result.err
    missing = crew("plot", "nowhere", cwd=tmp_path, timeout=60)
    assert missing.code == 2 and "nowhere does not exist" in missing.err


def test_a_bad_csv_line_is_named_by_file_and_line(tmp_path):
    folder = write_csv_run(tmp_path / "runs" / "a")
    lines = (folder / "Train_Samples_lr.csv").read_text().splitlines()
    lines[4] = "160,not-a-number"
    (folder / "Train_Samples_lr.csv").write_text("\n".join(lines) + "\n")
    result = crew("plot", "runs", cwd=tmp_path, timeout=60)
    assert result.code == 2 and "Traceback" not in result.err
    assert f"{Path('runs') / 'a' / 'Train_Samples_lr.csv'}:5: expected 'step,value'" in result.err
    assert "'160,not-a-number'" in result.err


# -- the module, directly ----------------------------------------------------------------------------

def test_plot_runs_returns_panels_and_legend_and_skips_absent_series(tmp_path):
    write_csv_run(tmp_path / "out" / "a", series=("train_loss", "lr"))
    write_csv_run(tmp_path / "out" / "b", series=("train_loss",), offset=1.0)
    runs = plot.read_runs(plot.find_runs([str(tmp_path / "out")]))
    drawn = plot.plot_runs(runs, tmp_path / "p.png")
    assert drawn.legend == ["a", "b"]
    assert [(p.series, p.title, p.runs) for p in drawn.panels] == [("train_loss", "loss", ["a", "b"]),
                                                                   ("lr", "learning rate", ["a"])]
    assert drawn.size_px == (800, 540)
    open_png(tmp_path / "p.png", panels=2)


def test_run_names_job_folder_dir_itself_and_ambiguous_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_csv_run(tmp_path / "x" / "job")
    write_csv_run(tmp_path / "y" / "job")
    write_csv_run(tmp_path / "y" / "other")
    write_csv_run(tmp_path / "solo")
    names = [run.name for run in plot.find_runs(["x", "y", "solo", "y/other"])]
    assert names == ["x/job", "y/job", "other", "solo"]  # y/other given twice: one run


def test_csv_and_tensorboard_in_one_job_folder_is_one_csv_run(tmp_path):
    write_tensorboard_run(tmp_path / "out" / "job")
    write_csv_run(tmp_path / "out" / "job")
    [run] = plot.find_runs([str(tmp_path / "out")])
    assert (run.name, run.kind) == ("job", "csv")


def test_tensorboard_series_read_back_at_full_length(tmp_path):
    [run] = plot.read_runs(plot.find_runs([str(write_tensorboard_run(tmp_path / "tb", loss_scale=True))]))
    assert (run.name, run.kind) == ("tb", "tensorboard")
    assert sorted(run.series) == ["loss_scale", "lr", "samples_per_sec", "train_loss"]
    steps, values = run.series["lr"]
    assert steps == [float(s) for s in range(32, 3200, 32)]
    assert values == pytest.approx([value("lr", s, 0) for s in range(32, 3200, 32)], rel=1e-6)


def test_a_restarted_job_appending_to_the_csv_replaces_the_points_from_its_step_on(tmp_path):
    path = tmp_path / "Train_Samples_train_loss.csv"
    path.write_text("step,train_loss\n32,3.0\n64,2.0\n96,1.5\nstep,train_loss\n64,2.5\n96,2.4\n\n128,2.3\n")
    assert plot.read_csv(path) == ([32.0, 64.0, 96.0, 128.0], [3.0, 2.5, 2.4, 2.3])


@pytest.mark.parametrize("text, line", [("step,lr\n1,0.1\n2\n", 3), ("step,lr\n1,0.1,7\n", 2),
                                         ("1,0.1\n2,\n", 2)])
def test_unreadable_rows_name_their_line(tmp_path, text, line):
    path = tmp_path / "Train_Samples_lr.csv"
    path.write_text(text)
    with pytest.raises(CrewError, match=f"Train_Samples_lr.csv:{line}: expected 'step,value'"):
        plot.read_csv(path)


def test_headers_only_is_nothing_to_draw_and_bad_output_names(tmp_path):
    folder = tmp_path / "out" / "job"
    folder.mkdir(parents=True)
    (folder / "Train_Samples_train_loss.csv").write_text("step,train_loss\n")
    with pytest.raises(CrewError, match="no points to draw.*job .*no points yet"):
        plot.plot_dirs([str(tmp_path / "out")], str(tmp_path / "p.png"))
    with pytest.raises(CrewError, match="name it FILE.png"):
        plot.plot_dirs([str(tmp_path / "out")], str(tmp_path / "p.svg"))
    with pytest.raises(CrewError, match="does not exist"):
        plot.plot_dirs([str(tmp_path / "out")], str(tmp_path / "no" / "p.png"))


def test_crew_plot_does_not_import_torch():
    code = "import sys, crew.cli, crew.plot; sys.exit('torch' in sys.modules or 'matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_loss_spanning_decades_gets_a_log_axis():
    from crew.plot import _spans_decades

    assert _spans_decades([[35.0, 20.0], [0.3]])
    assert not _spans_decades([[2.0, 0.5]]) and not _spans_decades([[35.0, 0.0]]) and not _spans_decades([])
