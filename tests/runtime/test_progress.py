"""The engine's step line (crew/runtime/progress.py): in a log, and as a bar when crew run is on a terminal."""

from __future__ import annotations

import pytest

from crew.runtime.progress import show_step


@pytest.fixture(autouse=True)
def rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("CREW_CONSOLE", raising=False)


def test_a_log_gets_an_ordinary_line(capsys):
    show_step(10, None, 0.25, [1e-3, 2e-4], 123.45, 0, 0.5)
    assert capsys.readouterr().out == "[crew] step 10: loss 0.2500 (rank 0), lr [0.001, 0.0002], 123.5 samples/s\n"


def test_a_terminal_gets_a_bar_with_the_time_left(capsys, monkeypatch):
    monkeypatch.setenv("CREW_CONSOLE", "tty")
    show_step(10, 130, 0.25, [1e-3], 50.0, 2, 0.5)  # 120 steps of 0.5 s left
    assert capsys.readouterr().out == ("[crew] step 10/130: loss 0.2500 (rank 0), lr [0.001], 50.0 samples/s, "
                                       "skipped 2, 1:00 left\r")
    show_step(10, 8000, 0.25, [1e-3], 50.0, 0, 0.5)
    assert capsys.readouterr().out.endswith("1:06:35 left\r")


def test_other_ranks_say_nothing(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    show_step(10, None, 0.25, [1e-3], 50.0, 0, 0.5)
    assert capsys.readouterr().out == ""
