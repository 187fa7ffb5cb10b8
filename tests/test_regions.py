"""Misaligned positions in two regions, and one definition of the span events (harness.contract.EVENTS)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from harness.contract import EVENT_COUNTS, EVENT_FIELDS, EVENTS, classify_span, count_events, misaligned_regions
from harness.records import EventCounts, SpanRecord, span_from_dict, to_json
from harness.serve.backend import span_from_line


def test_regions_split_at_text_eos() -> None:
    """P = 10, reply of 3 tokens (thinker_result[1:]): positions < 10 prompt, 10..12 reply, 13 text-EOS
    (all text region), 14 and later the end region."""
    assert misaligned_regions([], 10, 3) == (0, 0)
    assert misaligned_regions([0, 9, 10, 12, 13], 10, 3) == (5, 0)
    assert misaligned_regions([13, 14, 15, 400], 10, 3) == (1, 3)
    assert misaligned_regions(np.arange(0, 20), 10, 0) == (11, 9)  # empty reply: text-EOS at P


def test_span_record_computes_its_own_flags() -> None:
    span = SpanRecord("a", "stress", 1, "p", 7, 8, 5, 6, 6, misaligned_text=2, misaligned_end=1)
    assert (span.is_prefill, span.nonzero_offset, span.cross_boundary, span.multi_decode, span.one_token_tail,
            span.row_mismatch) == (True, True, True, False, False, False)
    assert span.misaligned == 3
    with pytest.raises(TypeError):
        SpanRecord("a", "stress", 1, "p", 7, 8, 5, 6, 6, nonzero_offset=False)  # type: ignore[call-arg]
    # flags in a spans.jsonl line are recomputed, not trusted
    data = json.loads(to_json(span))
    data.update(cross_boundary=False, row_mismatch=True)
    again = span_from_dict(data)
    assert again == span and again.cross_boundary and not again.row_mismatch
    # a raising call delivered no rows: a row-count mismatch, misalignment unknown
    failed = SpanRecord("a", "stress", 1, "p", 7, 8, 0, 4, rows=0, error="ValueError: no")
    assert failed.row_mismatch and failed.misaligned is None


def test_record_flags_are_the_contract_table() -> None:
    assert EVENT_FIELDS == tuple(EVENTS)
    span_fields = {f.name for f in dataclasses.fields(SpanRecord) if not f.init}
    assert span_fields == set(EVENT_FIELDS)
    counted = {f.name for f in dataclasses.fields(EventCounts)}
    assert set(EVENT_COUNTS) | {"misaligned_positions", "misaligned_text_positions",
                                "misaligned_end_positions", "replays_ending_in_text", "cross_request_positions"} == counted
    for args in [(8, 0, 8, 8), (8, 0, 4, 8), (8, 4, 4, 4), (8, 7, 1, 1), (8, 9, 3, 3), (8, 0, 12, 8)]:
        span = SpanRecord("a", "d", 1, "r", 0, *args)
        assert {k: getattr(span, k) for k in EVENT_FIELDS} == dataclasses.asdict(classify_span(*args))


def test_count_events_sums_the_regions() -> None:
    spans = [SpanRecord("a", "d", 1, "r", 0, 8, 0, 8, 8, misaligned_text=3, misaligned_end=0),
             SpanRecord("a", "d", 1, "r", 1, 8, 8, 1, 1, misaligned_text=0, misaligned_end=1),
             SpanRecord("a", "d", 1, "r", 2, 8, 9, 1, 1, misaligned=2),  # written before the split: text
             SpanRecord("a", "d", 1, "r", 3, 8, 10, 1, 1)]  # not measured
    ev = count_events(spans)
    assert (ev.misaligned_text_positions, ev.misaligned_end_positions, ev.misaligned_positions) == (5, 1, 6)
    assert (ev.talker_calls, ev.prefill_calls) == (4, 1)


def test_real_backend_trace_lines_carry_the_regions() -> None:
    """The real backend's trace plugin writes the same two counts when the worker checks rows."""
    line = {"_omni_prompt_len": 90, "_omni_num_computed_tokens": 32, "span_len": 32, "rows": 90, "step": 4}
    span = span_from_line(line, "main", "stress", 1, "p01")
    assert span is not None and span.row_mismatch and span.nonzero_offset and span.misaligned is None
    span = span_from_line({**line, "misaligned_text": 32, "misaligned_end": 0}, "main", "stress", 1, "p01")
    assert span is not None and (span.misaligned_text, span.misaligned_end, span.misaligned) == (32, 0, 32)
    span = span_from_line({**line, "misaligned_text": "x", "misaligned_end": -1}, "main", "stress", 1, "p01")
    assert span is not None and span.misaligned is None
