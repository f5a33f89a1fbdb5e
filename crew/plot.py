"""`crew plot`: loss, lr and samples/s against samples, drawn from DeepSpeed's monitor output into one PNG.

Reads what the config's `csv_monitor` and `tensorboard` sections write, in DeepSpeed's layout:
`output_path/job_name/Train_Samples_train_loss.csv` (rows `step,value`, step = samples), or TensorBoard
event files in `output_path/job_name/` with the tags `Train/Samples/train_loss`, ... Every folder under
a DIR that holds such files is one run; runs are overlaid, one colour per run, named in a legend.

matplotlib (the `plot` extra) and tensorboard (the `tensorboard` extra, for event files only) are
imported when used, and torch never: `crew plot` starts fast on a machine without a GPU stack.
"""

from __future__ import annotations

import bisect
import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

from crew.errors import CrewError

TAG_PREFIX = "Train/Samples/"
# (series, panel title) in drawing order; loss_scale appears only where a run has it (fp16).
PANELS = (("train_loss", "loss"), ("lr", "learning rate"), ("samples_per_sec", "samples/s"),
          ("loss_scale", "loss scale"))
EVENTS_PREFIX = "events.out.tfevents."
DPI = 100
WIDTH_IN = 8.0
PANEL_HEIGHT_IN = 2.4
LEGEND_HEIGHT_IN = 0.6
PLOT_EXTRA = "pip install 'crew[plot]' (or: pip install matplotlib)"
TENSORBOARD_EXTRA = "pip install 'crew[tensorboard]' (or: pip install tensorboard)"

Series = tuple[list[float], list[float]]  # (steps, values), steps increasing


def csv_name(series: str) -> str:
    """The csv_monitor file of a series: the tag with '/' (and spaces) replaced by '_', as DeepSpeed."""
    return (TAG_PREFIX + series).replace("/", "_").replace(" ", "_") + ".csv"


CSV_NAMES = {csv_name(series): series for series, _ in PANELS}


def figure_size(panels: int) -> tuple[float, float]:
    """Inches; the PNG is this times DPI pixels (no tight bounding box, so the size is known)."""
    return WIDTH_IN, LEGEND_HEIGHT_IN + PANEL_HEIGHT_IN * panels


@dataclass
class Run:
    """One monitor folder: csv_monitor files or TensorBoard event files of one job."""

    name: str
    folder: Path
    kind: str  # "csv" or "tensorboard"
    series: dict[str, Series] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)  # tags or files that are no panel's (for errors)


@dataclass
class Panel:
    series: str
    title: str
    runs: list[str]  # the runs drawn in it


@dataclass
class Plot:
    """What plot_runs drew: the file, its panels top to bottom, the legend, the size in pixels."""

    path: Path
    panels: list[Panel]
    legend: list[str]
    size_px: tuple[int, int]


# -- finding runs ------------------------------------------------------------------------------------

def _kind(files: list[str]) -> str | None:
    # csv wins where both monitors share output_path/job_name: the same events, at full precision,
    # and no need for the tensorboard package.
    if any(name in CSV_NAMES for name in files):
        return "csv"
    if any(name.startswith(EVENTS_PREFIX) for name in files):
        return "tensorboard"
    return None


def _no_output(given: str, stray_csv: list[str]) -> CrewError:
    seen = ""
    if stray_csv:
        names = ", ".join(sorted(stray_csv)[:3]) + (", ..." if len(stray_csv) > 3 else "")
        seen = f" It has other .csv files ({names}), none named as csv_monitor names them."
    return CrewError(
        f"crew plot: {given} holds no monitor output: expected csv_monitor files ({csv_name('train_loss')}, "
        f"{csv_name('lr')}, ...) or TensorBoard event files ({EVENTS_PREFIX}*), in it or in its job folders "
        f"(output_path/job_name), as the config's csv_monitor or tensorboard section writes them.{seen}")


