"""Tables for a run directory: the summary table first (the seed experiment's columns), then the extended,
paired and per-request tables.

Everything here is pure table building (pandas) over a loaded ``Run`` (``harness.report.summary``),
except the entry points ``write_reports`` (writes every format) and ``terminal_table`` (reads and
renders), which ``omni-stress run`` and ``omni-stress report`` call. The gate uses the same
``summarize_cells`` (``harness.report.summary``), so the numbers it judges are the numbers the tables show.

The WER a table shows is ``RequestRecord.score`` (Whisper's when present, else the oracle
transcript's), and the source is always labelled. Misaligned positions are shown in their two
regions, text (prompt and reply up to text-EOS) and end (after text-EOS).

summary.json is indented by ``indented_json`` (the same bytes as ``json.dumps(indent=2)``): json's
indenting encoder runs in Python, a second of ``report`` at 10,000 requests (issue 48).
"""

from __future__ import annotations

import base64
import errno
import html
import json
import math
import pickle
import statistics
import textwrap
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from harness.backends import is_simulated
from harness.config import StreamingSlo
from harness.errors import UserError
from harness.metrics import METRICS, TABLE_METRICS, Metric
from harness.proc import fork_call
from harness.records import EventCounts, RequestRecord, write_file_atomic
from harness.report.style import VERDICT_CSS
from harness.streaming_figures import (THRESHOLDS_S, bench_fields, figures, meets_slo, modelled_fields,
                                      modelled_figures, streamed, worst_stall)
from harness.report.summary import (  # re-exported: callers and tests use report.load_run & co.
    DEFAULT_ROLE,
    ROLES,
    WER_THRESHOLD,
    CellKey,
    CellSummary,
    PairedRow,
    Run,
    SpanTable,
    cell_order,
    group_rows,
    load_run,
    paired_rows,
    reference_deploy_of,
    request_events,
    run_problems,
    summarize_cells,
)

__all__ = ["DEFAULT_ROLE", "ROLES", "CellKey", "CellSummary", "PairedRow", "Run", "SpanTable", "UserError",
           "cell_order", "group_rows", "load_run", "paired_rows", "reference_deploy_of", "request_events",
           "run_problems", "summarize_cells"]

NA = "n/a"
NONE = "\u2013"  # a number that does not apply to the cell (accepted tokens/step without spec decode)

# The seed's table: its WER columns, then the counts that show the stress happened (harness.metrics)
SEED_METRICS = [m for m in METRICS if m.stress]
SEED_COLUMNS = ["Arm", "WER (mean)", f"Requests with WER > {WER_THRESHOLD}", *(m.column for m in SEED_METRICS)]

WER_SOURCE_TEXT = {
    "whisper": "Whisper",
    "oracle": "oracle transcript",
    "mixed": "mixed (Whisper where transcribed, else oracle transcript)",
    "none": "none (no request scored)",
}


# --------------------------------------------------------------------------- formatting


def fmt_wer(value: float | None) -> str:
    return NA if value is None or math.isnan(value) else f"{value:.3f}"


def fmt_accepted(value: float | None) -> str:
    """Accepted tokens per step, 2 decimals like the seed's 1.47; a dash where no request has it."""
    return NONE if value is None else f"{value:.2f}"


def fmt_ratio(num: int, den: int) -> str:
    return f"{num}/{den}"


def row_label(group: list[CellSummary]) -> str:
    """``main, stress deploy`` plus ``(run 1 / run 2)`` when the row joins repeats, like the seed."""
    label = f"{group[0].arm}, {group[0].deploy} deploy"
    if len(group) > 1:
        label += " (" + " / ".join(f"run {c.run_number}" for c in group) + ")"
    return label


def _join(values: Iterable[str]) -> str:
    return " / ".join(values)


def wer_source(cells: list[CellSummary]) -> str:
    sources = {c.wer_source for c in cells if c.wer_source != "none"}
    if not sources:
        return "none"
    return sources.pop() if len(sources) == 1 else "mixed"


def oracle_origin(run: Run) -> str:
    """What the oracle transcript is, by the backends that made the run's records: the sim's spoken
    word sequence, or what the real server's Talker sampled read back through the speaking table."""
    simulated = {is_simulated(r.backend) for r in run.requests}
    parts = []
    if True in simulated or not simulated:
        parts.append("the sim's spoken word sequence before TTS")
    if False in simulated:
        parts.append("the real Talker's codec stream read back through the speaking checkpoint's table")
    return "; ".join(parts)


def speaking_blind_spots(run: Run) -> str:
    """What the run's family's speaking Talker cannot hear (``Family.speaking_blind_spots``)."""
    from harness.family import get_family
    from harness.rundir import manifest_family

    return get_family(manifest_family(run.manifest)).speaking_blind_spots


def speaks_with_the_speaking_talker(run: Run) -> bool:
    """Whether the run's oracle comes from the speaking Talker: a real-backend record (the oracle exists
    only with the speaking checkpoint) or a sim run with ``--sim-talker speaking``."""
    from harness.rundir import manifest_sim_talker

    return (any(not is_simulated(r.backend) for r in run.requests)
            or manifest_sim_talker(run.manifest) == "speaking")


def wer_source_note(run: Run, cells: list[CellSummary]) -> str:
    """The line under the seed table saying where the WER came from."""
    source = wer_source(cells)
    note = f"WER source: {WER_SOURCE_TEXT[source]}"
    asr = run.manifest.get("asr")
    if source in ("whisper", "mixed") and asr:
        note += f" ({_describe(asr)})"
    if source == "oracle":
        note += f" ({oracle_origin(run)}; no ASR ran)"
        if speaks_with_the_speaking_talker(run):
            note += f"; {speaking_blind_spots(run)}"
    if source == "mixed":
        per_cell = ", ".join(f"{c.arm}/{c.deploy}/run {c.run_number}: {c.wer_source}" for c in cells)
        note += f"; per cell: {per_cell}"
    unmeasurable = sum(c.not_measurable for c in cells)
    if unmeasurable:
        note += (f"; {unmeasurable} request{'s' if unmeasurable > 1 else ''} not measurable (the reference text "
                 "normalises to no words): no WER, counted under 'Not measurable', refused by the gate")
    return note


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
    return str(value)


# --------------------------------------------------------------------------- tables


def seed_table(cells: list[CellSummary]) -> pd.DataFrame:
    """The seed's table: one row per arm x deploy, repeats joined ``run 1 / run 2``."""
    rows = []
    for group in group_rows(cells):
        rows.append({
            SEED_COLUMNS[0]: row_label(group),
            SEED_COLUMNS[1]: _join(fmt_wer(c.mean_wer) for c in group),
            SEED_COLUMNS[2]: _join(fmt_ratio(c.requests_over(), c.scored) for c in group),
            **{m.column: _join(str(getattr(c.events, m.name)) if c.span_facts else NA for c in group)
               for m in SEED_METRICS},
        })
    return pd.DataFrame(rows, columns=SEED_COLUMNS, dtype=object)


# The count columns of the per-cell and per-request tables come from harness.metrics (``Metric.table``), in
# its order; speculative decoding's accepted tokens per step (a record's figure, not a count) follows the
# count of its verify spans.
ACCEPTED = "Accepted tokens/step"
ACCEPTED_AFTER = "multi_position_decode_spans"


def _count_slots(per_request: bool) -> list[Metric | None]:
    """The count columns' metrics in table order, None where ``ACCEPTED`` stands."""
    out: list[Metric | None] = []
    for m in TABLE_METRICS:
        if m.per_request or not per_request:
            out.append(m)
        if m.name == ACCEPTED_AFTER:
            out.append(None)
    return out


