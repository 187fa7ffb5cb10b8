"""The phase contract: event classification and the expected-row oracle, exact rows."""

import pytest

from harness.contract import ContractError, classify_span, count_events, require_metadata
from harness.families.qwen2_5_omni.contract import RowRef, expected_rows
from harness.records import SpanRecord


@pytest.mark.parametrize(
    "P,c,n,rows,expect",
    [
        # P, c, n, rows -> (is_prefill, nonzero_offset, cross_boundary, multi_decode, one_token_tail, row_mismatch)
        (8, 0, 8, 8, (True, False, False, False, False, False)),  # whole prompt at once
        (8, 0, 4, 8, (True, False, False, False, False, True)),  # first chunk; main returns all P rows
        (8, 4, 4, 4, (True, True, False, False, False, False)),  # non-zero-offset chunk
        (8, 7, 1, 1, (True, True, False, False, True, False)),  # one-token prefill tail
        (8, 8, 1, 1, (False, False, False, False, False, False)),  # plain decode
        (8, 9, 3, 3, (False, False, False, True, False, False)),  # verify / replay of generated positions
        (8, 0, 12, 8, (True, False, True, False, False, True)),  # replay crossing P from 0
        (8, 5, 6, 6, (True, True, True, False, False, False)),  # replay chunk crossing P at an offset
        (8, 7, 2, 2, (True, True, True, False, False, False)),  # the smallest crossing span
        (8, 6, 2, None, (True, True, False, False, False, False)),  # rows unknown: no mismatch claimed
    ],
)
def test_classify_span(P, c, n, rows, expect):
    ev = classify_span(P, c, n, rows)
    assert (ev.is_prefill, ev.nonzero_offset, ev.cross_boundary, ev.multi_decode, ev.one_token_tail,
            ev.row_mismatch) == expect


@pytest.mark.parametrize("P,c,n", [(8, -1, 1), (8, 0, 0), (-1, 0, 1)])
def test_classify_span_rejects_invalid(P, c, n):
    with pytest.raises(ValueError):
        classify_span(P, c, n)


def test_one_token_tail_takes_its_own_prompt_row():
    assert expected_rows(P=8, c=7, n=1, num_thinker_tokens=5) == [RowRef("prompt", 7)]


def test_chunk_at_offset_takes_rows_at_its_offset():
    assert expected_rows(8, 3, 3, 5) == [RowRef("prompt", 3), RowRef("prompt", 4), RowRef("prompt", 5)]


def test_decode_position_takes_reply_row_k():
    # P=8: position 8 is k=0 -> thinker_result[1]; position 10 is k=2 -> thinker_result[3]
    assert expected_rows(8, 8, 1, 5) == [RowRef("reply", 0)]
    assert expected_rows(8, 10, 1, 5) == [RowRef("reply", 2)]


def test_replay_crossing_prompt_boundary_uses_both():
    assert expected_rows(8, 6, 4, 5) == [RowRef("prompt", 6), RowRef("prompt", 7), RowRef("reply", 0),
                                         RowRef("reply", 1)]


def test_spans_past_reply_end_get_eos_then_persistent_pad():
    # thinker_result has 3 rows: reply = thinker_result[1:] (2 rows) ++ [eos] ++ [pad]; P=4.
    rows = expected_rows(4, 4, 7, 3)
    assert rows == [RowRef("reply", 0), RowRef("reply", 1), RowRef("text_eos", 2), RowRef("text_pad", 3),
                    RowRef("text_pad", 4), RowRef("text_pad", 5), RowRef("text_pad", 6)]
    assert expected_rows(4, 100, 2, 3) == [RowRef("text_pad", 96), RowRef("text_pad", 97)]


def test_same_span_twice_gives_identical_rows():
    assert expected_rows(60, 50, 32, 70) == expected_rows(60, 50, 32, 70)
    # a decode step, a verify span and a replay covering the same position agree on it
    decode = expected_rows(60, 75, 1, 70)[0]
    verify = expected_rows(60, 74, 3, 70)[1]
    replay = expected_rows(60, 0, 90, 70)[75]
    assert decode == verify == replay == RowRef("reply", 15)


@pytest.mark.parametrize("P,c,n,k", [(1, 0, 1, 5), (8, -1, 1, 5), (8, 0, 0, 5), (8, 0, 1, 0)])
def test_expected_rows_rejects_impossible_inputs(P, c, n, k):
    with pytest.raises(ContractError):
        expected_rows(P, c, n, k)


def test_require_metadata_names_missing_keys():
    require_metadata({"_omni_prompt_len": 8, "_omni_num_computed_tokens": 0})
    with pytest.raises(ContractError, match="_omni_num_computed_tokens"):
        require_metadata({"_omni_prompt_len": 8})


def _span(P, c, n, rows, misaligned=0):
    return SpanRecord("a", "d", 1, "r", 0, P, c, n, rows, misaligned=misaligned)


def test_count_events_exact():
    spans = [_span(8, 0, 4, 8), _span(8, 4, 4, 8), _span(8, 8, 1, 1), _span(8, 0, 10, 8, misaligned=3),
             _span(8, 10, 2, 8, misaligned=2)]
    ev = count_events(spans)
    assert (ev.talker_calls, ev.prefill_calls, ev.nonzero_offset_chunks, ev.cross_boundary_replays,
            ev.multi_position_decode_spans, ev.one_token_tails, ev.row_count_mismatches,
            ev.prefill_row_count_mismatches, ev.misaligned_positions) == (5, 3, 1, 1, 1, 0, 4, 3, 5)
