"""The line `crew run` ends with: how the job ended, in how long, and where its results went.

    crew: job 8ed5c7cd succeeded · 2 ranks on 1 node · 6.1 s · checkpoint ckpt/global_step40 · curves runs/demo
    (crew plot runs/demo) · rank logs logs/

Checkpoints, 16-bit weights and monitor folders are what global rank 0's engine reported (crew/outputs.py): the
newest checkpoint tag and weights file, every monitor folder. Paths under the launcher's folder are shown
relative to it. On a launch over ssh, pdsh or srun they are said to be on rank 0's node, which may not be
this machine; the rank logs (--log_dir) are on each node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from crew.launcher.job.record import FirstFailure

LOCAL_LAUNCHERS = ("local", "standalone")
CURVE_WRITERS = ("csv_monitor", "tensorboard")  # what `crew plot` reads


@dataclass(frozen=True)
class Ending:
    job_id: str
    status: str  # succeeded, failed, interrupted, preempted (JobRun.status)
    exit_code: int
    world_size: int
    nodes: int
    wall_s: float
    launcher: str
    cwd: str
    failure: FirstFailure | None = None
    outputs: tuple[dict, ...] = ()
    log_dir: str | None = None  # --log_dir, relative to cwd or absolute
    restarts: int = 0


def closing_line(ending: Ending) -> str:
    parts = [f"job {ending.job_id} {_how(ending)}", f"{_count(ending.world_size, 'rank')} on "
             f"{_count(ending.nodes, 'node')}", _duration(ending.wall_s)]
    if ending.restarts:
        parts[-1] += f" ({_count(ending.restarts, 'restart')})"
    parts += _results(ending)
    if ending.log_dir:
        where = "" if ending.launcher in LOCAL_LAUNCHERS else " on each node"
        parts.append(f"rank logs {_shown(os.path.join(ending.cwd, ending.log_dir), ending.cwd)}/{where}")
    return " · ".join(parts)


def _how(ending: Ending) -> str:
    if ending.status == "failed":
        failure, first = ending.failure, ""
        if failure is not None and failure.rank is not None:
            first = f"; rank {failure.rank} on {failure.host} failed first"
        return f"failed (exit code {ending.exit_code}{first})"
    if ending.status == "preempted":
        return f"was preempted (exit code {ending.exit_code}: the same command resumes)"
    if ending.status == "interrupted":
        return f"was stopped (exit code {ending.exit_code})"
    return "succeeded"


def _results(ending: Ending) -> list[str]:
    by_kind: dict[str, list[dict]] = {}
    for entry in ending.outputs:
        by_kind.setdefault(entry.get("kind", ""), []).append(entry)
    remote = ending.launcher not in LOCAL_LAUNCHERS
    parts = []
    if checkpoints := by_kind.get("checkpoint"):
        newest = checkpoints[-1]
        path = os.path.join(newest["path"], str(newest.get("tag", "")))
        parts.append(f"checkpoint {_shown(path, ending.cwd)}{_on(newest, remote)}")
    if weights := by_kind.get("weights"):
        parts.append(f"weights {_shown(weights[-1]['path'], ending.cwd)}{_on(weights[-1], remote)}")
    curves = [e for e in by_kind.get("monitor", ()) if e.get("writer") in CURVE_WRITERS]
    if curves:
        folders = sorted({_shown(entry["path"], ending.cwd) for entry in curves})
        top = folders[0] if len(folders) == 1 else _common_folder(folders)
        parts.append(f"curves {', '.join(folders)}{_on(curves[0], remote)} (crew plot {top})")
    return parts


def _common_folder(folders: list[str]) -> str:
    try:
        return os.path.commonpath(folders) or "."
    except ValueError:  # absolute and relative mixed
        return folders[0]


def _on(entry: dict, remote: bool) -> str:
    return f" on {entry['host']}" if remote and entry.get("host") else ""


def _shown(path: str, cwd: str) -> str:
    """`path` relative to `cwd` when it lies under it, else as it is."""
    relative = os.path.relpath(path, cwd)
    return path if relative == ".." or relative.startswith(".." + os.sep) else relative


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"