def count_columns(per_request: bool = False) -> list[str]:
    """The count columns (``Metric.table``) with ``ACCEPTED`` in its place."""
    return [ACCEPTED if m is None else str(m.table) for m in _count_slots(per_request)]


def count_values(events: EventCounts, accepted: str, misaligned_known: bool, traced: bool = True,
                 per_request: bool = False) -> list[str]:
    """``count_columns``' values: a flag count n/a where the cell was not traced (--trace off), a span-field
    count (misaligned positions) n/a where the backend does not measure it."""
    out = []
    for m in _count_slots(per_request):
        if m is None:
            out.append(accepted)
        elif m.span_field is not None:
            out.append(str(getattr(events, m.name)) if misaligned_known else NA)
        elif not traced:
            out.append(NA)
        else:
            value = getattr(events, m.name)
            out.append(fmt_ratio(value, getattr(events, m.ratio_of)) if m.ratio_of else str(value))
    return out


EXTENDED_COLUMNS = [
    "Arm", "Deploy", "Run", "Requests", "WER source", "WER (mean)", "WER (median)", "Oracle WER (mean)",
    f"Requests with WER > {WER_THRESHOLD}", "Not measurable", *count_columns(), "Worst request", "Preemptions",
    "Errors", "Wall time (s)",
]


def extended_table(cells: list[CellSummary]) -> pd.DataFrame:
    """One row per cell (repeats separate): the seed's numbers plus everything that explains them."""
    rows = []
    for c in cells:
        ev = c.events

        def traced(text: str, c: CellSummary = c) -> str:  # --trace off: never traced, not zero
            return text if c.span_facts else NA

        rows.append([
            c.arm, c.deploy, str(c.run_number), str(c.requests), WER_SOURCE_TEXT[c.wer_source].split(" (")[0],
            fmt_wer(c.mean_wer), fmt_wer(c.median_wer), fmt_wer(c.oracle_mean_wer),
            fmt_ratio(c.requests_over(), c.scored), str(c.not_measurable),
            *count_values(ev, fmt_accepted(c.accepted_tokens_per_step), c.misaligned_known, c.span_facts),
            fmt_worst(c), traced(str(c.preemptions)),
            f"{c.errors} ({c.crashed} crashed)" if c.crashed else str(c.errors), f"{c.wall_s:.1f}",
        ])
    return pd.DataFrame(rows, columns=EXTENDED_COLUMNS, dtype=object)


STREAM_COLUMNS = ["Arm", "Deploy", "Run", "Streamed", "Failed", "TTFP p50 / p90 / p99 / max (s)",
                  "Gap p50 / p99 / max (s)", "Stall worst / total (s)", "Continuity 50 / 100 / 200 ms", "Goodput",
                  "RTF p50 / p99", "Audio s per s", "Windows (med) / violations"]


def _secs(value: float | None, digits: int = 3) -> str:
    return NA if value is None else f"{value:.{digits}f}"


def _spread(sp: Any, which: tuple[str, ...], digits: int = 3) -> str:
    return NA if sp is None else " / ".join(_secs(getattr(sp, w), digits) for w in which)


def _rate(value: float | None) -> str:
    return NA if value is None else f"{value:.0%}"


def streaming_table(cells: list[CellSummary]) -> pd.DataFrame:
    """One row per cell with streamed requests (``run --stream``; docs/streaming.md, the definitions in
    ``harness.streaming_figures``): TTFP and every inter-chunk gap at p50/p90/p99 and worst, the worst
    stall and the stall total of a player started at the first packet, the continuity rate at 50/100/200
    ms, goodput against the cell's SLO, RTF, audio seconds per wall second, and the Code2Wav windows with
    the chunk contract's violations where the connector was traced. Empty when nothing streamed."""
    rows = []
    for c in cells:
        f = figures(c.records, c.slo or StreamingSlo())
        if f is None:
            continue
        windows = (NA if f.chunk_windows is None
                   else f"{f.chunk_windows.p50:g} / {f.chunk_violations}")
        rows.append([
            c.arm, c.deploy, str(c.run_number), fmt_ratio(f.streamed, f.requests), str(f.failed),
            _spread(f.ttfp, ("p50", "p90", "p99", "worst")), _spread(f.gaps, ("p50", "p99", "worst")),
            f"{_secs(f.worst_stall_s)} / {_secs(f.stall.mean * f.streamed if f.stall else None)}",
            " / ".join(_rate(f.continuity.get(t)) for t in THRESHOLDS_S), _rate(f.goodput),
            _spread(f.rtf, ("p50", "p99"), 2), _secs(f.throughput, 2), windows,
        ])
    return pd.DataFrame(rows, columns=STREAM_COLUMNS, dtype=object)


MODELLED_COLUMNS = ["Arm", "Deploy", "Run", "Modelled", "TTFP p50 / p90 / p99 / max (steps)",
                    "Window gap p50 / p99 / max (steps)", "Windows (med) / violations"]


def modelled_table(cells: list[CellSummary]) -> pd.DataFrame:
    """The sim's modelled windows per cell (``harness.streaming_figures.modelled_figures``), in steps: when the
    first window leaves, the steps between windows, the windows and the chunk contract. Empty without them."""
    rows = []
    for c in cells:
        f = modelled_figures(c.records)
        if f is None:
            continue
        steps = (lambda sp, which: NA if sp is None else " / ".join(f"{getattr(sp, w):g}" for w in which))
        rows.append([c.arm, c.deploy, str(c.run_number), fmt_ratio(f.modelled, f.requests),
                     steps(f.ttfp_steps, ("p50", "p90", "p99", "worst")), steps(f.gap_steps, ("p50", "p99", "worst")),
                     f"{f.windows.p50:g} / {f.chunk_violations}" if f.windows else NA])
    return pd.DataFrame(rows, columns=MODELLED_COLUMNS, dtype=object)


MODELLED_NOTE = ("Code2Wav windows (modelled by the sim, in scheduler steps, not measured): each request's frames in "
                 "the release's windows (1, then 25 a window), each sent at the step its last frame was produced; TTFP "
                 "is the first window's step since the send (docs/streaming.md, \"The sim's windows\").")


def streaming_slos(cells: list[CellSummary]) -> list[str]:
    """The SLOs goodput was measured against, one line per distinct SLO (the deploys that use it)."""
    by_slo: dict[str, list[str]] = {}
    for c in cells:
        if streamed(c.records):
            deploys = by_slo.setdefault((c.slo or StreamingSlo()).describe(), [])
            if c.deploy not in deploys:
                deploys.append(c.deploy)
    return [f"goodput SLO: {slo} ({', '.join(deploys)})" for slo, deploys in by_slo.items()]


STREAM_NOTE = ("Streamed audio (--stream, measured by the client): TTFP from the send to the first audio packet; a "
               "gap is the time between two audio chunks; a stall is a moment a player started at the first packet "
               "runs dry (worst: the longest, total: their sum over the cell); continuity: the share of requests "
               "with no stall over 50/100/200 ms; goodput: the share meeting the SLO; failed requests (errors, audio "
               "shorter than its codec stream) count against both; windows: the Code2Wav windows each request was "
               "sent and the chunk contract's violations (docs/streaming.md).")


