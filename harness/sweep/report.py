"""The map of a sweep's run directory: ``sweep.md``, ``sweep.html``, ``sweep.json`` and heatmap PNGs.

One row per arm x grid point (repeats pooled): WER, requests over 0.5, misaligned text positions,
the scheduler events, latency percentiles (steps on the sim, seconds on the real backend), duration
against the reference cell (truncated / overrun requests), whether the point stressed, and the map
gate's verdict (``harness.sweep.gate``). Heatmaps: one PNG per arm x metric, x and y the first two
swept knobs, one panel per load (and per value of any further knob). matplotlib is imported only
to draw them.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.backends import is_simulated
from harness.errors import UserError
from harness.metrics import STRESSED_POINT_METRICS
from harness.gate import Rules
from harness.records import MANIFEST_FILE
from harness.report.summary import CellSummary, Run, load_run, run_problems, summarize_cells
from harness.report.style import VERDICT_CSS
from harness.config import StreamingSlo
from harness.streaming_figures import StreamingFigures, bench_fields, figures
from harness.sweep.gate import ArmVerdict, MapVerdict, evaluate_map, stressed
from harness.sweep.metrics import (
    PERCENTILES,
    Duration,
    Latency,
    Schedules,
    audio_seconds,
    duration,
    latency,
    schedules,
)

HEATMAP_DIR = "sweep_plots"
METRICS = {  # heatmap metric -> (title, colour map, fixed range or None)
    "wer": ("mean WER", "Reds", (0.0, 1.0)),
    "over": ("requests with WER > 0.5 (fraction)", "Reds", (0.0, 1.0)),
    "misaligned": ("misaligned positions (text region)", "Purples", None),
    "events": ("stress events (non-zero-offset chunks + crossing replays + multi-position decode spans)", "Blues", None),
    "latency": ("end-to-end latency p90", "Oranges", None),
}


@dataclass
class Row:
    arm: str
    role: str
    deploy: str
    coords: dict[str, str]  # axis short name -> value label ({} for the reference)
    cells: list[CellSummary]
    latency: Latency
    duration: Duration
    status: str  # map gate per point: pass, fail, error, unstressed, bug (baseline shows it), no-bug, reference
    knee: bool = False

    @property
    def requests(self) -> int:
        return sum(c.requests for c in self.cells)

    @property
    def mean_wer(self) -> float | None:
        values = [c.mean_wer for c in self.cells if c.mean_wer is not None]
        return statistics.fmean(values) if values else None

    @property
    def over(self) -> int:
        return sum(c.requests_over() for c in self.cells)

    @property
    def scored(self) -> int:
        return sum(c.scored for c in self.cells)

    def events(self, name: str) -> int:
        return sum(getattr(c.events, name) for c in self.cells)

    @property
    def stress_events(self) -> int:
        return sum(self.events(n) for n in STRESSED_POINT_METRICS)

    @property
    def audio_seconds(self) -> float | None:
        return audio_seconds([rec for c in self.cells for rec in c.records])

    @property
    def stressed(self) -> int:
        return sum(stressed(c) for c in self.cells)

    @property
    def streaming(self) -> StreamingFigures | None:
        """The point's streaming figures over all its cells (None: nothing streamed)."""
        slo = next((c.slo for c in self.cells if c.slo is not None), None) or StreamingSlo()
        return figures([rec for c in self.cells for rec in c.records], slo)

    @property
    def preemptions(self) -> int:
        return sum(c.preemptions for c in self.cells)

    @property
    def errors(self) -> int:
        return sum(c.errors for c in self.cells)

    def value(self, metric: str) -> float | None:
        if metric == "wer":
            return self.mean_wer
        if metric == "over":
            return self.over / self.scored if self.scored else None
        if metric == "misaligned":
            return float(self.events("misaligned_text_positions"))
        if metric == "events":
            return float(self.stress_events)
        if metric == "latency":
            return self.latency.e2e.get(90)
        raise KeyError(metric)


@dataclass
class SweepMap:
    run: Run
    sweep: dict[str, Any]
    rows: list[Row]
    verdict: MapVerdict
    schedules: Schedules
    problems: list[str] = field(default_factory=list)
    rules_name: str = ""  # the rules file the map was gated with (its name: ``gates.yaml``)

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir

    @property
    def axes(self) -> list[dict[str, Any]]:
        return list(self.sweep.get("axes", []))


def sweep_of(run: Run) -> dict[str, Any]:
    sweep = run.manifest.get("sweep")
    if not isinstance(sweep, dict) or not isinstance(sweep.get("points"), list):
        raise UserError(f"{run.run_dir / MANIFEST_FILE}: not a sweep's run directory (no sweep in the manifest)")
    return sweep


