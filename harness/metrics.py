"""Every metric the harness counts, defined once: its name, what it measures, its table column, and
where it is used (the gate's stress evidence, a map's stressed point, the events plot).

The lowest module of the harness (no harness imports): records compute a span's flags from
``EVENTS`` here, and the contract, report, plots, gate, sweep and fidelity read ``METRICS``. A new
span event is a predicate in ``EVENTS``; a new count is one ``Metric`` (and its ``EventCounts``
field, ``harness.records``, which ``tests/test_metrics.py`` keeps in step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The one definition of the span events: name -> predicate over (P, c, n, rows). The predicates use
# only comparisons and ``&``, so they take Python ints (one span) and numpy columns (a whole
# spans.jsonl) alike; ``classify_span``, ``classify_spans``, ``SpanRecord``'s flags, ``count_events``
# and the report's vectorised counts are all generated from this table.
EVENTS: dict[str, Callable[[Any, Any, Any, Any], Any]] = {
    "is_prefill": lambda P, c, n, rows: c < P,
    # 0 < c < P: a prefill chunk that does not start at row 0
    "nonzero_offset": lambda P, c, n, rows: (c > 0) & (c < P),
    # c < P < c + n: a replay covering prompt and generated positions
    "cross_boundary": lambda P, c, n, rows: (c < P) & (P < c + n),
    # c >= P and n > 1: replay of generated positions, or a speculative-decoding verify span
    "multi_decode": lambda P, c, n, rows: (c >= P) & (n > 1),
    # 0 < c < P and n == 1
    "one_token_tail": lambda P, c, n, rows: (c > 0) & (c < P) & (n == 1),
    # rows returned != n
    "row_mismatch": lambda P, c, n, rows: rows != n,
}
EVENT_FIELDS = tuple(EVENTS)

def _table_flags(P: int, c: int, n: int, rows: int | None) -> dict[str, bool]:
    return {name: bool(pred(P, c, n, rows)) for name, pred in EVENTS.items()}


# A decode span (one position past the prompt, one row back) is most spans of a run (about 58,000 of
# 73,000 in the default matrix): its flags are the same for every such span, since the predicates
# compare c with P, n with 1 and rows with n only; computed once here from the table itself.
_DECODE_FLAGS = _table_flags(2, 2, 1, 1)


def span_flags(P: int, c: int, n: int, rows: int | None = None) -> dict[str, bool]:
    """The event flags of one span ({name: bool}); ``rows`` None: no row-count mismatch claimed."""
    if n == 1 and rows == 1 and c >= P >= 0 and type(c) is int and type(P) is int:
        return dict(_DECODE_FLAGS)
    if P < 0 or c < 0 or n < 1:
        raise ValueError(f"invalid span: P={P} c={c} n={n}")
    flags = _table_flags(P, c, n, rows)
    if rows is None:
        flags["row_mismatch"] = False
    return flags


@dataclass(frozen=True)
class Metric:
    """One count of a request (summed over a cell)."""

    name: str  # the EventCounts field, the gate rule's metric (max_NAME, min_NAME), the JSON key
    label: str  # what it measures, in words (gate messages, plot legends, docs)
    column: str  # its table column
    short: str  # its name in a compact table (fidelity)
    flags: tuple[str, ...] | None = None  # counts spans whose EVENTS flags are all true (() : every call)
    span_field: str | None = None  # else: sums this SpanRecord field (misaligned positions)
    stress: bool = False  # evidence that a stress deploy stressed: the gate's minimum-stress rules
    stressed_point: bool = False  # a map point counts as stressed when any such metric is > 0
    plot: bool = False  # drawn in the events plot (harness.report.plots)
    gate: bool = True  # a gate rule may bound it (max_NAME / min_NAME)
    # A column of the per-cell (extended) table and, with ``per_request``, of the per-request tables
    # (terminal, summary.md, requests.csv, summary.json, report.html; harness.report.tables): its heading
    # there (None: no column), shown as ``count/ratio_of's count`` when ``ratio_of`` names another metric,
    # headed ``compact`` in report.html's narrow per-request table with ``tip`` (default: ``label``) as its
    # tooltip. A flag count reads n/a in a cell run with --trace off, a span-field count where the backend
    # does not measure it.
    table: str | None = None
    ratio_of: str | None = None
    per_request: bool = True
    compact: str | None = None
    tip: str | None = None
    # counted per request by the backend that knows more than the span columns hold (the request's text length,
    # ``count_events(spans, text_len)``; whose rows a position ran with, ``SimRunner.cross``): the tables and the
    # gate read it from the records (the sim's; a real backend does not measure it, unless ``real_text``)
    record: bool = False
    # a record count the real backend counts too, where the worker's contract check reported each request's text
    # length (``RequestRecord.text_len``); a real cell without it: not measured
    real_text: bool = False


METRICS: tuple[Metric, ...] = (
    Metric("talker_calls", "talker_preprocess calls", "Talker calls", "Talker calls", flags=(), gate=False),
    Metric("prefill_calls", "prefill calls", "Prefill calls", "prefill calls", flags=("is_prefill",), gate=False),
    Metric("nonzero_offset_chunks", "non-zero-offset prefill chunks", "Non-zero-offset prefill chunks",
           "non-zero-offset chunks", flags=("nonzero_offset",), stress=True, stressed_point=True, plot=True,
           table="Non-zero-offset chunks", compact="Chunks"),
    Metric("cross_boundary_replays", "replays crossing the prompt boundary", "Replays crossing the prompt boundary",
           "crossing replays", flags=("cross_boundary",), stress=True, stressed_point=True, plot=True,
           table="Cross-boundary replays", compact="Replays"),
    Metric("replays_ending_in_text", "multi-position spans (replays, their chunks, verify spans) ending inside "
           "the text region", "Replays ending in the text", "replays ending in text", record=True, real_text=True),
    Metric("multi_position_decode_spans", "multi-position decode spans", "Multi-position decode spans",
           "multi-position decode spans", flags=("multi_decode",), stressed_point=True, plot=True,
           table="Multi-position decode spans", compact="Multi-pos. decode"),
    Metric("one_token_tails", "one-token prefill tails", "One-token prefill tails", "one-token tails",
           flags=("one_token_tail",), plot=True, table="One-token tails", per_request=False),
    Metric("row_count_mismatches", "row-count mismatches", "Row-count mismatches", "row-count mismatches",
           flags=("row_mismatch",), plot=True),
    Metric("prefill_row_count_mismatches", "row-count mismatches in prefill calls", "Prefill row-count mismatches",
           "prefill row-count mismatches", flags=("row_mismatch", "is_prefill"), gate=False,
           table="Row-count mismatches / prefill calls", ratio_of="prefill_calls",
           compact="Row-count mism. / prefill", tip="row-count mismatches / prefill calls"),
    Metric("misaligned_positions", "misaligned positions (both regions)", "Misaligned positions",
           "misaligned", span_field="misaligned"),
    Metric("misaligned_text_positions", "misaligned positions in the text region", "Misaligned (text)",
           "misaligned (text)", span_field="misaligned_text", table="Misaligned (text)", compact="Misal. (text)",
           tip="misaligned positions up to and including text-EOS"),
    Metric("misaligned_end_positions", "misaligned positions in the end region", "Misaligned (end)",
           "misaligned (end)", span_field="misaligned_end", table="Misaligned (end)", compact="Misal. (end)",
           tip="misaligned positions after text-EOS"),
    Metric("cross_request_positions", "positions conditioned on another request's rows (its text row, or its "
           "hidden state handed to the code predictor)", "Cross-request positions", "cross-request positions",
           record=True),
)
BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}

# EventCounts field -> the event flags whose conjunction it counts (``talker_calls`` counts every call).
EVENT_COUNTS: dict[str, tuple[str, ...]] = {m.name: m.flags for m in METRICS if m.flags is not None}
# EventCounts field -> the SpanRecord field summed into it (misaligned positions, by region).
MISALIGNED_COUNTS: dict[str, str] = {m.name: m.span_field for m in METRICS if m.span_field is not None}
# EventCounts fields the backend counts per request from what it knows of the text (Metric.record)
RECORD_COUNTS: tuple[str, ...] = tuple(m.name for m in METRICS if m.record)
# of those, the ones a real backend counts from the text length its worker reported (Metric.real_text)
REAL_TEXT_COUNTS: tuple[str, ...] = tuple(m.name for m in METRICS if m.real_text)
GATED_COUNTS: tuple[str, ...] = tuple(m.name for m in METRICS if m.gate)
STRESS_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.stress)
STRESSED_POINT_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.stressed_point)
TABLE_METRICS: tuple[Metric, ...] = tuple(m for m in METRICS if m.table)  # the tables' count columns, in order