def find_runs(dirs: list[str]) -> list[Run]:
    """Every folder under each DIR (itself included) holding monitor files is a run, named by its path
    below DIR (its job folder), or by DIR's own name when DIR is the run; the DIR joins the name where
    two runs would share one. A folder given twice is one run."""
    runs: list[Run] = []
    seen: set[Path] = set()
    for given in dirs:
        top = Path(given)
        if not top.is_dir():
            what = "is not a folder" if top.exists() else "does not exist"
            raise CrewError(f"crew plot: {given} {what}: name a csv_monitor or tensorboard output folder "
                            f"(the config's output_path, or output_path/job_name).")
        found, stray_csv = [], []
        for here, subdirs, files in os.walk(top):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            kind = _kind(files)
            if kind:
                found.append((Path(here), kind))
            stray_csv += [(Path(here) / name).relative_to(top).as_posix() for name in files
                          if name.endswith(".csv") and name not in CSV_NAMES]
        if not found:
            raise _no_output(given, stray_csv)
        for folder, kind in found:
            if folder.resolve() in seen:
                continue
            seen.add(folder.resolve())
            below = folder.relative_to(top).as_posix()
            name = (top.resolve().name or str(top)) if below == "." else below
            runs.append(Run(name, folder, kind))
    _disambiguate(runs)
    return runs


def _disambiguate(runs: list[Run]) -> None:
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = Path(os.path.normpath(run.folder)).as_posix()
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = str(run.folder.resolve())


# -- reading them --------------------------------------------------------------------------------------

def _add(series: Series, step: float, value: float) -> None:
    """Append a point. A resumed or restarted job writes again from an earlier step (DeepSpeed's
    csv_monitor appends to the same file, after a new header): its points replace the older ones from
    that step on, so the curve shows the latest run, as TensorBoard does."""
    steps, values = series
    if steps and step <= steps[-1]:
        cut = bisect.bisect_left(steps, step)
        del steps[cut:], values[cut:]
    steps.append(step)
    values.append(value)


def read_csv(path: Path) -> Series:
    """`step,value` rows; header rows `step,<name>` (one per job that wrote the file) are skipped."""
    series: Series = ([], [])
    reader = None
    try:
        with open(path, newline="", encoding="utf-8") as file:
            reader = csv.reader(file)
            for row in reader:
                line = reader.line_num
                if not "".join(row).strip() or (row[0].strip() == "step" and len(row) == 2):
                    continue
                try:
                    step, value = (float(cell) for cell in row)
                except ValueError:
                    raise CrewError(f"{path}:{line}: expected 'step,value' (two numbers, as csv_monitor "
                                    f"writes them), got {','.join(row)!r}.") from None
                _add(series, step, value)
    except csv.Error as exc:
        raise CrewError(f"{path}:{reader.line_num if reader else 1}: not a readable CSV line ({exc}).") from None
    except UnicodeDecodeError:
        raise CrewError(f"{path}: not a text file; a csv_monitor file holds 'step,value' lines.") from None
    except OSError as exc:
        raise CrewError(f"crew plot: cannot read {path}: {exc.strerror or exc}.") from None
    return series


def _read_csv_run(run: Run) -> None:
    for name in sorted(os.listdir(run.folder)):
        if name in CSV_NAMES:
            run.series[CSV_NAMES[name]] = read_csv(run.folder / name)
        elif name.endswith(".csv"):
            run.others.append(name)


def _event_accumulator():
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as exc:
        raise CrewError(f"crew plot: reading TensorBoard event files needs the tensorboard package, which "
                        f"cannot be imported here ({exc}). Install it: {TENSORBOARD_EXTRA}") from None
    return event_accumulator


def _read_tensorboard_run(run: Run) -> None:
    module = _event_accumulator()
    # size_guidance 0: every scalar; the default keeps a random sample of 10,000 per tag.
    reader = module.EventAccumulator(str(run.folder), size_guidance={module.SCALARS: 0})
    try:
        reader.Reload()
    except Exception as exc:  # tensorboard raises its own kinds for a truncated or foreign file
        raise CrewError(f"crew plot: cannot read the TensorBoard event files in {run.folder}: {exc}") from None
    for tag in reader.Tags().get(module.SCALARS, []):
        short = tag.removeprefix(TAG_PREFIX)
        if tag.startswith(TAG_PREFIX) and short in dict(PANELS):
            series: Series = ([], [])
            for event in reader.Scalars(tag):
                _add(series, float(event.step), float(event.value))
            run.series[short] = series
        else:
            run.others.append(tag)