def light_run(run_dir: Path) -> Run:
    """A sim sweep's run without its spans, when every record carries its schedule digest: the cells'
    events come from the records (``gate`` checks they equal the spans' counts), and reading
    hundreds of megabytes of spans is most of the time the map takes. Otherwise ``load_run``."""
    from harness.records import REQUESTS_FILE, read_manifest, read_requests
    from harness.report.summary import _torn_tail, _validate_manifest

    from harness.rundir import check_run_files

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return load_run(run_dir)
    check_run_files(run_dir)
    try:
        manifest = read_manifest(run_dir)
        _validate_manifest(manifest, run_dir / MANIFEST_FILE)
        requests = read_requests(run_dir)
    except (OSError, ValueError, TypeError, UserError):
        return load_run(run_dir)  # it names the problem
    if not is_simulated(manifest.get("backend", "sim")) or not requests or any(r.schedule is None for r in requests):
        return load_run(run_dir)
    torn = (REQUESTS_FILE,) if _torn_tail(run_dir / REQUESTS_FILE) else ()
    return Run(run_dir=run_dir, manifest=manifest, requests=requests, torn=torn)


def build_map(run_dir: Path | Run, rules: Rules) -> SweepMap:
    run = run_dir if isinstance(run_dir, Run) else light_run(Path(run_dir))
    sweep = sweep_of(run)
    cells = summarize_cells(run)
    verdict = evaluate_map(rules, cells, sweep)
    by_arm = {a.arm: a for a in verdict.arms}
    ref_name = sweep.get("reference")
    rows: list[Row] = []
    points = [(str(p["deploy"]), dict(p.get("coords") or {})) for p in sweep["points"]]
    for arm in dict.fromkeys(c.arm for c in cells):
        mine = [c for c in cells if c.arm == arm]
        refs = {c.repeat: c for c in mine if c.deploy == ref_name}
        role = mine[0].role
        av = by_arm.get(arm)
        if refs:
            recs = [r for c in refs.values() for r in c.records]
            rows.append(Row(arm, role, str(ref_name), {}, list(refs.values()), latency(recs), Duration(), "reference"))
        for deploy, coords in points:
            group = [c for c in mine if c.deploy == deploy]
            if not group:
                continue
            recs = [r for c in group for r in c.records]
            dur = Duration()
            for c in group:
                ref = refs.get(c.repeat) or (next(iter(refs.values())) if len(refs) == 1 else None)
                d = duration(c, ref)
                dur = Duration(dur.compared + d.compared, dur.truncated + d.truncated, dur.overrun + d.overrun,
                               dur.ratios + d.ratios)
            verdicts = [v for v in (av.cells if av else []) if v.point == deploy]
            status = _point_status(role, verdicts)
            rows.append(Row(arm, role, deploy, coords, group, latency(recs), dur, status,
                            knee=bool(av and av.knee == deploy)))
    return SweepMap(run, sweep, rows, verdict, schedules(run), run_problems(run), Path(rules.source).name)


def _point_status(role: str, verdicts: list) -> str:
    if not verdicts:
        return "missing"
    if not any(v.stressed for v in verdicts):
        return "unstressed"
    hit = [v for v in verdicts if v.stressed]
    if role == "baseline":
        return "bug" if any(v.shows_bug for v in hit) else "no-bug"
    statuses = {v.status for v in hit}
    return "error" if "error" in statuses else "fail" if "fail" in statuses else "pass"


