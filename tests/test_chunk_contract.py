"""The Code2Wav chunk contract (harness/chunk_contract.py): the shipped window rule and each way a window
can break it, counted once per window and re-aligned after (hand-built streams, exact violations)."""

from __future__ import annotations

from harness.chunk_contract import SHIPPED, ChunkRule, Window, check_windows

STREAM = list(range(100, 174))  # 74 distinct codes: the smoke texts' stream length


def _w(a: int, b: int, finished: bool = False, stream: list[int] = STREAM) -> Window:
    return Window(tuple(stream[a:b]), 0, finished)


def _kinds(windows: list[Window], stream: list[int] = STREAM, **kw) -> list[tuple[int | None, str]]:
    return [(v.window, v.kind) for v in check_windows(windows, stream, **kw).violations]


def test_the_shipped_rule_sends_one_frame_then_windows_of_25():
    assert SHIPPED.boundaries(74) == [1, 25, 25, 23]
    assert SHIPPED.boundaries(51) == [1, 25, 25] and SHIPPED.boundaries(1) == [1] and SHIPPED.boundaries(0) == []
    assert ChunkRule(chunk_frames=25, initial_frames=0).boundaries(30) == [25, 5]
    assert ChunkRule(chunk_frames=4, initial_frames=4).boundaries(9) == [4, 4, 1]  # no early window when equal


def test_a_stream_sent_as_the_release_sends_it_has_no_violation():
    result = check_windows([_w(0, 1), _w(1, 26), _w(26, 51), _w(51, 74, True)], STREAM)
    assert (result.windows, result.frames_sent, result.count, result.first) == (4, (1, 25, 25, 23), 0, None)
    # a stream that ends on a boundary: the last window is empty and says finished
    assert _kinds([_w(0, 1), _w(1, 26), _w(26, 51), Window((), 0, True)], STREAM[:51]) == []


def test_a_dropped_window_boundary_frame_is_one_violation_and_the_rest_realigns():
    result = check_windows([_w(0, 1), _w(1, 26), _w(27, 52), _w(52, 74, True)], STREAM)
    assert [(v.window, v.kind) for v in result.violations] == [(2, "dropped")]
    assert result.first == "window 2: frames 26-26 never sent (it carries frames 27-51)"


def test_a_frame_lost_inside_a_window_is_one_violation():
    lost = Window(tuple(STREAM[1:6] + STREAM[7:26]))
    result = check_windows([_w(0, 1), lost, _w(26, 51), _w(51, 74, True)], STREAM)
    assert [(v.window, v.kind, v.text) for v in result.violations] == [
        (1, "dropped", "window 1: 1 frame lost inside frames 1-25")]
    assert result.frames_sent == (1, 24, 25, 23)


def test_a_resent_window_and_a_repeated_frame_are_duplicates():
    assert _kinds([_w(0, 1), _w(1, 26), _w(1, 26), _w(26, 51), _w(51, 74, True)]) == [(2, "duplicated")]
    repeated = Window(tuple(STREAM[1:6] + STREAM[5:26]))
    assert _kinds([_w(0, 1), repeated, _w(26, 51), _w(51, 74, True)]) == [(1, "duplicated")]


def test_another_requests_frames_are_foreign_and_unknown_ones_wrong():
    other = list(range(500, 574))
    result = check_windows([_w(0, 1), _w(1, 26, stream=other), _w(26, 51), _w(51, 74, True)], STREAM,
                           others={"t02-plants": other})
    assert [(v.window, v.kind, v.text) for v in result.violations] == [
        (1, "foreign", "window 1: 25 request t02-plants's frames where frames 1-25 belong")]
    zeroed = Window(tuple(STREAM[1:22] + [0] + STREAM[23:26]))
    result = check_windows([_w(0, 1), zeroed, _w(26, 51), _w(51, 74, True)], STREAM)
    assert [(v.window, v.kind, v.text) for v in result.violations] == [
        (1, "wrong-frames", "window 1: 1 of 25 frames wrong in frames 1-25 (frame 22: 0 where the Talker fed 122)")]


def test_missing_frames_at_the_end_and_a_missing_finish_are_counted_at_the_end():
    result = check_windows([_w(0, 1), _w(1, 26), _w(26, 51), _w(51, 72, True)], STREAM)
    assert [(v.window, v.kind, v.text) for v in result.violations] == [
        (None, "missing", "frames 72-73 of 74 never sent")]
    assert _kinds([_w(0, 1), _w(1, 26), _w(26, 51), _w(51, 74)]) == [(None, "unfinished")]
    assert _kinds([_w(0, 1, True), _w(1, 26), _w(26, 51), _w(51, 74, True)]) == [(1, "early-finish"),
                                                                                   (2, "early-finish"),
                                                                                   (3, "early-finish")]


def test_window_sizes_and_left_context_follow_the_rule():
    assert _kinds([_w(0, 2), _w(2, 26), _w(26, 51), _w(51, 74, True)]) == [(0, "size"), (1, "size")]
    with_context = Window(tuple(STREAM[0:26]), left_context=1)
    assert _kinds([_w(0, 1), with_context, _w(26, 51), _w(51, 74, True)]) == [(1, "left-context")]
    rule = ChunkRule(chunk_frames=25, initial_frames=1, left_context=2)
    ok = [_w(0, 1), Window(tuple(STREAM[0:26]), 1), Window(tuple(STREAM[24:51]), 2),
          Window(tuple(STREAM[49:74]), 2, True)]
    assert _kinds(ok, rule=rule) == []
