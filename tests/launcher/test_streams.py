"""A rank stream cut into lines and progress-bar updates (crew/launcher/node/streams.py): pure, no processes."""

from __future__ import annotations

import pytest

from crew.launcher.node.streams import LINE, MAX_LINE, PROGRESS, StreamSplitter, segments

L, P = LINE, PROGRESS


def feed(chunks: list[bytes], close: bool = True) -> tuple[list, bytes]:
    """The items of a stream arriving in `chunks`, and the bytes consumed (what the rank log gets)."""
    splitter, items, raw = StreamSplitter(), [], b""
    for chunk in chunks:
        done, used = splitter.feed(chunk)
        items, raw = items + done, raw + used
    if close:
        done, used = splitter.close()
        items, raw = items + done, raw + used
    return items, raw


@pytest.mark.parametrize("buffer, pieces, used", [
    (b"", [], 0),
    (b"partial", [], 0),
    (b"a\nb\r\nc", [(b"a", b"\n"), (b"b", b"\r\n")], 5),
    (b"10%\r20%\r", [(b"10%", b"\r")], 4),                      # the last \r may start a \r\n
    (b"\r\n", [(b"", b"\r\n")], 2),
])
def test_segments(buffer, pieces, used):
    assert segments(buffer) == (pieces, used)


def test_segments_at_the_end_of_the_stream():
    assert segments(b"a\rb\r", final=True) == ([(b"a", b"\r"), (b"b", b"\r")], 4)
    assert segments(b"x\ntail", final=True) == ([(b"x", b"\n"), (b"tail", b"")], 6)


@pytest.mark.parametrize("stream, items", [
    (b"a\nb\r\n\nc", [(L, b"a"), (L, b"b"), (L, b""), (L, b"c")]),
    # tqdm: "\r<state>" per update; close() writes "\r<final>\n"
    (b"\r 0%\r 50%\r100%\n", [(P, b" 0%"), (P, b" 50%"), (L, b"100%")]),
    # "<state>\r" per update (the engine's step line): the last state left open ends as a line
    (b"step 1\rstep 2\r", [(P, b"step 1"), (P, b"step 2"), (L, b"step 2")]),
    # a bar that clears itself (tqdm leave=False) leaves nothing at the end
    (b"\r10%\r     \r", [(P, b"10%"), (P, b"     ")]),
    (b"\r10%\r20%", [(P, b"10%"), (L, b"20%")]),                 # the stream ends mid-bar
    (b"a\n\rb\n", [(L, b"a"), (L, b"b")]),                       # a lone \r is no update
    (b"a\r\r\nb", [(P, b"a"), (L, b""), (L, b"b")]),
])
def test_lines_and_updates(stream, items):
    assert feed([stream]) == (items, stream)


STREAM = b"start\r\n\rbar 1%\rbar 50%\rbar 100%\n\nplain\nwin\r\nstep\r\r\n\r\rend"


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_any_two_chunks_give_what_one_gives(cut):
    assert feed([STREAM[:cut], STREAM[cut:]]) == feed([STREAM])


def test_byte_at_a_time_gives_what_one_chunk_gives_and_every_byte_is_logged():
    items, raw = feed([bytes([b]) for b in STREAM])
    assert (items, raw) == feed([STREAM])
    assert raw == STREAM
    assert items == [(L, b"start"), (P, b"bar 1%"), (P, b"bar 50%"), (L, b"bar 100%"), (L, b""),
                     (L, b"plain"), (L, b"win"), (P, b"step"), (L, b""), (L, b"end")]


def test_a_bars_unterminated_state_is_shown_after_an_idle_and_not_sent_twice():
    splitter = StreamSplitter()
    assert splitter.feed(b"\r 10%") == ([], b"\r")               # tqdm keeps its newest state open
    assert splitter.wants_idle()
    assert splitter.idle() == [(P, b" 10%")]
    assert not splitter.wants_idle() and splitter.idle() == []
    assert splitter.feed(b"\r 20%") == ([], b" 10%\r")           # already shown; now logged
    assert splitter.idle() == [(P, b" 20%")]
    assert splitter.feed(b"\n") == ([(L, b" 20%")], b" 20%\n")   # the final state, as a line
    assert not splitter.wants_idle()
    assert splitter.close() == ([], b"")


def test_an_idle_after_a_trailing_carriage_return():
    splitter = StreamSplitter()
    assert splitter.feed(b"step 5\r") == ([], b"")
    assert splitter.idle() == [(P, b"step 5")]
    assert splitter.feed(b"\n") == ([(L, b"step 5")], b"step 5\r\n")  # it was a \r\n after all


def test_a_partial_ordinary_line_waits_for_its_end():
    splitter = StreamSplitter()
    assert splitter.feed(b"loading... ") == ([], b"")
    assert not splitter.wants_idle()
    assert splitter.feed(b"done\n") == ([(L, b"loading... done")], b"loading... done\n")


def test_an_endless_line_is_passed_on_in_pieces():
    items, raw = feed([b"x" * (MAX_LINE + 1)], close=False)
    assert items == [(L, b"x" * (MAX_LINE + 1))] and len(raw) == MAX_LINE + 1