def cells_frame(cells: list[CellSummary]) -> pd.DataFrame:
    """Numbers, not strings: one row per cell, for summary.csv and summary.json."""
    rows = []
    for c in cells:
        row: dict[str, Any] = {
            "arm": c.arm, "deploy": c.deploy, "repeat": c.repeat, "run": c.run_number,
            "requests": c.requests, "scored": c.scored, "wer_source": c.wer_source,
            "wer_mean": c.mean_wer, "wer_median": c.median_wer, "oracle_wer_mean": c.oracle_mean_wer,
            "requests_over_threshold": c.requests_over(), "wer_threshold": WER_THRESHOLD,
            "not_measurable": c.not_measurable,
        }
        row.update({k: v for k, v in vars(c.events).items()})
        if not c.misaligned_known:
            row.update({m.name: None for m in METRICS if m.span_field is not None})  # not measured
        worst = c.worst_request
        row.update(role=c.role, worst_request=worst.prompt_id if worst else None,
                   worst_request_wer=worst.score if worst else None)
        accepted = c.accepted_tokens_per_step
        row["accepted_tokens_per_step"] = None if accepted is None else round(accepted, 4)
        row.update({"event_source": c.event_source, "preemptions": c.preemptions, "errors": c.errors,
                    "wall_s": round(c.wall_s, 3)})
        rows.append(row)
    return pd.DataFrame(rows)


REQUEST_COLUMNS = [
    "Arm", "Deploy", "Run", "Prompt", "WER", "Oracle WER", "Codec tokens", "Finish", "Preemptions",
    *count_columns(per_request=True), "Error", "Transcript",
]


def requests_table(run: Run, cells: list[CellSummary], max_text: int = 80) -> pd.DataFrame:
    """Per-request rows in table order, so a reader can find the request a plot points at; the error and
    the transcript cut to ``max_text`` characters."""
    return pd.DataFrame(_cut_rows(run, cells, max_text), columns=REQUEST_COLUMNS, dtype=object)


def request_dicts(run: Run, cells: list[CellSummary], max_text: int = 80) -> list[dict[str, str]]:
    """``requests_table(...).to_dict(orient="records")``, without the frame (pandas took half a second
    for it at 10,000 requests)."""
    return [dict(zip(REQUEST_COLUMNS, row)) for row in _cut_rows(run, cells, max_text)]


def _cut_rows(run: Run, cells: list[CellSummary], max_text: int) -> list[list[str]]:
    err, text = REQUEST_COLUMNS.index("Error"), REQUEST_COLUMNS.index("Transcript")
    return [row if len(row[err]) <= max_text and len(row[text]) <= max_text else
            [*row[:err], _cut(row[err], max_text), _cut(row[text], max_text)] for row in _request_rows(run, cells)]


_REQUEST_ROWS: list[tuple[Run, list[CellSummary], list[list[str]]]] = []  # the last few (run, cells): rows


def _request_rows(run: Run, cells: list[CellSummary]) -> list[list[str]]:
    """``requests_table``'s rows with the whole (whitespace-joined) error and transcript, built once per
    run and cells: ``report`` asks for the table three times (markdown, HTML, the CSV and JSON), and at
    10,000 requests each build took a quarter of a second (issue 48)."""
    for seen_run, seen_cells, rows in _REQUEST_ROWS:
        if seen_run is run and seen_cells is cells:
            return rows
    events = request_events(run)
    known = {k: v[1] for k, v in run.spans.group_events.items()}
    rank = {c.key: i for i, c in enumerate(cells)}
    run_number = {c.key: c.run_number for c in cells}
    rows = []
    for rec in sorted(run.requests, key=lambda r: (rank[(r.arm, r.deploy, r.repeat)], r.prompt_id)):
        ev = events[rec.key]
        cell = (rec.arm, rec.deploy, rec.repeat)
        text = rec.transcript if rec.transcript is not None else rec.oracle_transcript
        rows.append([
            rec.arm, rec.deploy, str(run_number[cell]), rec.prompt_id,
            "not measurable" if rec.not_measurable else fmt_wer(rec.score), fmt_wer(rec.oracle_wer),
            str(rec.num_codec_tokens), rec.finish_reason or NA, str(rec.preemptions),
            *count_values(ev, fmt_accepted(rec.accepted_tokens_per_step), known.get(rec.key, is_simulated(rec.backend)),
                          per_request=True),
            " ".join((rec.error or "").split()), " ".join((text or "").split()),
        ])
    if len(_REQUEST_ROWS) >= 4:
        _REQUEST_ROWS.pop(0)
    _REQUEST_ROWS.append((run, cells, rows))
    return rows


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fmt_worst(cell: CellSummary) -> str:
    """The cell's worst request: ``p05-garden (2.944)``."""
    worst = cell.worst_request
    return NA if worst is None else f"{worst.prompt_id} ({fmt_wer(worst.score)})"


def fmt_delta(value: float | None) -> str:
    return NA if value is None else f"{value:+.3f}"


PAIRED_SPAN_METRICS = [m for m in TABLE_METRICS if m.span_field is not None]  # the request's misaligned positions
PAIRED_COLUMNS = [
    "Arm", "Deploy", "Run", "Prompt", "Reference WER", "WER", "\u0394 WER", "Oracle \u0394 WER",
    *(m.table for m in PAIRED_SPAN_METRICS), "Worst of cell",
]


def paired_cells(cells: list[CellSummary], reference_deploy: str | None = None) -> list[CellSummary]:
    """The cells the paired table shows: every cell that has a reference cell (``reference_deploy`` None:
    every stress cell whose declared pair ran, ``harness.roles``), outside that reference deploy."""
    return [c for c in cells if c.deploy != reference_deploy and paired_rows(c, cells, reference_deploy)]


def paired_table(run: Run, cells: list[CellSummary], reference_deploy: str | None = None) -> pd.DataFrame:
    """Per arm and prompt: this deploy's WER minus the same prompt's WER in the same arm's reference
    deploy (same run; a single reference run serves all repeats), the same for the oracle WER where the
    backend has it, the request's misaligned positions, and which request is its cell's worst."""
    events = request_events(run)
    known = {k: v[1] for k, v in run.spans.group_events.items()}
    rows = []
    for cell in paired_cells(cells, reference_deploy):
        worst = cell.worst_request
        for pr in paired_rows(cell, cells, reference_deploy):
            key = (cell.arm, cell.deploy, cell.repeat, pr.prompt_id)
            ev = events.get(key)
            measured = ev is not None and known.get(key, pr.record is not None and is_simulated(pr.record.backend))
            rows.append([
                cell.arm, cell.deploy, str(cell.run_number), pr.prompt_id, fmt_wer(pr.reference_wer), fmt_wer(pr.wer),
                fmt_delta(pr.delta), fmt_delta(pr.oracle_delta),
                *(str(getattr(ev, m.name)) if measured and ev else NA for m in PAIRED_SPAN_METRICS),
                "worst" if worst is not None and pr.record is worst else "",
            ])
    return pd.DataFrame(rows, columns=PAIRED_COLUMNS, dtype=object)


def paired_note(cells: list[CellSummary], reference_deploy: str | None = None) -> str:
    if not paired_cells(cells, reference_deploy):
        return "No paired table: the run has no reference deploy to pair with."
    named = reference_deploy or reference_deploy_of(cells)
    which = f"{named} deploy" if named is not None else "reference deploy (the pair each stress deploy declares)"
    return (f"\u0394 WER = WER minus the same prompt's WER in the same arm's {which} (same run); "
            f"'worst' marks each cell's highest-WER request.")


