"""The launcher's console (crew/launcher/console/console.py) without processes: merging the same line from many
ranks, the progress area of a terminal, thinning for files. `test_console_run.py` runs real jobs."""

from __future__ import annotations

import io
import time

import pytest
from terminal import replay

from crew.errors import CrewError
from crew.launcher.console.console import (PROGRESS_INTERVAL_ENV, Board, Console, Merger, Thinner, also_on,
                                   env_seconds, fit, summary)
from crew.launcher.transport.protocol import PROGRESS_MARK
from crew.launcher.console.ranges import spans


@pytest.mark.parametrize("ranks, text", [
    ([], ""), ([4], "4"), ([1, 2], "1-2"), ([1, 2, 3, 5, 7, 8], "1-3, 5, 7-8"), ([9, 1, 3, 2, 2], "1-3, 9"),
])
def test_spans(ranks, text):
    assert spans(ranks) == text


def test_also_on():
    assert also_on([]) == b""
    assert also_on([1]) == b" (and on rank 1)"
    assert also_on(list(range(1, 64))) == b" (and on ranks 1-63)"


# ---------------------------------------------------------------------------------------------
# Merger

def add(merger: Merger, rank: int, text: str, now: float, fd: int = 1) -> None:
    merger.add(fd, rank, f"[h:{rank}] ".encode(), text.encode(), now)


def lines(pairs: list[tuple[int, bytes]]) -> list[str]:
    return [data.decode().rstrip("\n") for _, data in pairs]


def test_the_same_line_from_several_ranks_is_printed_once_when_the_window_ends():
    merger = Merger(window=0.5, world_size=4)
    add(merger, 2, "config error", 10.0)
    add(merger, 0, "config error", 10.1)
    add(merger, 3, "config error", 10.4)
    assert merger.pop_ready(10.45) == []                        # still within 0.5 s of the first
    assert merger.next_due() == 10.5
    assert lines(merger.pop_ready(10.5)) == ["[h:2] config error (and on ranks 0, 3)"]
    add(merger, 1, "config error", 10.6)                        # too late: a line of its own
    assert lines(merger.pop_ready(11.1)) == ["[h:1] config error"]


def test_a_line_every_rank_said_is_printed_at_once_but_never_before_earlier_lines():
    merger = Merger(window=0.5, world_size=2)
    add(merger, 0, "all", 0.0)
    add(merger, 1, "all", 0.1)
    assert lines(merger.pop_ready(0.1)) == ["[h:0] all (and on rank 1)"]
    add(merger, 0, "first", 0.2)
    add(merger, 1, "all again", 0.3)
    add(merger, 0, "all again", 0.3)
    assert merger.pop_ready(0.3) == []                          # "first" may still be joined
    assert lines(merger.pop_ready(0.7)) == ["[h:0] first", "[h:1] all again (and on rank 0)"]


def test_different_lines_are_never_merged_and_keep_their_order():
    merger = Merger(window=0.5, world_size=3)
    for rank, text in [(0, "a"), (1, "b"), (2, "a"), (1, "c"), (0, "b")]:
        add(merger, rank, text, 0.0)
    assert lines(merger.pop_ready(1.0)) == ["[h:0] a (and on rank 2)", "[h:1] b (and on rank 0)", "[h:1] c"]


def test_a_rank_keeps_its_own_order():
    merger = Merger(window=0.5, world_size=2)
    add(merger, 1, "B", 0.0)
    add(merger, 0, "A", 0.0)
    add(merger, 0, "B", 0.0)   # joining rank 1's B would print it before rank 0's own A
    assert lines(merger.pop_ready(1.0)) == ["[h:1] B", "[h:0] A", "[h:0] B"]


def test_a_rank_repeating_a_line_gets_it_printed_twice():
    merger = Merger(window=0.5, world_size=2)
    for rank in (0, 0, 1, 1, 1):
        add(merger, rank, "tick", 0.0)
    assert lines(merger.pop_ready(0.0)) == ["[h:0] tick (and on rank 1)"] * 2
    assert lines(merger.pop_ready(0.5)) == ["[h:1] tick"]


def test_stdout_and_stderr_are_merged_separately_and_stay_in_order():
    merger = Merger(window=0.5, world_size=2)
    add(merger, 0, "x", 0.0, fd=1)
    add(merger, 1, "x", 0.0, fd=2)
    merger.add(1, 0, b"[h:0] ", b"3%", 0.1, alone=True)         # a thinned progress line joins nothing
    merger.add(1, 1, b"[h:1] ", b"3%", 0.1, alone=True)
    assert merger.pop_ready(0.2) == []                          # they wait behind the held lines
    assert merger.pop_ready(0.5) == [(1, b"[h:0] x\n"), (2, b"[h:1] x\n"), (1, b"[h:0] 3%\n"),
                                     (1, b"[h:1] 3%\n")]


def test_one_rank_is_never_held():
    merger = Merger(window=0.5, world_size=1)
    add(merger, 0, "now", 0.0)
    assert lines(merger.pop_ready(0.0)) == ["[h:0] now"]