def read_runs(runs: list[Run]) -> list[Run]:
    for run in runs:
        (_read_csv_run if run.kind == "csv" else _read_tensorboard_run)(run)
    return runs


# -- drawing ---------------------------------------------------------------------------------------

def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter
    except ImportError as exc:
        raise CrewError(f"crew plot draws with matplotlib, which cannot be imported here ({exc}). "
                        f"Install it: {PLOT_EXTRA}") from None
    return Figure, FigureCanvasAgg, EngFormatter


def _nothing_to_draw(runs: list[Run]) -> CrewError:
    wanted = ", ".join(TAG_PREFIX + series for series, _ in PANELS)
    held = "; ".join(f"{run.name} ({run.folder}): {', '.join(run.others[:5]) or 'no points yet'}"
                     for run in runs)
    return CrewError(f"crew plot: no points to draw: none of the runs has a value for {wanted}. "
                     f"What they hold: {held}.")


def _spans_decades(value_lists: list[list[float]], decades: float = 1.5) -> bool:
    values = [value for values in value_lists for value in values]
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 10**decades


def plot_runs(runs: list[Run], out: Path) -> Plot:
    """Draw the runs' series, one panel per series some run has a point of, into `out`."""
    Figure, FigureCanvasAgg, EngFormatter = _matplotlib()
    panels = [(key, title) for key, title in PANELS if any(run.series.get(key, ([], []))[0] for run in runs)]
    if not panels:
        raise _nothing_to_draw(runs)
    # A bare Figure on the Agg canvas: no pyplot, so no display and no global backend state.
    figure = Figure(figsize=figure_size(len(panels)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    handles: dict[str, object] = {}
    drawn = []
    for ax, (key, title) in zip(axes, panels):
        names = []
        for index, run in enumerate(runs):
            steps, values = run.series.get(key, ([], []))
            if not steps:
                continue
            (line,) = ax.plot(steps, values, color=f"C{index % 10}", linewidth=1.2, label=run.name,
                              marker="o" if len(steps) == 1 else None,
                              drawstyle="steps-post" if key == "loss_scale" else "default")
            handles.setdefault(run.name, line)
            names.append(run.name)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if key == "loss_scale":
            ax.set_yscale("log", base=2)
        elif key == "train_loss" and _spans_decades([run.series.get(key, ([], []))[1] for run in runs]):
            ax.set_yscale("log")  # an early loss 100x the late one would flatten the rest of the curve
        drawn.append(Panel(key, title, names))
    axes[-1].set_xlabel("samples")
    axes[-1].xaxis.set_major_formatter(EngFormatter(sep=""))
    legend = [run.name for run in runs if run.name in handles]
    figure.legend([handles[name] for name in legend], legend, loc="outside upper center",
                  ncols=min(len(legend), 4), frameon=False)
    try:
        figure.savefig(out, dpi=DPI)  # no bbox_inches="tight": the PNG is figure_size() x DPI exactly
    except OSError as exc:
        raise CrewError(f"crew plot: cannot write {out}: {exc.strerror or exc}.") from None
    width, height = figure_size(len(panels))
    return Plot(out, drawn, legend, (round(width * DPI), round(height * DPI)))


def default_output(dirs: list[str]) -> Path:
    """`<first DIR's name>.png` in the current folder."""
    return Path(f"{Path(dirs[0]).resolve().name or 'crew-plot'}.png")


def plot_dirs(dirs: list[str], out: str | None = None) -> Plot:
    """`crew plot DIR [DIR ...] [-o FILE.png]`: find the runs, read them, draw them."""
    _matplotlib()  # before reading: a missing extra should not wait for the event files
    path = Path(out) if out else default_output(dirs)
    if path.suffix.lower() != ".png":
        raise CrewError(f"crew plot: -o {out}: the output is a PNG; name it FILE.png.")
    if not path.parent.is_dir():
        raise CrewError(f"crew plot: -o {out}: folder {path.parent} does not exist.")
    return plot_runs(read_runs(find_runs(dirs)), path)
