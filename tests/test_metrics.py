"""Every count is defined once (harness/metrics.py) and every table, plot and rule reads that
definition: these tests keep the readers and the records in step with it."""

from __future__ import annotations

import dataclasses

from harness import metrics
from harness.records import EventCounts


def test_event_counts_has_one_field_per_metric_in_order():
    assert [f.name for f in dataclasses.fields(EventCounts)] == [m.name for m in metrics.METRICS]


def test_each_metric_counts_known_flags_or_a_span_field_or_is_the_records():
    for m in metrics.METRICS:
        assert [m.flags is not None, m.span_field is not None, m.record].count(True) == 1, m.name
        assert set(m.flags or ()) <= set(metrics.EVENTS), m.name
    assert metrics.EVENT_COUNTS["prefill_row_count_mismatches"] == ("row_mismatch", "is_prefill")
    assert metrics.MISALIGNED_COUNTS == {"misaligned_positions": "misaligned",
                                         "misaligned_text_positions": "misaligned_text",
                                         "misaligned_end_positions": "misaligned_end"}
    assert metrics.RECORD_COUNTS == ("replays_ending_in_text", "cross_request_positions")


def test_the_gate_and_the_map_read_the_definitions():
    from harness import gate
    from harness.sweep import gate as sweep_gate

    assert gate.STRESS_METRICS == ("nonzero_offset_chunks", "cross_boundary_replays")
    assert sweep_gate.STRESS_EVENTS == ("nonzero_offset_chunks", "cross_boundary_replays",
                                        "multi_position_decode_spans")
    gated = [name for name in gate.METRICS if name in metrics.BY_NAME]
    assert gated == list(metrics.GATED_COUNTS)
    assert gate.METRICS["cross_boundary_replays"] == metrics.BY_NAME["cross_boundary_replays"].label
    assert "talker_calls" not in gate.METRICS  # not gateable


def test_fidelity_labels_come_from_the_definitions():
    from harness.report import fidelity

    labels = {m.key: m.label for m in fidelity.METRICS}
    assert labels["cross_boundary_replays"] == metrics.BY_NAME["cross_boundary_replays"].short == "crossing replays"
    assert labels["misaligned_text"] == "misaligned (text)"


def test_the_seed_table_and_the_events_plot_read_the_definitions():
    from harness.report import plots, tables

    assert tables.SEED_COLUMNS[3:] == ["Non-zero-offset prefill chunks", "Replays crossing the prompt boundary"]
    assert [name for name, _ in plots.EVENT_METRICS] == [
        "nonzero_offset_chunks", "cross_boundary_replays", "multi_position_decode_spans", "one_token_tails",
        "row_count_mismatches", "preemptions"]
    assert dict(plots.EVENT_METRICS)["one_token_tails"] == metrics.BY_NAME["one_token_tails"].label