# --------------------------------------------------------------------------- tables


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _fmt_num(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def _unit(m: SweepMap) -> str:
    return next((r.latency.unit for r in m.rows if r.latency.measured), "steps")


def _percentiles(values: dict[int, float | None]) -> str:
    return "/".join(_fmt_num(values[q]) for q in PERCENTILES)


def _ttfa_sources(m: SweepMap) -> set[str]:
    return {r.latency.ttfa_source for r in m.rows if r.latency.ttfa_source is not None}


def table_rows(m: SweepMap) -> tuple[list[str], list[list[str]]]:
    """The map's columns; RTF and the audio's seconds only where some row has them (the real backend,
    or a sim run with TTS), so a sim sweep's table keeps its columns. TTFA says where it comes from:
    measured on a stream (``--stream``: "measured" in its head), else the trace's first codec token;
    a map with both marks each cell ``[stream]`` or ``[trace]``."""
    shorts = [a["short"] for a in m.axes]
    unit = _unit(m)
    sources = _ttfa_sources(m)
    mark = len(sources) > 1 or "mixed" in sources
    ttfa_head = f"TTFA p50/p90/p99 ({unit}, measured)" if sources == {"stream"} else f"TTFA p50/p90/p99 ({unit})"
    with_rtf = any(r.latency.rtf[50] is not None for r in m.rows)
    with_audio = any(r.audio_seconds is not None for r in m.rows)
    streams = {id(r): r.streaming for r in m.rows}
    with_stream = any(f is not None for f in streams.values())  # streamed points: how it played (sim maps as before)
    head = (["Arm", "Point"] + shorts + ["WER (mean)", "WER > 0.5", "Misaligned (text)", "Chunks", "Replays",
                                          "Multi-decode", "Preempt.", f"E2E p50/p90/p99 ({unit})",
                                          ttfa_head]
            + (["RTF p50/p90/p99"] if with_rtf else []) + (["Audio s (med)"] if with_audio else [])
            + (STREAM_HEAD if with_stream else [])
            + ["Dur. ratio (med)", "Truncated", "Overrun", "Stressed", "Map gate"])
    body = []
    for r in m.rows:
        lat = r.latency
        status = r.status + (" (knee)" if r.knee else "")
        body.append([r.arm, r.deploy if not r.coords else "@" + r.deploy.split("@", 1)[-1]]
                    + [r.coords.get(s, "·") for s in shorts]
                    + [_fmt(r.mean_wer), f"{r.over}/{r.scored}", str(r.events("misaligned_text_positions")),
                       str(r.events("nonzero_offset_chunks")), str(r.events("cross_boundary_replays")),
                       str(r.events("multi_position_decode_spans")), str(r.preemptions), _percentiles(lat.e2e),
                       _percentiles(lat.ttfa) + (f" [{lat.ttfa_source}]" if mark and lat.ttfa_source else "")]
                    + ([_percentiles(lat.rtf)] if with_rtf else [])
                    + ([_fmt(r.audio_seconds, 2)] if with_audio else [])
                    + (_stream_cells(streams[id(r)]) if with_stream else [])
                    + [_fmt(r.duration.median_ratio, 2) if r.coords else "1 (ref)",
                       f"{r.duration.truncated}/{r.duration.compared}" if r.coords else "–",
                       f"{r.duration.overrun}/{r.duration.compared}" if r.coords else "–",
                       f"{r.stressed}/{len(r.cells)}" if r.coords else "–", status])
    return head, body


STREAM_HEAD = ["Stall worst (s)", "Continuity 100 ms", "Goodput", "Failed", "Chunk violations"]


def _stream_cells(f: StreamingFigures | None) -> list[str]:
    if f is None:
        return ["–"] * len(STREAM_HEAD)
    rate = (lambda v: "–" if v is None else f"{v:.0%}")
    return [_fmt(f.worst_stall_s), rate(f.continuity_rate), rate(f.goodput), f"{f.failed}/{f.requests}",
            "–" if f.chunk_violations is None else str(f.chunk_violations)]


def latency_note(m: SweepMap) -> str | None:
    """What the latency columns mean on the real backend (None for a sim sweep: steps), and the
    ``--trace`` level they were measured at (the plugin runs in the Talker they time)."""
    if _unit(m) != "s":
        return None
    sources = _ttfa_sources(m)
    trace = ("the seconds from the send to the Talker's first codec token, read from the server's trace (its first "
             "call at a generated position), the earliest a streaming API could send audio")
    if sources == {"stream"}:
        ttfa = ("TTFA is measured (the client asks for stream: true, --stream): the seconds from the send to the "
                "first audio bytes received; each request's chunks, gaps and underruns are in its record "
                "(stream_* fields, docs/streaming.md)")
    elif "stream" in sources or "mixed" in sources:
        ttfa = ("TTFA is measured on a stream where marked [stream] (the seconds from the send to the first audio "
                f"bytes received) and trace-derived where marked [trace] ({trace})")
    else:
        ttfa = ("TTFA is not streamed (the client asks for stream: false and the audio arrives whole with the "
                f"response, at E2E): it is {trace}")
    from harness.report.tables import trace_note

    level = trace_note(m.run)
    return ("latency (real backend, wall seconds on this host): E2E from the request's send to its whole response; "
            f"{ttfa}; RTF = E2E / the audio's seconds; Dur. ratio, Truncated (< 90 %) and Overrun (> 110 %) compare "
            "each request's codec tokens with the same prompt's reference cell."
            + (f" {level}." if level else ""))


def _render_text(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(line.rstrip() for line in lines)


def _render_markdown(head: list[str], body: list[list[str]]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|")
    lines = ["| " + " | ".join(esc(h) for h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def schedules_line(m: SweepMap) -> str:
    s = m.schedules
    repeats = m.run.manifest.get("repeat", 1)
    per_arm = ", ".join(f"{a} {n}" for a, n in s.per_arm.items())
    return (f"distinct schedules explored: {s.distinct} distinct (deploy, prompt, (P, c, n) span sequence) over "
            f"{s.requests} request runs (seed {m.run.manifest.get('seed')}, {repeats} repeat"
            f"{'s' if repeats != 1 else ''}; per arm: {per_arm or 'none'})")


def knee_lines(m: SweepMap) -> list[str]:
    from harness.sweep.gate import knee_text

    return [f"{a.arm} [{a.role}]: {knee_text(a)}" for a in m.verdict.arms]


def terminal_map(m: SweepMap) -> str:
    from harness.sweep.gate import format_map_verdict

    head, body = table_rows(m)
    note = latency_note(m)
    parts = [f"sweep {m.sweep.get('name')}: {len(m.sweep.get('points', []))} points, base {m.sweep.get('base')}, "
             f"reference {m.sweep.get('reference')}", _render_text(head, body), ""] + ([note, ""] if note else []) \
        + [schedules_line(m), ""]
    parts.append(format_map_verdict(m.verdict).rstrip())
    if m.problems:
        parts.append("warning: incomplete run: " + "; ".join(m.problems))
    return "\n".join(parts)


def map_json(m: SweepMap) -> dict[str, Any]:
    rows = []
    for r in m.rows:
        rows.append({
            "arm": r.arm, "role": r.role, "deploy": r.deploy, "coords": r.coords, "requests": r.requests,
            "mean_wer": r.mean_wer, "requests_over": r.over, "scored": r.scored,
            "misaligned_text_positions": r.events("misaligned_text_positions"),
            "nonzero_offset_chunks": r.events("nonzero_offset_chunks"),
            "cross_boundary_replays": r.events("cross_boundary_replays"),
            "multi_position_decode_spans": r.events("multi_position_decode_spans"),
            "preemptions": r.preemptions, "errors": r.errors,
            "latency": {"unit": r.latency.unit, "e2e": r.latency.e2e, "ttfa": r.latency.ttfa, "rtf": r.latency.rtf,
                        "measured": r.latency.measured, "ttfa_source": r.latency.ttfa_source},
            "audio_seconds_median": r.audio_seconds,
            "duration": {"compared": r.duration.compared, "truncated": r.duration.truncated,
                         "overrun": r.duration.overrun, "median_ratio": r.duration.median_ratio},
            "stressed_cells": r.stressed, "cells": len(r.cells), "status": r.status, "knee": r.knee,
            **({"streaming": bench_fields(f)} if (f := r.streaming) is not None else {}),
        })
    return {
        "run_id": m.run.run_id, "sweep": m.sweep, "rows": rows,
        "schedules": {"requests": m.schedules.requests, "distinct": m.schedules.distinct,
                      "per_arm": m.schedules.per_arm, "per_deploy": m.schedules.per_deploy},
        "verdict": {"exit_code": m.verdict.exit_code,
                    "arms": [{"arm": a.arm, "role": a.role, "status": a.status, "summary": a.summary,
                              "knee": a.knee, "knees": a.knees} for a in m.verdict.arms]},
        "problems": m.problems,
    }


def markdown(m: SweepMap, plots: dict[str, str]) -> str:
    from harness.sweep.gate import format_map_verdict

    head, body = table_rows(m)
    lines = [f"# Sweep {m.sweep.get('name')}: {m.run.run_id}", "",
             f"Base deploy `{m.sweep.get('base')}`, reference `{m.sweep.get('reference')}`, "
             f"{len(m.sweep.get('points', []))} points; axes: "
             + "; ".join(f"`{a['key']}` ({a['short']}): {', '.join(map(str, a['values']))}" for a in m.axes), "",
             _render_markdown(head, body), ""] + ([note, ""] if (note := latency_note(m)) else []) \
        + [schedules_line(m), "", "## Quality knee", ""]
    lines += [f"* {line}" for line in knee_lines(m)]
    lines += ["", "## Map gate", "", "```", format_map_verdict(m.verdict).rstrip(), "```"]
    if m.problems:
        lines += ["", "**Incomplete run:** " + "; ".join(m.problems)]
    if plots:
        lines += ["", "## Heatmaps", ""] + [f"![{name}]({path})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


# what each point's status means in the page, and the class (colour) it gets: a baseline arm is kept because it
# shows the bug, so its "bug" is expected (blue), neither a pass (green) nor a failure (red)
STATUS_CLASS = {"pass": "pass", "fail": "fail", "error": "fail", "unstressed": "unstressed", "bug": "expected",
                "no-bug": "note", "reference": "reference", "missing": "unstressed"}
LEGEND = [
    ("pass", "pass", "a candidate holds its rules at this stressed point"),
    ("expected", "bug (expected)", "a baseline shows the bug it is kept for (the map gate needs it at one point "
                                   "at least)"),
    ("note", "no-bug", "a baseline did not show the bug here (a note: it must show it somewhere, not everywhere)"),
    ("fail", "fail / error", "a candidate broke a rule, or the point could not be judged"),
    ("unstressed", "unstressed", "no cell stressed (no non-zero-offset chunk, crossing replay or multi-position "
                                 "decode span): reported, not counted"),
    ("reference", "reference", "the arm's reference cell, what the points are compared with"),
]

_SWEEP_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;padding:.8em 1.5em 2em;color:#222;
max-width:1400px;line-height:1.35}
h1{font-size:1.5em;margin:.3em 0}
h2{font-size:1.2em;margin:1.2em 0 .3em;padding-top:.4em;border-top:1px solid #e3e3e3}
h3{font-size:1.05em;margin:.8em 0 .2em}
p{margin:.3em 0}
code{background:#f4f4f4;padding:1px 4px}
.scroll{max-width:100%;overflow-x:auto;margin:.5em 0}
table.map{border-collapse:collapse;font-size:12px}
table.map td,table.map th{border:1px solid #d0d0d0;padding:3px 5px;text-align:right;white-space:nowrap}
table.map thead th{background:#f0f0f0;white-space:normal;vertical-align:bottom}
table.map th.arm{text-align:left;vertical-align:top;background:#f7f7f7}
table.map td.axis{text-align:center;font-weight:600}
table.map td.ref{text-align:left;font-style:italic;color:#555}
tr.pass td{background:#eef8ee}tr.fail td{background:#fdecec}tr.expected td{background:#eaf0fb}
tr.note td{background:#fdf6e3}tr.unstressed td{color:#777;background:#f4f4f4}
.badge{display:inline-block;padding:1px 7px;border-radius:9px;font-weight:600;font-size:11.5px;white-space:nowrap}
.badge.pass{background:#2e7d32;color:#fff}.badge.fail{background:#c62828;color:#fff}
.badge.expected{background:#3b5bb5;color:#fff}.badge.note{background:#e0b000;color:#222}
.badge.unstressed{background:#bdbdbd;color:#222}.badge.reference{background:#fff;color:#444;border:1px solid #aaa}
.badge.error{background:#6a1b9a;color:#fff}
ul.legend{list-style:none;padding:0;margin:.4em 0;font-size:13px;display:flex;flex-wrap:wrap;gap:.3em 1.4em}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f7f7f7;padding:.6em;font-size:12px;border:1px solid #e3e3e3}
.note{color:#555}
.warn{color:#a00}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em 1.5em;align-items:start}
figure{margin:0;border:1px solid #e3e3e3;padding:.5em;background:#fff}
figure.wide{grid-column:1/-1}
figure img{max-width:100%;height:auto;display:block;margin:0 auto}
figcaption{font-size:13px;color:#333;margin-top:.4em}
"""


def _status_cell(status: str) -> str:
    base = status.split(" ")[0]
    cls = STATUS_CLASS.get(base, "unstressed")
    label = "bug (expected)" if base == "bug" else base
    return f"<span class='badge {cls}'>{html.escape(label)}</span>" + (" knee" if status.endswith("(knee)") else "")


def html_table(m: SweepMap) -> str:
    """The map's table for the page: the arm once per block, the swept values in their own columns (not
    repeated in a Point column: the reference row says "reference" across them), the map gate's status
    as a coloured badge (a baseline's bug: expected, blue)."""
    head, body = table_rows(m)
    shorts = [a["short"] for a in m.axes]
    keys = {a["short"]: str(a["key"]) for a in m.axes}
    status_col = len(head) - 1
    arms = [row[0] for row in body]
    ths = []
    for i, h in enumerate(head):
        if i == 1 and shorts:
            continue  # the Point column: the axes' columns say it
        title = f" title='{html.escape(keys[h], quote=True)}'" if h in keys and i < 2 + len(shorts) else ""
        ths.append(f"<th{title}>{html.escape(h)}</th>")
    rows_html = []
    for j, (r, row) in enumerate(zip(m.rows, body)):
        cls = STATUS_CLASS.get(r.status, "unstressed")
        tds = []
        if j == 0 or arms[j - 1] != row[0]:
            span = arms.count(row[0])  # rows of one arm are contiguous (build_map)
            tds.append(f"<th class='arm' rowspan='{span}'>{html.escape(row[0])}<br>"
                       f"<span class='note'>{html.escape(r.role)}</span></th>")
        if shorts and not r.coords:
            tds.append(f"<td class='ref' colspan='{len(shorts)}'>{html.escape(r.deploy)} (reference)</td>")
        elif shorts:
            tds.extend(f"<td class='axis'>{html.escape(c)}</td>" for c in row[2:2 + len(shorts)])
        else:
            tds.append(f"<td>{html.escape(row[1])}</td>")
        tds.extend(f"<td>{html.escape(c)}</td>" for c in row[2 + len(shorts):status_col])
        tds.append(f"<td>{_status_cell(row[status_col])}</td>")
        rows_html.append(f"<tr class='{cls}' data-status='{html.escape(r.status)}'>" + "".join(tds) + "</tr>")
    return (f"<div class='scroll'><table class='map'><thead><tr>{''.join(ths)}</tr></thead><tbody>"
            + "".join(rows_html) + "</tbody></table></div>")


HEATMAP_TITLES = {"wer": "mean WER", "over": "requests with WER > 0.5", "misaligned": "misaligned positions (text)",
                  "events": "stress events", "latency": "end-to-end latency p90"}


def heatmap_caption(m: SweepMap, arm: str, metric: str) -> str:
    """What a heatmap shows, in words: the metric, its axes and panels, its colour scale, 'no stress'."""
    title, _, fixed = METRICS[metric]
    x_axis, y_axis, panel_axes = _layout(m)
    keys = {a["short"]: str(a["key"]) for a in m.axes}
    role = next((r.role for r in m.rows if r.arm == arm), "")
    what = {"wer": "the mean WER of the point's requests", "over": "the fraction of requests with WER over 0.5",
            "misaligned": "misaligned input rows in the text region (prompt and reply up to text-EOS), summed over "
                          "the point's requests",
            "events": "the stress the scheduler applied: non-zero-offset prefill chunks + replays crossing the "
                      "prompt boundary + multi-position decode spans",
            "latency": f"the 90th percentile of end-to-end latency ({_unit(m)})"}[metric]
    parts = [f"<b>{html.escape(arm)}</b> ({html.escape(role)}): {html.escape(what)}."]
    axes = []
    if x_axis:
        axes.append(f"x: {x_axis} ({keys.get(x_axis, x_axis)})")
    if y_axis:
        axes.append(f"y: {y_axis} ({keys.get(y_axis, y_axis)})")
    if panel_axes:
        axes.append("one panel per " + ", ".join(panel_axes))
    if axes:
        parts.append(html.escape("; ".join(axes)) + ".")
    scale = "fixed 0 to 1" if fixed else "0 to the largest value over the arm's points"
    parts.append(f"Colour bar: {scale}, darker is more. <i>no stress</i>: no cell of the point stressed "
                 "(reported, not counted by the gate).")
    if role == "baseline" and metric in ("wer", "over", "misaligned"):
        parts.append("A baseline is expected to show the bug under stress: dark stressed cells are its expected "
                     "failure, not a regression.")
    return " ".join(parts)


def _png_width(data: bytes) -> int:
    """A PNG's width in pixels, from its IHDR chunk (0 when it is no PNG)."""
    return int.from_bytes(data[16:20], "big") if data[:8] == b"\x89PNG\r\n\x1a\n" else 0


def _failing_rules(a: ArmVerdict) -> str:
    """What makes an arm fail, naming the rule: ``candidate-stress-matches-reference at 3 of 12 stressed
    points (s-c16, ...)``; a baseline that shows its bug nowhere says so."""
    parts = []
    ref_failed = list(dict.fromkeys(c.rule.name for c in a.reference if c.status == "fail"))
    parts += [f"{name} on the reference" for name in ref_failed]
    if a.role == "baseline":
        stressed_cells = a.stressed_cells
        if stressed_cells and not any(c.shows_bug for c in stressed_cells):
            expected = list(dict.fromkeys(case.rule.name for c in stressed_cells for case in c.cases
                                          if case.rule.expect == "fail"))
            parts.append(f"{', '.join(expected) or 'its expected failure'}: the bug shown at none of "
                         f"{len(stressed_cells)} stressed points")
    else:
        failed: dict[str, list[str]] = {}
        for c in a.stressed_cells:
            for case in c.cases:
                if case.status == "fail":
                    failed.setdefault(case.rule.name, []).append(c.point)
        n = len(a.stressed_cells)
        for name, points in failed.items():
            points = list(dict.fromkeys(points))
            shown = ", ".join(points[:3]) + (", ..." if len(points) > 3 else "")
            parts.append(f"{name} at {len(points)} of {n} stressed points ({shown})")
    return "; ".join(parts)


def map_verdict_parts(m: SweepMap) -> list[tuple[str, str, str]]:
    """(arm, status, text) per arm: the map gate's verdict, the failing rule named."""
    out = []
    for a in m.verdict.arms:
        status = a.status if a.status in ("pass", "fail") else "error"
        if status == "fail":
            text = "fails " + (_failing_rules(a) or a.summary)
        elif status == "error":
            text = "could not evaluate: " + ("; ".join(a.problems) or a.summary)
        else:
            text = "passes: " + a.summary
        out.append((a.arm, status, text))
    return out


def map_verdict_html(m: SweepMap) -> str:
    """The map gate's verdict as the one line a page opens with: each arm coloured by its status."""
    e = html.escape
    overall = {0: "pass", 1: "fail"}.get(m.verdict.exit_code, "error")
    roles = {a.arm: a.role for a in m.verdict.arms}
    parts = [f"<span class='arm {status}'><b>{e(arm)}</b> <span class='role'>({e(roles[arm])})</span> — "
             f"{e(text)}</span>" for arm, status, text in map_verdict_parts(m)]
    parts += [f"<span class='arm error'>{e(p)}</span>" for p in m.verdict.problems]
    rules = f" ({e(m.rules_name)})" if m.rules_name else ""
    return f"<p class='verdict {overall}'><b>Map gate</b>{rules}: " + " · ".join(parts) + "</p>"


@dataclass
class MapPageVerdict:
    """The map gate's verdict for a sweep's run page (``report RUN_DIR``): its line and each cell's
    outcome (the summary's tint), as ``harness.report.tables.html_report`` reads them."""

    html: str
    outcomes: dict[tuple[str, str, int], str]


def map_page_verdict(m: SweepMap) -> MapPageVerdict:
    outcomes: dict[tuple[str, str, int], str] = {}
    for a in m.verdict.arms:
        for case in a.reference:
            key = case.cell.key
            if case.status in ("fail", "error") and outcomes.get(key) != "fail":
                outcomes[key] = case.status
            outcomes.setdefault(key, "pass")
        for c in a.cells:
            if not c.stressed:
                continue
            if a.role == "baseline":
                outcomes[c.cell.key] = "expected" if c.shows_bug else "pass"
            else:
                outcomes[c.cell.key] = c.status
    return MapPageVerdict(map_verdict_html(m), outcomes)


def html_page(m: SweepMap, images: dict[str, bytes]) -> str:
    from harness.sweep.gate import format_map_verdict

    e = html.escape
    name = str(m.sweep.get("name"))
    axes = "; ".join(f"<code>{e(str(a['key']))}</code> ({e(str(a['short']))}): {e(', '.join(map(str, a['values'])))}"
                     for a in m.axes)
    arms = list(dict.fromkeys(r.arm for r in m.rows))
    legend = "".join(f"<li><span class='badge {cls}'>{e(label)}</span> {e(text)}</li>" for cls, label, text in LEGEND)
    figures = []
    for arm in arms:
        figs = []
        for metric in METRICS:
            data = images.get(f"{arm}-{metric}")
            if data is None:
                continue
            src = base64.b64encode(data).decode()
            wide = " class='wide'" if _png_width(data) > 900 else ""  # many panels: the whole row, readable
            figs.append(f"<figure id='{e(arm)}-{metric}'{wide}><img src='data:image/png;base64,{src}' "
                        f"alt='{e(arm)}: {e(HEATMAP_TITLES[metric])}'>"
                        f"<figcaption>{heatmap_caption(m, arm, metric)}</figcaption></figure>")
        if figs:
            role = next((r.role for r in m.rows if r.arm == arm), "")
            figures.append(f"<h3>{e(arm)} ({e(role)})</h3><div class='grid'>{''.join(figs)}</div>")
    note = latency_note(m)
    return f"""<!doctype html><html lang='en'><head><meta charset='utf-8'>
<meta name='viewport' content='width=device-width, initial-scale=1'><title>sweep {e(name)}</title>
<style>{_SWEEP_CSS}{VERDICT_CSS}</style></head><body>
<h1>Sweep {e(name)}: {e(m.run.run_id)}</h1>
{map_verdict_html(m)}
<p>Base deploy <code>{e(str(m.sweep.get('base')))}</code>, reference <code>{e(str(m.sweep.get('reference')))}</code>,
{len(m.sweep.get('points', []))} points; axes: {axes}.</p>
{'<p class="warn"><b>Incomplete run:</b> ' + e('; '.join(m.problems)) + '</p>' if m.problems else ''}
<h2 id='map'>The map</h2>
<ul class='legend'>{legend}</ul>
{html_table(m)}
{'<p class="note">' + e(note) + '</p>' if note else ''}
<p class='note'>{e(schedules_line(m))}</p>
<h2 id='knee'>Quality knee</h2><ul>{''.join(f'<li>{e(k)}</li>' for k in knee_lines(m))}</ul>
<h2 id='gate'>Map gate</h2><pre>{e(format_map_verdict(m.verdict))}</pre>
{'<h2 id="heatmaps">Heatmaps</h2>' + ''.join(figures) if figures else ''}
</body></html>
"""


# --------------------------------------------------------------------------- heatmaps


def _layout(m: SweepMap) -> tuple[str | None, str | None, list[str]]:
    """(x axis short name, y axis short name, panel axes): the first two knobs, panels per load and the rest."""
    knobs = [a["short"] for a in m.axes if a["key"] != "load"]
    loads = [a["short"] for a in m.axes if a["key"] == "load"]
    if not knobs:
        return (loads[0] if loads else None), None, []
    x = knobs[0]
    y = knobs[1] if len(knobs) > 1 else None
    return x, y, loads + knobs[2:]


def heatmaps(m: SweepMap) -> dict[str, bytes]:
    """{"<arm>-<metric>": PNG bytes} for every arm x metric."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x_axis, y_axis, panel_axes = _layout(m)
    values = {a["short"]: [str(v) for v in a["values"]] for a in m.axes}
    xs = values.get(x_axis, [""]) if x_axis else [""]
    ys = values.get(y_axis, [""]) if y_axis else [""]
    panels: list[tuple[tuple[str, str], ...]] = [()]
    for axis in panel_axes:
        panels = [p + ((axis, v),) for p in panels for v in values[axis]]
    out = {}
    unit = _unit(m)
    for arm in dict.fromkeys(r.arm for r in m.rows):
        rows = [r for r in m.rows if r.arm == arm and r.coords]
        for metric, (_, cmap, fixed) in METRICS.items():
            fig, axes = plt.subplots(1, len(panels), figsize=(1.6 + (1.15 * len(xs) + 0.9) * len(panels),
                                                              1.9 + 0.62 * len(ys)),
                                     squeeze=False, layout="constrained")
            grids = []
            for panel in panels:
                grid = np.full((len(ys), len(xs)), np.nan)
                flags = np.zeros((len(ys), len(xs)), dtype=bool)
                for r in rows:
                    if any(r.coords.get(k) != v for k, v in panel):
                        continue
                    xi = xs.index(r.coords.get(x_axis, "")) if x_axis else 0
                    yi = ys.index(r.coords.get(y_axis, "")) if y_axis else 0
                    v = r.value(metric)
                    grid[yi, xi] = np.nan if v is None else v
                    flags[yi, xi] = r.stressed == 0
                grids.append((panel, grid, flags))
            finite = [g[np.isfinite(g)] for _, g, _ in grids]
            vmax = max((float(f.max()) for f in finite if f.size), default=1.0)
            lo, hi = fixed if fixed else (0.0, vmax or 1.0)
            image = None
            for ax, (panel, grid, flags) in zip(axes[0], grids):
                image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
                for yi in range(len(ys)):
                    for xi in range(len(xs)):
                        v = grid[yi, xi]
                        text = "–" if np.isnan(v) else (f"{v:.2f}" if metric in ("wer", "over") else f"{v:.0f}")
                        dark = not np.isnan(v) and (v - lo) > 0.55 * (hi - lo)
                        ax.text(xi, yi, text, ha="center", va="center", fontsize=11, fontweight="bold",
                                color="white" if dark else "black")
                        if flags[yi, xi]:
                            ax.text(xi, yi + 0.3, "no stress", ha="center", va="center", fontsize=7.5,
                                    style="italic", color="white" if dark else "#555")
                ax.set_xticks(range(len(xs)), xs, fontsize=9)
                ax.set_yticks(range(len(ys)), ys, fontsize=9)
                ax.set_xlabel(x_axis or "", fontsize=9)
                ax.set_ylabel(y_axis or "", fontsize=9)
                ax.set_title(", ".join(f"{k}={v}" for k, v in panel) or "all points", fontsize=9.5)
            unit_label = f" ({unit})" if metric == "latency" else ""
            if image is not None:
                bar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.9, pad=0.02, aspect=12)
                bar.ax.tick_params(labelsize=8)
                bar.set_label(HEATMAP_TITLES[metric] + unit_label, fontsize=8.5)
            fig.suptitle(f"{arm}: {HEATMAP_TITLES[metric]}{unit_label}", fontsize=11)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            plt.close(fig)
            out[f"{arm}-{metric}"] = buf.getvalue()
    return out


def write_sweep_report(m: SweepMap, plots: bool = True) -> dict[str, Path]:
    """Writes sweep.md, sweep.html, sweep.json and (``plots``) sweep_plots/<arm>-<metric>.png."""
    from harness.backends import safe_name
    from harness.records import write_file_atomic

    run_dir = m.run_dir
    images = heatmaps(m) if plots else {}
    paths: dict[str, str] = {}
    out: dict[str, Path] = {}
    if images:
        folder = run_dir / HEATMAP_DIR
        folder.mkdir(exist_ok=True)
        for name, data in images.items():
            path = folder / f"{safe_name(name)}.png"
            path.write_bytes(data)
            paths[name] = f"{HEATMAP_DIR}/{path.name}"
    for name, text in (("sweep.md", markdown(m, paths)), ("sweep.html", html_page(m, images)),
                       ("sweep.json", json.dumps(map_json(m), indent=1, sort_keys=True) + "\n")):
        write_file_atomic(run_dir / name, text)
        out[name] = run_dir / name
    return out
