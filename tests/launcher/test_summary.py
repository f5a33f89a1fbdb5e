"""The line `crew run` ends with (crew/launcher/job/summary.py): how the job ended, in how long, and where its
results went. End to end in test_launch_local.py and test_launch_ssh.py."""

from __future__ import annotations

import pytest

from crew.launcher.job.record import FirstFailure
from crew.launcher.job.summary import Ending, closing_line

CWD = "/work/job"


def ending(**changes) -> Ending:
    fields = {"job_id": "abc123", "status": "succeeded", "exit_code": 0, "world_size": 2, "nodes": 1,
              "wall_s": 6.14, "launcher": "local", "cwd": CWD}
    return Ending(**{**fields, **changes})


def test_a_plain_success():
    assert closing_line(ending()) == "job abc123 succeeded · 2 ranks on 1 node · 6.1 s"


def test_results_are_shown_relative_to_the_launchers_folder():
    line = closing_line(ending(log_dir="logs", outputs=(
        {"kind": "monitor", "path": f"{CWD}/runs/demo", "writer": "csv_monitor"},
        {"kind": "checkpoint", "path": f"{CWD}/ckpt", "tag": "global_step40"},
        {"kind": "checkpoint", "path": "/data/ckpt", "tag": "global_step80"},
        {"kind": "weights", "path": f"{CWD}/out/pytorch_model.bin"})))
    assert line == ("job abc123 succeeded · 2 ranks on 1 node · 6.1 s · checkpoint /data/ckpt/global_step80 · "
                    "weights out/pytorch_model.bin · curves runs/demo (crew plot runs/demo) · rank logs logs/")


def test_several_curve_folders_are_plotted_from_their_common_folder():
    line = closing_line(ending(outputs=(
        {"kind": "monitor", "path": f"{CWD}/runs/tb", "writer": "tensorboard"},
        {"kind": "monitor", "path": f"{CWD}/runs/csv", "writer": "csv_monitor"},
        {"kind": "monitor", "path": f"{CWD}/wandb", "writer": "wandb"})))
    assert line.endswith("curves runs/csv, runs/tb (crew plot runs)")


def test_over_ssh_results_are_on_rank_0s_node_and_logs_on_each():
    line = closing_line(ending(launcher="ssh", world_size=16, nodes=2, log_dir="/var/log/crew", outputs=(
        {"kind": "checkpoint", "path": f"{CWD}/ckpt", "tag": "t", "host": "node1"},)))
    assert line.endswith("16 ranks on 2 nodes · 6.1 s · checkpoint ckpt/t on node1 · rank logs /var/log/crew/ "
                         "on each node")


@pytest.mark.parametrize("changes, expected", [
    ({"status": "failed", "exit_code": 7, "failure": FirstFailure(7, "...", rank=3, host="node2")},
     "job abc123 failed (exit code 7; rank 3 on node2 failed first) ·"),
    ({"status": "failed", "exit_code": 1, "failure": FirstFailure(1, "node2: ssh ended", host="node2")},
     "job abc123 failed (exit code 1) ·"),
    ({"status": "interrupted", "exit_code": 130}, "job abc123 was stopped (exit code 130) ·"),
    ({"status": "preempted", "exit_code": 75}, "job abc123 was preempted (exit code 75: the same command resumes) ·"),
])
def test_how_it_ended(changes, expected):
    assert closing_line(ending(**changes)).startswith(expected)


@pytest.mark.parametrize("seconds, shown", [(0.04, "0.0 s"), (59.94, "59.9 s"), (61, "1 min 01 s"),
                                            (3725, "1 h 02 min")])
def test_wall_time(seconds, shown):
    assert closing_line(ending(wall_s=seconds)).split(" · ")[2] == shown


def test_restarts_are_counted():
    assert " · 6.1 s (1 restart) " in closing_line(ending(restarts=1)) + " "