COMPARE_NOTE = (f"WER = mean WER; WER>{WER_THRESHOLD} = requests over it; chunks = non-zero-offset prefill chunks; "
                "replays = replays crossing the prompt boundary; misaligned text / end = misaligned positions up to "
                "and including text-EOS / after it; \u0394 = B - A of the means over runs.")


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _fmt_delta(a: float | None, b: float | None, wer: bool) -> str:
    if a is None or b is None:
        return NA
    d = b - a
    if wer:
        return f"{d:+.3f}"
    return f"{int(d):+d}" if float(d).is_integer() else f"{d:+.1f}"


def compare_table(cells_a: list[CellSummary], cells_b: list[CellSummary]) -> pd.DataFrame:
    """The seed table's cells of two runs side by side, with B - A deltas (B is the PR, A its base)."""
    rows_a = {(g[0].arm, g[0].deploy): g for g in group_rows(cells_a)}
    rows_b = {(g[0].arm, g[0].deploy): g for g in group_rows(cells_b)}
    rows = []
    for key in list(rows_a) + [k for k in rows_b if k not in rows_a]:
        a, b = rows_a.get(key, []), rows_b.get(key, [])
        row = [f"{key[0]}, {key[1]} deploy"]
        getters = [
            (lambda c: c.mean_wer, lambda g: _join(fmt_wer(c.mean_wer) for c in g), True),
            (lambda c: c.requests_over(), lambda g: _join(fmt_ratio(c.requests_over(), c.scored) for c in g), False),
            (lambda c: c.events.nonzero_offset_chunks, lambda g: _join(str(c.events.nonzero_offset_chunks) for c in g),
             False),
            (lambda c: c.events.cross_boundary_replays,
             lambda g: _join(str(c.events.cross_boundary_replays) for c in g), False),
            (lambda c: c.events.misaligned_text_positions if c.misaligned_known else None,
             lambda g: _join(str(c.events.misaligned_text_positions) if c.misaligned_known else NA for c in g), False),
            (lambda c: c.events.misaligned_end_positions if c.misaligned_known else None,
             lambda g: _join(str(c.events.misaligned_end_positions) if c.misaligned_known else NA for c in g), False),
        ]
        for value, text, wer in getters:
            mean_a = _mean([v for v in (value(c) for c in a) if v is not None])
            mean_b = _mean([v for v in (value(c) for c in b) if v is not None])
            row += [text(a) if a else NA, text(b) if b else NA, _fmt_delta(mean_a, mean_b, wer)]
        rows.append(row)
    columns = ["Arm"]
    for name in ("WER", f"WER>{WER_THRESHOLD}", "Chunks", "Replays", "Misaligned text", "Misaligned end"):
        columns += [f"{name} A", f"{name} B", f"\u0394 {name}"]
    return pd.DataFrame(rows, columns=columns, dtype=object)


# --------------------------------------------------------------------------- renderers


def render_text(df: pd.DataFrame, max_width: int = 110) -> str:
    """Aligned plain text: left-aligned text, right-aligned numbers, a rule under the header.

    When the table would be wider than ``max_width``, long headers wrap onto up to three lines so
    the columns are only as wide as their values.
    """
    cols = [str(c) for c in df.columns]
    body = [[str(v) for v in row] for row in df.itertuples(index=False)]
    data_w = [max([0] + [len(r[i]) for r in body]) for i in range(len(cols))]
    headers = [[c] for c in cols]
    if sum(max(len(c), w) for c, w in zip(cols, data_w)) + 2 * (len(cols) - 1) > max_width:
        headers = [_wrap_header(c, w) for c, w in zip(cols, data_w)]
    widths = [max([data_w[i]] + [len(h) for h in headers[i]]) for i in range(len(cols))]
    numeric = [i > 0 and _numeric_column(df, i) for i in range(len(cols))]

    def line(cells: list[str]) -> str:
        return "  ".join(cells[i].rjust(widths[i]) if numeric[i] else cells[i].ljust(widths[i])
                         for i in range(len(cells))).rstrip()

    depth = max(len(h) for h in headers)
    head = [line([(h[j - (depth - len(h))] if j >= depth - len(h) else "") for h in headers]) for j in range(depth)]
    return "\n".join(head + ["  ".join("-" * w for w in widths)] + [line(r) for r in body])


def _wrap_header(header: str, data_width: int) -> list[str]:
    words = header.split()
    width = max([data_width, 6] + [len(w) for w in words])
    while True:  # widen until it fits in three lines (bounded: width grows to len(header))
        lines = textwrap.wrap(header, width=width, break_long_words=False) or [header]
        if len(lines) <= 3 or width >= len(header):
            return lines
        width += 1


def _numeric_column(df: pd.DataFrame, i: int) -> bool:
    values = [str(v) for v in df.iloc[:, i]]
    return bool(values) and all(v in (NA, NONE) or v[:1].isdigit() or v[:1] in "+-" for v in values)