# ---------------------------------------------------------------------------------------------
# Board, Thinner

def test_board_one_line_per_rank_and_a_summary_for_those_that_do_not_fit():
    board = Board()
    for rank in range(64):
        board.update((rank, 2), f"[node{rank // 8}:{rank}] ", f"epoch 1: {41 + rank % 7}%|###  |")
    board.update((0, 1), "[node0:0] ", "step 10/100")
    shown = board.lines(width=30, height=12)
    assert shown[:2] == ["[node0:0] step 10/100", "[node0:0] epoch 1: 41%|###  |"]
    assert shown[2] == "[node0:1] epoch 1: 42%|###  |"
    assert len(shown) == 6 and shown[-1] == "ranks 4-63: 41% … 47%"
    assert all(len(line) <= 29 for line in shown)


def test_board_a_cleared_or_ended_bar_goes():
    board = Board()
    board.update((0, 2), "[h:0] ", "50%")
    board.update((1, 2), "[h:1] ", "50%")
    board.update((0, 2), "[h:0] ", "    ")                      # tqdm leave=False clears its line
    assert board.end((1, 2)) and not board.end((1, 2))
    assert board.lines(80, 24) == []


def test_summary_and_fit():
    assert summary([2, 3], ["10 it", "12 it"]) == "ranks 2-3: 2 bars"
    assert summary([2, 3], ["5%", "5%"]) == "ranks 2-3: 5%"
    assert fit("a\tb\x1b[31mred\x1b[0m" + "x" * 100, 10) == "a bredxxx"  # one column spare
    assert fit("日本語x", 6) == "日本"                             # two columns each


def test_thinner_at_most_one_line_per_interval_and_the_last_state_of_a_cleared_bar():
    thinner = Thinner(interval=30.0)
    key = (0, 2)
    assert thinner.update(key, b"1%", 0.0) == b"1%"             # a bar's first state is shown
    assert thinner.update(key, b"2%", 10.0) is None
    assert thinner.update(key, b"3%", 30.0) == b"3%"
    assert thinner.update(key, b"4%", 31.0) is None
    assert thinner.update(key, b"   ", 32.0) == b"4%"          # cleared: its last state
    assert thinner.update(key, b"   ", 33.0) is None
    assert thinner.update((1, 2), b"9%", 33.0) == b"9%"         # each rank its own interval
    thinner.update(key, b"5%", 40.0)
    thinner.end(key)                                            # its final line came: 5% is stale
    assert thinner.update(key, b"  ", 41.0) is None


def test_env_seconds(monkeypatch):
    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, "0.5")
    assert env_seconds(PROGRESS_INTERVAL_ENV, 30.0) == 0.5
    monkeypatch.delenv(PROGRESS_INTERVAL_ENV)
    assert env_seconds(PROGRESS_INTERVAL_ENV, 30.0) == 30.0
    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, "soon")
    with pytest.raises(CrewError, match="CREW_PROGRESS_INTERVAL='soon': expected a number of seconds"):
        env_seconds(PROGRESS_INTERVAL_ENV, 30.0)


# ---------------------------------------------------------------------------------------------
# Console

def test_console_on_a_terminal_draws_bars_in_place_and_leaves_it_clean():
    term = io.BytesIO()
    console = Console(term, term, tty=True)
    console.begin(1)
    console.agent_line(2, PROGRESS_MARK + b"[h:0] bar 10%\n")
    time.sleep(0.3)                                              # the ticker draws it
    console.agent_line(2, PROGRESS_MARK + b"[h:0] bar 50%\n")
    console.agent_line(1, b"[h:0] hello\n")                      # above the bar, which is drawn again
    console.agent_line(2, b"[h:0] bar 100%\n")                   # the final state ends the bar
    console.agent_line(2, b"Warning: Permanently added 'node2'\n")  # ssh's own words, as they came
    console.say("done")
    console.end()
    data = term.getvalue()
    assert b"bar 10%" in data and b"bar 50%" in data and b"\x1b[J" in data
    screen, column = replay(data.replace(b"\n", b"\r\n"))  # as a terminal's line discipline does
    assert screen == ["[h:0] hello", "[h:0] bar 100%", "Warning: Permanently added 'node2'", "crew: done", ""]
    assert column == 0


def test_console_not_a_terminal_holds_lines_for_merging_but_not_its_own(monkeypatch):
    out, err = io.BytesIO(), io.BytesIO()
    console = Console(out, err, tty=False)
    console.begin(2)
    console.agent_line(2, b"[h:0] boom\n")
    console.agent_line(2, b"[h:1] boom\n")                       # every rank said it: out at once
    console.agent_line(1, b"[h:1] only one\n")
    assert out.getvalue() == b"" and err.getvalue() == b"[h:0] boom (and on rank 1)\n"
    console.say("rank 1 failed")                                 # what is held goes first
    assert out.getvalue() == b"[h:1] only one\n"
    assert err.getvalue().endswith(b"crew: rank 1 failed\n")
    console.end()
    assert b"\x1b" not in out.getvalue() + err.getvalue()
