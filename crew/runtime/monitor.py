"""DeepSpeed's monitors: the config's `tensorboard`, `csv_monitor` and `wandb` sections, written from
rank 0 with DeepSpeed's tags and file layout (deepspeed/monitor/, 0.19.8).

    output_path/job_name/                     TensorBoard event files (torch.utils.tensorboard)
    output_path/job_name/Train_Samples_lr.csv `step,lr` then one row per event (csv_monitor)

At each optimizer step the engine records `Train/Samples/train_loss` (rank 0's loss, averaged over the
step's micro batches), `Train/Samples/lr`, `Train/Samples/loss_scale` (fp16), `Train/Samples/
samples_per_sec` and, with one micro batch per rank, `Train/Samples/micro_batch_rank<r>`; the step
axis is the sample count, as in DeepSpeed. The engine's events wait on the device and are written
every `steps_per_print` steps (and on save, destroy and exit), so a step costs no device sync and
no file write. `engine.monitor.write_events([(tag, value, step), ...])` writes a script's own events
at once, as DeepSpeed's does.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Iterable, Sequence
from typing import Any

from crew import outputs
from crew.errors import ConfigError

__all__ = ["Monitor", "missing_extra", "step_events"]

Event = tuple[str, Any, int]


def missing_extra(module: str, section: str, extra: str) -> ConfigError | None:
    """The error for an enabled monitor whose package is not installed, or None when it is."""
    if importlib.util.find_spec(module) is not None:
        return None
    return ConfigError(f"{section}.enabled is true but the '{module}' package is not installed: "
                       f"pip install '{extra}' (or set {section}.enabled to false).")


def _value(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def step_events(samples: int, loss, lr: float, loss_scale: float | None, samples_per_sec: float | None,
                sizes: Sequence[int] | None) -> list[Event]:
    """The engine's events for one optimizer step, at `samples` on the step axis."""
    events: list[Event] = [("Train/Samples/lr", lr, samples)]
    if loss is not None:
        events.insert(0, ("Train/Samples/train_loss", loss, samples))
    if loss_scale is not None:
        events.append(("Train/Samples/loss_scale", loss_scale, samples))
    if samples_per_sec is not None:
        events.append(("Train/Samples/samples_per_sec", samples_per_sec, samples))
    events += [(f"Train/Samples/micro_batch_rank{rank}", size, samples) for rank, size in enumerate(sizes or ())]
    return events


class _CsvWriter:
    """DeepSpeed's csvMonitor: one file per tag, header `step,<last part of the tag>`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def write(self, events: Sequence[Event]) -> None:
        rows: dict[str, list] = {}
        for tag, value, step in events:
            rows.setdefault(tag, []).append([step, _value(value)])
        for tag, tag_rows in rows.items():
            path = os.path.join(self.folder, tag.replace("/", "_").replace(" ", "_") + ".csv")
            with open(path, "a+", newline="") as file:
                writer = csv.writer(file)
                if file.tell() == 0:  # a new file (a resumed run appends without a second header)
                    writer.writerow(["step", tag.split("/")[-1]])
                writer.writerows(tag_rows)

    def close(self) -> None:
        pass


class _TensorBoardWriter:
    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package: an optional extra

        self.writer = SummaryWriter(log_dir=folder)

    def write(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, _value(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbWriter:
    def __init__(self, section) -> None:
        import wandb

        self.wandb = wandb
        wandb.init(project=section.project, group=section.group, entity=section.team)

    def write(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self.wandb.log({tag: _value(value)}, step=step)

    def close(self) -> None:
        pass


class Monitor:
    """DeepSpeed's MonitorMaster: `enabled` when any section is, writers on rank 0 only."""

    def __init__(self, config, rank: int) -> None:
        sections = (config.tensorboard, config.csv_monitor, config.wandb)
        self.enabled = any(section.enabled for section in sections)
        self.writers: list = []
        self._pending: list[Event] = []
        if rank == 0:
            self.writers = _writers(config)

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Write (tag, value, step) events now (rank 0; other ranks write nothing, as DeepSpeed)."""
        events = list(event_list)
        for writer in self.writers:
            writer.write(events)

    def record(self, events: Iterable[Event]) -> None:
        """Keep the engine's events (values may be device tensors) until the next flush()."""
        if self.writers:
            self._pending.extend(events)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self.write_events([(tag, _value(value), step) for tag, value, step in pending])

    def close(self) -> None:
        self.flush()
        for writer in self.writers:
            writer.close()
        self.writers = []


def _writers(config) -> list:
    writers: list = []
    if config.tensorboard.enabled:
        _require("tensorboard", "tensorboard", "crew[tensorboard]")
        writers.append(_TensorBoardWriter(_folder(config.tensorboard, "tensorboard")))
    if config.csv_monitor.enabled:
        writers.append(_CsvWriter(_folder(config.csv_monitor, "csv_monitor")))
    if config.wandb.enabled:
        _require("wandb", "wandb", "wandb")
        writers.append(_WandbWriter(config.wandb))
    return writers


def _folder(section, name: str) -> str:
    """output_path/job_name, created; a ConfigError naming the keys when it cannot be."""
    folder = os.path.join(section.output_path, section.job_name)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{name}.output_path / {name}.job_name: cannot create {folder!r} ({err.strerror or err}); "
                          f"point {name}.output_path at a folder this user can write.") from None
    outputs.report("monitor", folder, writer=name)
    return folder


def _require(module: str, section: str, extra: str) -> None:
    error = missing_extra(module, section, extra)
    if error is not None:
        raise error