def render_markdown(df: pd.DataFrame) -> str:
    """A GitHub table (pipes escaped), to paste into a PR description."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _asr_text(asr: Any) -> str:
    """The manifest's ``asr`` said as what it is: the Whisper model is the ASR's, not the served checkpoint
    (the header said ``model=base`` beside the backend, read as the run's model: issue 47, case 5)."""
    if not isinstance(asr, dict):
        return str(asr or "none")
    if asr.get("backend") == "none":
        return "none (oracle transcripts)"
    extra = {k: v for k, v in asr.items() if k not in ("backend", "model", "beam_size") and v is not None}
    return (f"{asr.get('backend', NA)} (Whisper model {asr.get('model', NA)}, beam size {asr.get('beam_size', NA)}"
            + "".join(f", {k} {v}" for k, v in extra.items()) + ")")


def run_header(run: Run) -> list[str]:
    m = run.manifest
    backend = _describe(m.get("backend", NA))
    if is_simulated(m.get("backend")) and isinstance(m.get("sim_talker"), str):  # --sim-talker (runs before it: words)
        backend += f" (Talker: {m['sim_talker']})"
    if isinstance(m.get("served_model"), str):
        backend += f", served model {m['served_model']}"
    lines = [f"Run {run.run_id}: backend {backend}, ASR {_asr_text(m.get('asr'))}"]
    finished = m.get("finished")
    lines.append(f"Started {m.get('started') or NA}, " + (f"finished {finished}" if finished else "not finished"))
    roles = run.roles
    if roles:
        lines.append("Arms: " + ", ".join(f"{arm} ({role})" for arm, role in roles.items()))
    releases = release_note(run)
    if releases:
        lines.append(releases)
    problems = run_problems(run)
    if problems:
        lines.append(f"WARNING: incomplete run, the gate refuses it: {'; '.join(problems)}")
    note = trace_note(run)
    if note:
        lines.append(note)
    return lines


def release_note(run: Run) -> str | None:
    """The vLLM-Omni release each arm's server had installed (``cell_releases``), so that a real run's table
    names the release it measured; None on the sim and for servers started by a command prefix."""
    from harness.report.summary import cell_releases

    releases: dict[str, list[str]] = {}
    for (arm, _deploy), release in cell_releases(run).items():
        seen = releases.setdefault(arm, [])
        if release not in seen:
            seen.append(release)
    if not releases:
        return None
    return "vLLM-Omni release (the server's own, per arm): " + ", ".join(
        f"{arm} {' and '.join(versions)}" for arm, versions in releases.items())


def trace_note(run: Run) -> str | None:
    """Which ``--trace`` level the real server's Talker ran at, per cell, and what that leaves out;
    every latency and wall time of the run was measured with the plugin at that level. None on the sim."""
    from harness.report.summary import cell_trace_levels

    levels = cell_trace_levels(run)
    if not levels or all(v is None for v in levels.values()):
        return None
    kinds = list(dict.fromkeys(v for v in levels.values() if v is not None))
    if len(kinds) == 1:
        text = f"Trace level (--trace): {kinds[0]} in every cell"
    else:
        text = "Trace level (--trace) per cell: " + ", ".join(
            f"{arm}/{deploy} run {repeat}: {level}" for (arm, deploy, repeat), level in levels.items())
    text += "; latency and wall times were measured at that level (the plugin's cost: docs/real-backend.md)"
    if "spans" in kinds:
        text += "; at spans the contract is not checked (misaligned: n/a)"
    if "off" in kinds:
        text += ("; at off nothing was traced: events, row counts, misaligned positions and preemptions read n/a "
                 "(not 0), TTFA and the speaking model's oracle transcript are unknown, and the gate refuses the "
                 "rules that need them")
    return text


def terminal_text(run: Run, cells: list[CellSummary], with_requests: bool = False, with_paired: bool = False) -> str:
    parts = run_header(run) + ["", render_text(seed_table(cells)), wer_source_note(run, cells), "",
                               render_text(extended_table(cells))]
    streamed = streaming_table(cells)
    if len(streamed):
        parts += ["", render_text(streamed), STREAM_NOTE, *streaming_slos(cells)]
    modelled = modelled_table(cells)
    if len(modelled):
        parts += ["", render_text(modelled), MODELLED_NOTE]
    if with_paired:
        parts += ["", render_text(paired_table(run, cells)), paired_note(cells)]
    if with_requests:
        parts += ["", render_text(requests_table(run, cells))]
    return "\n".join(parts) + "\n"


def markdown_text(run: Run, cells: list[CellSummary], with_requests: bool = True) -> str:
    parts = [f"### omni-stress run `{run.run_id}`", "", render_markdown(seed_table(cells)), "",
             wer_source_note(run, cells), "", *([note, ""] if (note := trace_note(run)) else []), "<details><summary>Extended table</summary>", "",
             render_markdown(extended_table(cells)), "", "</details>"]
    streamed = streaming_table(cells)
    if len(streamed):
        parts += ["", "<details><summary>Streamed audio</summary>", "", render_markdown(streamed), "",
                  " ".join([STREAM_NOTE, *streaming_slos(cells)]),
                  "", "</details>"]
    modelled = modelled_table(cells)
    if len(modelled):
        parts += ["", "<details><summary>Code2Wav windows (modelled)</summary>", "", render_markdown(modelled), "",
                  MODELLED_NOTE, "", "</details>"]
    paired = paired_table(run, cells)
    if len(paired):
        parts += ["", "<details><summary>Paired per-prompt table (vs the reference deploy)</summary>", "",
                  render_markdown(paired), "", paired_note(cells), "", "</details>"]
    if with_requests:
        parts += ["", "<details><summary>Per-request rows</summary>", "",
                  render_markdown(requests_table(run, cells)), "", "</details>"]
    parts += ["", "_" + "; ".join(run_header(run)) + "_"]
    return "\n".join(parts) + "\n"


def json_summary(run: Run, cells: list[CellSummary]) -> dict[str, Any]:
    """summary.json."""
    return {
        "run_id": run.run_id,
        "backend": run.manifest.get("backend"),
        "sim_talker": run.manifest.get("sim_talker"),
        "asr": run.manifest.get("asr"),
        "started": run.manifest.get("started"),
        "finished": run.manifest.get("finished"),
        "wer_source": wer_source(cells),
        "wer_threshold": WER_THRESHOLD,
        "complete": not run_problems(run),
        "problems": run_problems(run),
        "roles": run.roles,
        "reference_deploy": reference_deploy_of(cells),
        "seed_table": seed_table(cells).to_dict(orient="records"),
        "cells": _records(cells_frame(cells)),
        "paired": _records(paired_frame(cells)),
        "requests": request_dicts(run, cells, max_text=10_000),
    }


def streaming_json(cells: list[CellSummary]) -> dict[str, Any] | None:
    """streaming.json (written only when a cell streamed, or the sim modelled its windows): each cell's figures
    under ``vllm bench serve --omni``'s names where one exists (``harness.streaming_figures.bench_fields``) and
    each request's; a modelled cell's in steps (``modelled: true``)."""
    out = []
    for c in cells:
        slo = c.slo or StreamingSlo()
        f = figures(c.records, slo)
        if f is None:
            m = modelled_figures(c.records)
            if m is not None:
                out.append({"arm": c.arm, "deploy": c.deploy, "repeat": c.repeat, "run": c.run_number,
                            "role": c.role, "deploy_role": c.deploy_role, **modelled_fields(m),
                            "requests": [{"prompt_id": r.prompt_id, "chunk_frames_sent": r.chunk_frames_sent,
                                          "chunk_window_steps": r.chunk_window_steps, "sent_step": r.sent_step,
                                          "chunk_violations": r.chunk_violations,
                                          "chunk_violation": r.chunk_violation} for r in c.records]})
            continue
        requests = []
        for r in c.records:
            stall = worst_stall(r)
            requests.append({
                "prompt_id": r.prompt_id, "error": r.error, "stream_failed": r.stream_failed,
                "audio_ttfp_ms": None if r.stream_ttfa_s is None else round(r.stream_ttfa_s * 1000, 3),
                "chunks": r.stream_chunks, "max_gap_ms": round(max(r.stream_gaps_s or [0.0]) * 1000, 3),
                "max_stall_ms": round(stall * 1000, 3), "stall_total_s": r.stream_underrun_s,
                "chunk_windows": r.chunk_windows, "chunk_frames_sent": r.chunk_frames_sent,
                "chunk_violations": r.chunk_violations, "chunk_violation": r.chunk_violation,
                "meets_slo": meets_slo(r, slo),
            })
        out.append({"arm": c.arm, "deploy": c.deploy, "repeat": c.repeat, "run": c.run_number, "role": c.role,
                    "deploy_role": c.deploy_role, "slo": {"ttfp_s": slo.ttfp_s, "max_stall_s": slo.max_stall_s},
                    **bench_fields(f), "requests": requests})
    return {"cells": out} if out else None


def paired_frame(cells: list[CellSummary], reference_deploy: str | None = None) -> pd.DataFrame:
    """Numbers, not strings: one row per paired prompt, for paired.csv and summary.json."""
    rows = []
    for cell in paired_cells(cells, reference_deploy):
        worst = cell.worst_request
        for pr in paired_rows(cell, cells, reference_deploy):
            rows.append({"arm": cell.arm, "role": cell.role, "deploy": cell.deploy, "repeat": cell.repeat,
                         "run": cell.run_number, "prompt": pr.prompt_id, "reference_deploy": pr.reference.deploy,
                         "reference_wer": pr.reference_wer, "wer": pr.wer, "wer_delta": pr.delta,
                         "oracle_wer_delta": pr.oracle_delta,
                         "worst_of_cell": worst is not None and pr.record is worst,
                         "audio": pr.record.audio_path if pr.record is not None else None})
    return pd.DataFrame(rows)


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """DataFrame rows as plain JSON values (NaN -> null, numpy scalars -> Python)."""
    out = []
    for row in df.to_dict(orient="records"):
        clean = {}
        for k, v in row.items():
            if v is None or (isinstance(v, float) and math.isnan(v)):
                clean[k] = None
            elif hasattr(v, "item"):
                clean[k] = v.item()
            else:
                clean[k] = v
        out.append(clean)
    return out


_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;padding:.8em 1.5em 2em;color:#222;
max-width:1400px;line-height:1.35}
h1{margin:.3em 0 .2em;font-size:1.6em}
h2{margin:1.3em 0 .3em;padding-top:.4em;border-top:1px solid #e3e3e3;font-size:1.25em}
p{margin:.3em 0}
nav.toc{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid #ddd;padding:.35em 0;margin:.4em 0 .6em;
font-size:14px}
nav.toc a{margin-right:1.1em;text-decoration:none;color:#0645ad;white-space:nowrap}
nav.toc a:hover{text-decoration:underline}
.scroll{max-width:100%;overflow-x:auto;margin:.5em 0}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #d4d4d4;padding:3px 6px;text-align:right;vertical-align:top}
thead th{background:#f0f0f0;vertical-align:bottom;font-weight:600}
th:first-child,td:first-child{text-align:left}
tbody tr:nth-child(even) td{background:#fafafa}
table.extended td,table.paired td,table.requests td{white-space:nowrap}
table.extended,table.requests,table.paired{font-size:12px}
table.extended th,table.extended td{padding:3px 4px}
table.paired thead th:last-child{text-align:left}
table.requests tr.group th{background:#e8eef7;text-align:left;font-size:13px;padding:4px 6px}
table.requests{width:100%}
table.requests th,table.requests td{width:1px}
table.requests td.text{white-space:normal;text-align:left;min-width:24em;color:#333}
table.requests .text{width:auto;text-align:left}
td.text .empty{color:#999;font-style:italic}
td.text details{margin:0}
td.text summary{cursor:pointer;color:#333}
td.text details[open] summary{color:#777}
td.text details p{margin:.2em 0 .3em;white-space:normal}
td.bad,span.bad{color:#b00;font-weight:600}
.drole{display:inline-block;min-width:5.2em;padding:0 5px;margin-right:4px;border-radius:3px;font-size:11px;
text-align:center;color:#fff;background:#888}
.drole.reference{background:#4a6fa5}.drole.stress{background:#b26a00}
table.summary tr.reference td:first-child{border-left:5px solid #4a6fa5}
table.summary tr.stress td:first-child{border-left:5px solid #b26a00}
table.summary tr.fail td{background:#fdecec !important}
table.summary tr.error td{background:#f3e8f8 !important}
table.summary tr.expected td{background:#eaf0fb !important}
.key{display:inline-block;padding:0 5px;border:1px solid #ccc}
.key.fail{background:#fdecec}.key.error{background:#f3e8f8}.key.expected{background:#eaf0fb}
.note{color:#555}
.warn{color:#a00;font-weight:bold}
tr.worst td{background:#fff1f0 !important}
td.audio{white-space:normal !important;text-align:left}
td.audio .player{display:inline-flex;align-items:center;gap:4px;margin:1px 6px 1px 0;font-size:12px}
audio{height:30px;width:230px;vertical-align:middle}
a.wav{font-size:12px}
img{max-width:100%;height:auto;border:1px solid #ddd;margin:.4em 0}
code{background:#f4f4f4;padding:1px 4px}
"""

SECTIONS = {  # id -> heading, in page order (plots between the summary and the extended table)
    "summary": "Summary", "wer": "WER per request", "events": "Scheduler events per cell",
    "timeline": "Span timeline of one stressed request", "extended": "Extended table",
    "paired": "Paired per-prompt table", "requests": "Per-request rows", "streamed": "Streamed audio",
    "modelled": "Code2Wav windows (modelled)",
}


def html_report(run: Run, cells: list[CellSummary], plots: dict[str, bytes], verdict: Any = None) -> str:
    """One page: tables as HTML, PNG plots inlined as base64 data URIs, each request's WAV linked (relative
    to report.html, from the run directory's ``audio/``), never inlined. Wide tables scroll inside their
    own box, so the page itself never scrolls sideways.

    ``verdict``: the gate's verdict, computed by the caller (``harness.gate.verdict.page_verdict``, or a
    sweep's map verdict): its ``html`` is the line the page opens with, its ``outcomes`` ({cell key:
    "fail" | "error" | "expected" | "pass"}) tint the summary's rows. None: no verdict line."""
    def table(df: pd.DataFrame, cls: str) -> str:
        return _scroll(df.to_html(index=False, escape=True, classes=cls, border=0, na_rep=NA))

    def h2(key: str, title: str | None = None) -> str:
        return f"<h2 id=\"{key}\">{html.escape(title or SECTIONS[key])}</h2>"

    paired = html_paired(run, cells)
    streamed = streaming_table(cells)
    modelled = modelled_table(cells)
    shown = ["summary", *plots, "extended", *(["streamed"] if len(streamed) else []),
             *(["modelled"] if len(modelled) else []), *(["paired"] if paired else []), "requests"]
    toc = " ".join(f"<a href=\"#{html.escape(k)}\">{html.escape(SECTIONS.get(k, k))}</a>" for k in shown)
    parts = [
        "<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>omni-stress {html.escape(run.run_id)}</title>", f"<style>{_CSS}{VERDICT_CSS}</style></head><body>",
        f"<h1>omni-stress run <code>{html.escape(run.run_id)}</code></h1>",
        verdict.html if verdict is not None else "",
        "".join(f"<p class=\"{'warn' if line.startswith('WARNING') else 'note'}\">{html.escape(line)}</p>"
                for line in run_header(run)),
        f"<nav class=\"toc\">{toc}</nav>",
        h2("summary"), html_summary(cells, getattr(verdict, "outcomes", None)),
        f"<p class=\"note\">{html.escape(wer_source_note(run, cells))}</p>",
    ]
    for name, png in plots.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(h2(name, SECTIONS.get(name, name)))
        parts.append(f"<img alt=\"{html.escape(name)}\" src=\"data:image/png;base64,{data}\">")
    parts += [h2("extended"), _html_table(extended_table(cells), "extended", _EXTENDED_SHORT)]
    if len(streamed):
        parts += [h2("streamed"), table(streamed, "streamed"),
                  f"<p class=\"note\">{html.escape(' '.join([STREAM_NOTE, *streaming_slos(cells)]))}</p>"]
    if len(modelled):
        parts += [h2("modelled"), table(modelled, "modelled"), f"<p class=\"note\">{html.escape(MODELLED_NOTE)}</p>"]
    if paired:
        parts += [h2("paired"), paired, f"<p class=\"note\">{html.escape(paired_note(cells))} The worst request of "
                                        "each cell plays here next to the reference deploy's audio for the same "
                                        "prompt.</p>"]
    else:
        parts.append(f"<p class=\"note\">{html.escape(paired_note(cells))}</p>")
    parts += [h2("requests"), html_requests(run, cells)]
    argv = run.manifest.get("argv")
    if argv:
        command = " ".join(argv) if isinstance(argv, list) else str(argv)
        parts.append(f"<p class=\"note\">Command: <code>{html.escape(command)}</code></p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


_OUTCOME_TEXT = {"fail": "a gate rule failed", "error": "a gate rule could not be evaluated",
                 "expected": "the baseline's expected bug, detected"}


def html_summary(cells: list[CellSummary], outcomes: dict[CellKey, str] | None = None) -> str:
    """The summary table (one row per arm x deploy, repeats joined): a bar on the left in the deploy's
    role colour (reference blue, stress amber); a row tinted only where something is wrong
    (a gate rule failed: red; could not be evaluated: purple) or wrong as expected (the baseline's bug,
    detected: blue); a mean WER over the threshold in red. A row that holds its rules is not tinted."""
    df = seed_table(cells)
    order = ("fail", "error", "expected")
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = []
    seen = set()
    for group, row in zip(group_rows(cells), df.itertuples(index=False)):
        found = {(outcomes or {}).get(c.key) for c in group}
        outcome = next((o for o in order if o in found), "")
        seen.add(outcome)
        role = group[0].deploy_role
        title = f" title=\"{html.escape(_OUTCOME_TEXT[outcome])}\"" if outcome else ""
        tds = [f"<td title=\"{html.escape(role)} deploy\">{html.escape(str(row[0]))}</td>"]
        for i, v in enumerate(row[1:], 1):
            bad = i == 1 and any(c.mean_wer is not None and c.mean_wer > WER_THRESHOLD for c in group)
            tds.append(f"<td class=\"bad\">{html.escape(str(v))}</td>" if bad else f"<td>{html.escape(str(v))}</td>")
        body.append(f"<tr class=\"{html.escape(role)}{' ' + outcome if outcome else ''}\"{title}>{''.join(tds)}</tr>")
    shown = [o for o in order if o in seen]
    legend = ("<p class=\"note legend\"><span class=\"drole reference\">reference</span> "
              "<span class=\"drole stress\">stress</span> the deploy's role (the bar left of each row)"
              + ("; the gate's outcome: " + " ".join(f"<span class=\"key {o}\">{html.escape(_OUTCOME_TEXT[o])}</span>"
                                                  for o in shown) if shown else "")
              + ("; other rows: nothing wrong" if outcomes is not None else "") + ".</p>")
    return _scroll(f"<table class=\"summary\"><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>") \
        + legend


_EXTENDED_SHORT = {  # the extended table's long headings, shortened in the page (the full one is the tooltip)
    "Requests": "Req.", f"Requests with WER > {WER_THRESHOLD}": f"WER > {WER_THRESHOLD}",
    "Non-zero-offset chunks": "Chunks", "Cross-boundary replays": "Replays",
    "Multi-position decode spans": "Multi-pos. decode", "Accepted tokens/step": "Acc. tok/step",
    "Row-count mismatches / prefill calls": "Row-count mism. / prefill", "Misaligned (text)": "Misal. (text)",
    "Misaligned (end)": "Misal. (end)", "Preemptions": "Pre\u00adempt.", "Wall time (s)": "Wall (s)",
    "Not measurable": "Not meas\u00adurable",
}


def _html_table(df: pd.DataFrame, cls: str, short: dict[str, str]) -> str:
    """A table whose long headings are shortened (``short``), each with its full name as a tooltip."""
    def th(name: str) -> str:
        label = short.get(name)
        if label is None:
            return f"<th>{html.escape(name)}</th>"
        return f"<th title=\"{html.escape(name)}\">{html.escape(label)}</th>"

    head = "".join(th(str(c)) for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
                   for row in df.itertuples(index=False))
    return _scroll(f"<table class=\"{cls}\"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _scroll(table_html: str) -> str:
    """A wide table scrolls inside its own box, never the page."""
    return f"<div class=\"scroll\">{table_html}</div>"


def audio_src(run: Run, record: RequestRecord | None) -> tuple[str | None, str]:
    """(the request's WAV as a URL relative to report.html, or None; a note when there is none): the
    file must be a relative path inside the run directory that exists (``--asr none`` writes no audio)."""
    if record is None or not record.audio_path:
        return None, "no audio"
    rel = Path(record.audio_path)
    if rel.is_absolute() or ".." in rel.parts:
        return None, f"{record.audio_path} is outside the run directory"
    if not (run.run_dir / rel).is_file():
        return None, f"{record.audio_path} missing"
    return urllib.parse.quote(rel.as_posix(), errors="surrogateescape"), ""  # a lone surrogate: its byte


def audio_tag(run: Run, record: RequestRecord | None, label: str) -> str:
    """An ``<audio>`` player for a request's WAV, linked relative to report.html (the run directory's
    ``audio/`` sits beside it); a note when the request has no audio."""
    src, note = audio_src(run, record)
    if src is None:
        return f"<span class=\"note\">{html.escape(label)}: {html.escape(note)}</span>"
    assert record is not None and record.audio_path
    return (f"<span class=\"player\">{html.escape(label)} <audio controls preload=\"metadata\" "
            f"title=\"{html.escape(record.audio_path)}\" src=\"{html.escape(src)}\"></audio></span>")


def html_paired(run: Run, cells: list[CellSummary]) -> str:
    """The paired table as HTML; each cell's worst request carries its audio and the reference's."""
    df = paired_table(run, cells)
    if not len(df):
        return ""
    records = [pr for cell in paired_cells(cells) for pr in paired_rows(cell, cells)]
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in list(df.columns) + ["Audio (worst request)"])
    body = []
    for pr, row in zip(records, df.itertuples(index=False)):
        worst = row[-1] == "worst"
        cells_html = "".join(f"<td>{html.escape(str(v))}</td>" for v in row)
        audio = ""
        if worst:
            ref_rec = next((r for r in pr.reference.records if r.prompt_id == pr.prompt_id), None)
            audio = audio_tag(run, pr.record, pr.cell.deploy) + " " + audio_tag(run, ref_rec, pr.reference.deploy)
        # the worst request of each cell carries the players; it is tinted only where it is worse than its
        # reference (no tint where nothing is wrong: a correct arm's worst prompt is often equal)
        tr = ('<tr class="worst">' if worst and pr.delta is not None and pr.delta > 0 else
              '<tr class="plays">' if worst else "<tr>")
        body.append(f"{tr}{cells_html}<td class=\"audio\">{audio}</td></tr>")
    return _scroll(f"<table class=\"paired\"><thead><tr>{head}</tr></thead><tbody>" + "".join(body)
                   + "</tbody></table>")


# the per-request table's HTML columns: (heading, the requests_table column it shows, tooltip)
_COMPACT = {m.table: (m.compact or m.table, m.tip or m.label) for m in TABLE_METRICS}
_COMPACT[ACCEPTED] = ("Acc. tok/step", "accepted tokens per verify step (speculative decoding)")
_REQUEST_HTML = [
    ("Prompt", "Prompt", None), ("WER", "WER", None), ("Oracle WER", "Oracle WER", None),
    ("Codec tokens", "Codec tokens", None), ("Finish", "Finish", None), ("Preempt.", "Preemptions", None),
    *((_COMPACT[c][0], c, _COMPACT[c][1]) for c in count_columns(per_request=True)),
]
MAX_HTML_TEXT = 400  # transcript characters shown per request (requests.csv has them whole)


def html_requests(run: Run, cells: list[CellSummary]) -> str:
    """Per-request rows, one block per cell under a header row (the arm, deploy and run are said once),
    each request's WAV linked and its transcript (or its error) in a wrapping column."""
    rows = request_dicts(run, cells, max_text=MAX_HTML_TEXT)
    rank = {c.key: i for i, c in enumerate(cells)}
    by_key = {c.key: c for c in cells}
    records = sorted(run.requests, key=lambda r: (rank[(r.arm, r.deploy, r.repeat)], r.prompt_id))
    ncols = len(_REQUEST_HTML) + 2
    def label(h: str) -> str:  # a word a line: the narrow columns stay narrow, the transcript gets the width
        return "<br>".join(html.escape(w) for w in h.split(" "))

    head = "".join(f"<th title=\"{html.escape(tip)}\">{label(h)}</th>" if tip else f"<th>{label(h)}</th>"
                   for h, _, tip in _REQUEST_HTML) + "<th>Audio</th><th class=\"text\">Transcript</th>"
    body = []
    current = None
    for rec, row in zip(records, rows):
        key = (rec.arm, rec.deploy, rec.repeat)
        if key != current:
            current = key
            c = by_key[key]
            body.append(f"<tr class=\"group\"><th colspan=\"{ncols}\">{html.escape(c.arm)} ({html.escape(c.role)}), "
                        f"{html.escape(c.deploy)} deploy, run {c.run_number}: {c.requests} requests, mean WER "
                        f"{html.escape(fmt_wer(c.mean_wer))}</th></tr>")
        tds = []
        for _, column, _ in _REQUEST_HTML:
            value = str(row[column])
            bad = column == "WER" and _over(value)
            tds.append(f"<td class=\"bad\">{html.escape(value)}</td>" if bad else f"<td>{html.escape(value)}</td>")
        src, note = audio_src(run, rec)
        tds.append(f"<td><a class=\"wav\" href=\"{html.escape(src)}\">wav</a></td>" if src
                   else f"<td class=\"note\">{'–' if note == 'no audio' else html.escape(note)}</td>")
        tds.append(f"<td class=\"text\">{_folded(str(row['Transcript']), str(row['Error']))}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return _scroll(f"<table class=\"requests\"><thead><tr>{head}</tr></thead><tbody>" + "".join(body)
                   + "</tbody></table>")


FOLD_AT = 60  # a transcript (or an error) longer than this is folded: its first words, the rest on a click


def _preview(text: str, limit: int) -> str:
    """The first words of ``text`` that fit in ``limit`` characters, then an ellipsis."""
    cut = text[:limit + 1].rsplit(" ", 1)[0] if " " in text[:limit + 1] else text[:limit]
    return cut.rstrip(" ,.;:") + "…"


def _folded(text: str, error: str) -> str:
    """A request's transcript for its table cell, on one line: whole when short, else folded in a
    ``<details>`` whose summary is its first words; an error comes first (its first words in the summary)."""
    words = html.escape(text) or "<span class=\"empty\">(no words)</span>"
    if not error and len(text) <= FOLD_AT:
        return words
    if error:  # the error in the summary (its first words when long: then whole above the transcript)
        summary = f"<span class=\"warn\">error: {html.escape(error if len(error) <= FOLD_AT else _preview(error, FOLD_AT))}</span>"
        full = words if len(error) <= FOLD_AT else f"<span class=\"warn\">error: {html.escape(error)}</span><br>{words}"
    else:
        summary, full = html.escape(_preview(text, FOLD_AT)), words
    return f"<details><summary>{summary}</summary><p>{full}</p></details>"


def _over(wer: str) -> bool:
    try:
        return float(wer) > WER_THRESHOLD
    except ValueError:
        return False


# --------------------------------------------------------------------------- entry points (I/O)


def _loaded(run: Run | Path, cells: list[CellSummary] | None) -> tuple[Run, list[CellSummary]]:
    run = run if isinstance(run, Run) else load_run(run)
    return run, cells if cells is not None else summarize_cells(run)


def terminal_table(run: Run | Path, cells: list[CellSummary] | None = None) -> str:
    """The seed table, its WER-source note and the extended table as aligned text.

    Takes a loaded ``Run`` (and its cells) to reuse them, or a run directory to read.
    """
    return terminal_text(*_loaded(run, cells))


def indented_json(obj: Any) -> str:
    """``json.dumps(obj, indent=2)``, the same text, faster: with an indent ``json`` encodes in Python
    (1.1 million calls for the summary.json of 10,000 requests, issue 48), so the C encoder writes it
    compact and msgspec re-indents it (ASCII in, the escapes kept as they are). Anything msgspec
    refuses (NaN, Infinity: not JSON) takes ``json.dumps`` itself."""
    compact = json.dumps(obj, separators=(",", ":"))
    try:
        import msgspec

        return msgspec.json.format(compact, indent=2)
    except (ImportError, ValueError):  # msgspec.DecodeError is a ValueError
        return json.dumps(obj, indent=2)


def _draw(run: Run, cells: list[CellSummary]) -> dict[str, bytes]:
    from harness.report import plots  # matplotlib is imported only when plots are drawn

    return plots.render_all(run, cells)


def write_reports(run: Run | Path, cells: list[CellSummary] | None = None, verdict: Any = None) -> dict[str, Path]:
    """Writes summary.csv, summary.md, summary.json, requests.csv, the plots and report.html.

    Takes a loaded ``Run`` (and its cells, as ``omni-stress run`` does after printing them) or a
    run directory. Returns {kind: path}. Plots are written under ``plots/`` and embedded in the HTML.
    ``verdict``: the gate's verdict the page opens with (``html_report``), from the caller: the gate
    sits above the report (``harness.gate.verdict.page_verdict``).
    """
    from harness.report import plotcache

    run, cells = _loaded(run, cells)
    run_dir = run.run_dir
    out: dict[str, Path] = {}

    plot_dir = run_dir / "plots"
    if plot_dir.is_symlink():
        raise OSError(errno.ELOOP, "is a symbolic link; refused", str(plot_dir))
    key = plotcache.render_key(run, cells)
    images = plotcache.cached_images(plot_dir, key)  # the PNGs already there when nothing they show changed
    # The plots (matplotlib's import, layout and PNG encoding: about half of ``report`` on 10,000
    # requests, issue 48) are drawn in a forked child while this process writes the tables; where a
    # fork is not safe, or the child fails, they are drawn here after them (the same bytes either way).
    drawing = None if images is not None else fork_call(lambda: pickle.dumps(_draw(run, cells)))

    # Every file is written whole by a rename (records.write_file_atomic): a summary.csv that is a
    # symlink to a file outside the run directory is replaced, never written through.
    full_requests = requests_table(run, cells, max_text=10_000)
    out["csv"] = run_dir / "summary.csv"
    write_file_atomic(out["csv"], cells_frame(cells).to_csv(index=False))
    out["requests_csv"] = run_dir / "requests.csv"
    write_file_atomic(out["requests_csv"], full_requests.to_csv(index=False))
    out["paired_csv"] = run_dir / "paired.csv"
    write_file_atomic(out["paired_csv"], paired_frame(cells).to_csv(index=False))
    out["markdown"] = run_dir / "summary.md"
    write_file_atomic(out["markdown"], markdown_text(run, cells))
    out["json"] = run_dir / "summary.json"
    write_file_atomic(out["json"], indented_json(json_summary(run, cells)) + "\n")
    streaming = streaming_json(cells)
    if streaming is not None:  # runs that streamed nothing keep the files they had
        out["streaming_json"] = run_dir / "streaming.json"
        write_file_atomic(out["streaming_json"], indented_json(streaming) + "\n")

    plot_dir.mkdir(exist_ok=True)
    if images is None and drawing is not None:
        try:
            drawn, data = drawing.result()
        finally:
            drawing.close()
        images = pickle.loads(data) if drawn and data else None
    if images is None:
        images = _draw(run, cells)
    for name, png in images.items():
        path = plot_dir / f"{name}.png"
        write_file_atomic(path, png)
        out[f"plot_{name}"] = path
    plotcache.remember(plot_dir, key, images)
    out["html"] = run_dir / "report.html"
    write_file_atomic(out["html"], html_report(run, cells, images, verdict))
    return out
