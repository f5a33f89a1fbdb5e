"""The engine's periodic step line (`steps_per_print`), from rank 0.

In a log it is an ordinary line. When `crew run`'s own stdout is a terminal (it sets CREW_CONSOLE=tty
for the ranks) the line ends in a bare carriage return instead: the launcher's console draws it in place
as a step bar, like a tqdm bar. With a known number of steps (a scheduler's `total_num_steps`) it
shows `step n/total` and the time left.
"""

from __future__ import annotations

import os
import sys
import time

from crew.log import log_rank0

__all__ = ["ThroughputTimer", "show_step"]


def show_step(step: int, total: int | None, loss: float, lrs: list[float], samples_per_sec: float,
              skipped: int, seconds_per_step: float) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    line = _line(step, total, loss, lrs, samples_per_sec, skipped, seconds_per_step)
    if os.environ.get("CREW_CONSOLE") == "tty":
        sys.stdout.write(f"[crew] {line}\r")
        sys.stdout.flush()
    else:
        log_rank0("%s", line)


def _line(step: int, total: int | None, loss: float, lrs: list[float], samples_per_sec: float,
          skipped: int, seconds_per_step: float) -> str:
    shown_lrs = ", ".join(f"{lr:.3g}" for lr in lrs)
    line = f"step {step}" if total is None else f"step {step}/{total}"
    line += f": loss {loss:.4f} (rank 0), lr [{shown_lrs}], {samples_per_sec:.1f} samples/s"
    if skipped:
        line += f", skipped {skipped}"
    if total is not None and total > step:
        line += f", {_duration((total - step) * seconds_per_step)} left"
    return line


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`: times each micro step from the forward to step(), from the
    `start_step`-th optimizer step on. crew's step line reports the speed, so this one never logs;
    scripts read `avg_samples_per_sec()` and call `update_epoch_count()` (DeepSpeed-Chat)."""

    def __init__(self, batch_size: int, start_step: int = 2) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.started = False
        self.start_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += int(global_step)
        if self.start_time > 0:
            self.total_elapsed_time += time.time() - self.start_time

    def avg_samples_per_sec(self) -> float:
        if self.global_step_count > self.start_step and self.total_elapsed_time > 0:
            per_step = self.total_elapsed_time / (self.global_step_count - self.start_step)
            return self.batch_size / per_step
        return float("-inf")
