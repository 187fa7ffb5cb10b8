"""Issue 31 item 3: the streaming metrics (``harness.stream_metrics``), on hand-computed streams.

Times and rates are chosen so every value is an exact binary fraction: the expectations are exact."""

from __future__ import annotations

import pytest

from harness.stream_metrics import Chunk, StreamError, Underrun, frames_of, stream_metrics


def test_a_stream_that_runs_dry_once() -> None:
    # 1000 Hz. Chunk 1 (0.25 s of audio) at 0.5 plays 0.5-0.75; chunk 2 (0.5 s) arrives at 0.625, before it
    # is due (0.75), plays 0.75-1.25; chunk 3 is due at 1.25 and arrives at 1.5: the player waits 0.25 s,
    # plays it 1.5-1.75; chunk 4 arrives at 1.625, before 1.75. A frameless piece at 1.75 (a header, a
    # text delta) is no audio chunk. The stream ends at 2.0 with 2.0 s of audio: RTF 1.
    chunks = [Chunk(0.5, 250), Chunk(0.625, 500), Chunk(1.5, 250), Chunk(1.625, 1000), Chunk(1.75, 0)]
    m = stream_metrics(chunks, 1000, sent_at=0.0, end_at=2.0)
    assert (m.chunks, m.frames, m.audio_s, m.ttfa_s, m.end_s) == (4, 2000, 2.0, 0.5, 2.0)
    assert m.gaps_s == (0.125, 0.875, 0.125)
    assert m.underruns == (Underrun(1.25, 0.25),)
    assert (m.underrun_s, m.rtf) == (0.25, 1.0)
    assert m.chunk_frames == (250, 500, 250, 1000)


def test_times_are_relative_to_the_send() -> None:
    chunks = [Chunk(10.5, 250), Chunk(10.625, 500), Chunk(11.5, 250), Chunk(11.625, 1000)]
    m = stream_metrics(chunks, 1000, sent_at=10.0)
    assert (m.ttfa_s, m.end_s, m.gaps_s, m.underruns) == (0.5, 1.625, (0.125, 0.875, 0.125), (Underrun(1.25, 0.25),))
    assert m.rtf == 1.625 / 2.0


def test_the_player_waits_and_then_goes_on_from_the_late_chunk() -> None:
    # 4 Hz: chunk 1 (1 s) plays 1-2; chunk 2 due 2, arrives 3 (underrun 2..3), plays 3-3.5; chunk 3 arrives
    # 3.25 < 3.5, plays 3.5-4; chunk 4 due 4, arrives 4.5 (underrun 4..4.5). A player that never waited
    # would have had chunk 4 due at 1 + 2.5 = 3.5 and called it 1 s late: the wait moved its clock.
    m = stream_metrics([Chunk(1.0, 4), Chunk(3.0, 2), Chunk(3.25, 2), Chunk(4.5, 4)], 4)
    assert m.underruns == (Underrun(2.0, 1.0), Underrun(4.0, 0.5))
    assert (m.underrun_s, m.gaps_s, m.audio_s, m.rtf) == (1.5, (2.0, 0.25, 1.25), 3.0, 1.5)


def test_one_chunk_and_no_chunk() -> None:
    one = stream_metrics([Chunk(0.75, 480)], 24000, end_at=1.0)
    assert (one.chunks, one.ttfa_s, one.gaps_s, one.underruns, one.audio_s, one.end_s) == (1, 0.75, (), (), 0.02, 1.0)
    none = stream_metrics([], 24000, sent_at=5.0, end_at=7.0)
    assert (none.chunks, none.frames, none.ttfa_s, none.rtf, none.end_s, none.underrun_s) == (0, 0, None, None, 2.0, 0)
    headers_only = stream_metrics([Chunk(5.5, 0)], 24000, sent_at=5.0)
    assert (headers_only.chunks, headers_only.ttfa_s, headers_only.end_s) == (0, None, 0.5)


def test_an_arrival_exactly_when_due_is_no_underrun() -> None:
    m = stream_metrics([Chunk(0.0, 2), Chunk(0.5, 2), Chunk(1.0, 2)], 4)
    assert m.underruns == () and m.gaps_s == (0.5, 0.5)


@pytest.mark.parametrize(("chunks", "rate", "end", "message"), [
    ([Chunk(1.0, 1)], 0, None, "sample rate must be a positive integer, got 0"),
    ([Chunk(1.0, 1)], True, None, "sample rate must be a positive integer, got True"),
    ([Chunk(1.0, -1)], 10, None, "chunk 0: frames must be an integer >= 0, got -1"),
    ([Chunk(-0.5, 1)], 10, None, "chunk 0: arrival -0.5 is not after the send (0.0)"),
    ([Chunk(1.0, 1), Chunk(0.5, 1)], 10, None, "chunk 1: arrival 0.5 is before the chunk before it (1.0)"),
    ([Chunk(float("nan"), 1)], 10, None, "chunk 0: arrival nan is not after the send (0.0)"),
    ([Chunk(1.0, 1)], 10, 0.5, "stream end 0.5 is before its last chunk (1.0)"),
])
def test_impossible_streams_are_refused_with_one_message(chunks: list[Chunk], rate: int, end: float | None,
                                                         message: str) -> None:
    with pytest.raises(StreamError) as err:
        stream_metrics(chunks, rate, end_at=end)
    assert str(err.value) == message


def test_frames_count_where_their_last_byte_arrived() -> None:
    # 16-bit mono: 3 bytes hold one frame and half of the next, which completes with the next byte
    assert frames_of([3, 1, 2, 6], 2) == [1, 1, 1, 3]
    assert frames_of([44 - 44, 960, 1], 2) == [0, 480, 0]
    assert sum(frames_of([7, 7, 7, 7], 4)) == 28 // 4
    with pytest.raises(StreamError):
        frames_of([2], 0)
