"""``omni-stress fidelity``: the sim measured against a real run of the same work, request by request.

Pure functions, no I/O: ``compare`` takes two ``Side``s (a run's records and each request's event
counts, read by the command) and matches their requests by (arm, deploy, repeat, prompt id);
``render_text`` and ``as_json`` say the result. Per request it also says whether the two sides ran the
same spans (the schedule) and, where the codec streams differ, from which token and what each side's
codes say, read back by the run's family's speaking rules (``Family.speaking_rules()``: Qwen2.5-Omni's
``harness.families.qwen2_5_omni.speaking``, Qwen3-TTS's ``harness.families.qwen3_tts.speaking``). With ``run --sim-talker speaking`` the sim runs the
speaking tiny model's Talker, so a difference between the two sides is the scheduler, the runner or
timing, not the Talker (docs/fidelity.md says which differences to expect and why).

Per request and cell it also says how the request *interleaved* with others in the Talker: its Talker overlap,
the runner steps in which another request of its cell also ran (:func:`talker_overlap`, from the spans of either
backend). Two requests can run identical spans of their own yet share their steps with different neighbours; an
arm that keeps state across requests then sees other rows on each side, so where the misaligned counts of
identical spans differ, the note says whether the overlap differs too (the cause it finds), not only that rows
are compared by value on the real side. The overlap is a property of the schedule, like the spans: it is not
one of the metrics below and does not make a request "differ".

Where either run carries Code2Wav windows (``chunk_frames_sent``: a streaming deploy's connector, traced on the
real server, modelled by the sim, ``harness.sim.windows``), each request also says whether the two sides' window
boundaries agree and from which window they part ("not measured" where a side has none); runs without windows
print and write exactly what they did before.

Per arm x deploy (x repeat) and per request, sim beside real with the ratio sim / real:
oracle WER (the cell's mean), codec tokens, non-zero-offset chunks, crossing replays, multi-position
decode spans, preemptions, row-count mismatches (prefill calls whose rows differ from the span) and
prefill calls, misaligned positions in the text and end regions. A ratio of two zeros is 1.0 (the
same), of a number over zero undefined (None, shown as ``-``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.backends import is_simulated
from harness.errors import UserError
from harness.metrics import BY_NAME as COUNTS
from harness.records import EventCounts, RequestRecord

RequestKey = tuple[str, str, int, str]  # (arm, deploy, repeat, prompt id)
CellKey = tuple[str, str, int]


@dataclass(frozen=True)
class Metric:
    key: str  # JSON name
    label: str  # table name
    value: Callable[[RequestRecord, EventCounts], float | int | None]
    mean: bool = False  # the cell's value is the mean over its requests (else the sum)


def _short(name: str) -> str:
    return COUNTS[name].short


def _count(name: str, key: str | None = None) -> Metric:
    """A count of ``harness.metrics`` (its label defined there), under ``key`` in the JSON."""
    return Metric(key or name, _short(name), lambda r, e: getattr(e, name))


METRICS: tuple[Metric, ...] = (
    Metric("oracle_wer", "oracle WER", lambda r, e: r.oracle_wer, mean=True),
    Metric("codec_tokens", "codec tokens", lambda r, e: r.num_codec_tokens),
    *(_count(name) for name in ("nonzero_offset_chunks", "cross_boundary_replays", "multi_position_decode_spans")),
    Metric("preemptions", "preemptions", lambda r, e: r.preemptions),
    # the server's trace knows the row counts of prefill calls only: compared there
    Metric("row_count_mismatches", _short("row_count_mismatches"), lambda r, e: e.prefill_row_count_mismatches),
    _count("prefill_calls"),
    _count("misaligned_text_positions", "misaligned_text"),
    _count("misaligned_end_positions", "misaligned_end"),
)


@dataclass
class Side:
    """One run as the comparison sees it."""

    label: str  # the run id
    backend: str | None  # the manifest's backend
    talker: str | None  # the sim's Talker mode (None: a real run)
    records: Sequence[RequestRecord]
    events: Mapping[RequestKey, EventCounts] = field(default_factory=dict)  # per request (spans), else the record's
    schedules: Mapping[RequestKey, str] = field(default_factory=dict)  # per request: ``span_schedules``
    overlap: Mapping[RequestKey, int] = field(default_factory=dict)  # per request: ``talker_overlap``

    def describe(self) -> str:
        text = f"{self.label} (backend {self.backend or '?'}"
        return text + (f", Talker {self.talker})" if self.talker else ")")


@dataclass(frozen=True)
class Value:
    """One metric, sim beside real."""

    sim: float | int | None
    real: float | int | None

    @property
    def ratio(self) -> float | None:
        return ratio(self.sim, self.real)

    @property
    def same(self) -> bool:
        return self.sim == self.real


def ratio(sim: float | int | None, real: float | int | None) -> float | None:
    """sim / real; two zeros are 1.0 (the same), a number over zero or a missing value None."""
    if sim is None or real is None:
        return None
    if real == 0:
        return 1.0 if sim == 0 else None
    return sim / real


NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class WindowComparison:
    """One request's Code2Wav window boundaries (``chunk_frames_sent``: new frames per window), sim beside real."""

    sim: list[int] | None  # None: that side has no windows (not streamed, not traced, or not modelled)
    real: list[int] | None

    @property
    def status(self) -> str:
        """``same``, ``differ``, or ``not measured`` (a side without windows)."""
        if self.sim is None or self.real is None:
            return NOT_MEASURED
        return "same" if list(self.sim) == list(self.real) else "differ"

    @property
    def first_difference(self) -> int | None:
        """The index of the first window whose new-frame count differs (one side ending early differs at its
        end); None when they agree or are not measured."""
        if self.sim is None or self.real is None:
            return None
        return first_difference(self.sim, self.real)

    def cell_text(self) -> str:
        """The per-request table's ``Same windows`` column."""
        status = self.status
        return "yes" if status == "same" else f"no (window {self.first_difference})" if status == "differ" else status


def compare_windows(sim: RequestRecord, real: RequestRecord) -> WindowComparison | None:
    """The two records' window boundaries; None when neither carries any (nothing to say)."""
    if sim.chunk_frames_sent is None and real.chunk_frames_sent is None:
        return None
    return WindowComparison(None if sim.chunk_frames_sent is None else [int(n) for n in sim.chunk_frames_sent],
                            None if real.chunk_frames_sent is None else [int(n) for n in real.chunk_frames_sent])


@dataclass
class RequestComparison:
    key: RequestKey
    values: dict[str, Value]
    same_codes: bool  # identical codec token streams
    same_schedule: bool = False  # identical (P, c, n) span sequences (``RequestRecord.schedule``) on both sides
    schedule: str = "unknown"  # "same", "differs", or "unknown" (a side without spans)
    first_code_difference: int | None = None  # index of the first codec token that differs (None: the same)
    said: tuple[str, str] | None = None  # what each side's codes say (the family's ``decode``), where they differ
    windows: WindowComparison | None = None  # the Code2Wav windows (None: neither side has any)
    overlap: Value = Value(None, None)  # Talker overlap (steps shared with another request), None: no spans

    @property
    def windows_differ(self) -> bool:
        return self.windows is not None and self.windows.status == "differ"

    def difference_line(self) -> str:
        """Why this request differs, in one line: its spans, then where its codec streams part."""
        spans = {"same": "identical spans", "differs": "the spans differ (the schedule: docs/fidelity.md)",
                 "unknown": "spans unknown"}[self.schedule]
        if self.same_codes:
            return f"{_key_text(self.key)}: {spans}; identical codec tokens" + self._windows_text()
        text = f"{_key_text(self.key)}: {spans}; codec tokens differ from token {self.first_code_difference}"
        if self.schedule == "same":
            text += " on identical spans (the Talker or the runner differs)"
        if self.said is not None:
            text += f"; sim says {self.said[0]!r}, real says {self.said[1]!r}"
        return text + self._windows_text()

    def _windows_text(self) -> str:
        """The Code2Wav windows' part of the line, only where they differ (else the line is as before)."""
        w = self.windows
        if w is None or w.status != "differ" or w.first_difference is None:
            return ""
        i = w.first_difference

        def size(frames: Sequence[int] | None) -> str:
            return f"{frames[i]} frames" if frames is not None and i < len(frames) else "none"

        return f"; Code2Wav windows differ from window {i} (sim {size(w.sim)}, real {size(w.real)})"


@dataclass
class CellComparison:
    key: CellKey
    requests: int  # requests present in both runs
    values: dict[str, Value]
    overlap: Value = Value(None, None)  # mean Talker overlap per request (None: a side without spans)


@dataclass
class Fidelity:
    sim: Side
    real: Side
    cells: list[CellComparison]
    requests: list[RequestComparison]
    only_sim: list[RequestKey]
    only_real: list[RequestKey]
    notes: list[str]

    @property
    def differing(self) -> list[RequestComparison]:
        """Requests whose codec tokens, Code2Wav windows (where both sides have them) or any metric differ."""
        return [r for r in self.requests
                if not r.same_codes or r.windows_differ or not all(v.same for v in r.values.values())]

    @property
    def has_windows(self) -> bool:
        """Some matched request has Code2Wav windows on a side: the table and the JSON say them."""
        return any(r.windows is not None for r in self.requests)


def span_schedules(spans: Iterable[Mapping[str, Any]]) -> dict[RequestKey, str]:
    """Each request's schedule digest (``records.schedule_digest``: its (P, c, n) spans in order) from a
    run's spans (``SpanTable.raw``: dicts in file order); a run's records carry it only when the run
    recorded latency, its spans always."""
    import hashlib

    parts: dict[RequestKey, list[str]] = {}
    for d in spans:
        key = (d["arm"], d["deploy"], d["repeat"], d["request"])
        parts.setdefault(key, []).append(f"{d['P']}:{d['c']}:{d['n']}")
    return {k: hashlib.sha256(",".join(v).encode()).hexdigest()[:16] for k, v in parts.items()}


def talker_overlap(spans: Iterable[Mapping[str, Any]]) -> dict[RequestKey, int]:
    """Each request's Talker overlap: how many runner steps it ran in (a span of it in the step) together with
    at least one other request of its cell. From a run's spans (``SpanTable.raw``), on either backend: the
    sim's steps are its step loop's, the real server's the trace's inferred runner steps."""
    steps: dict[tuple[str, str, int, int], set[str]] = {}
    for d in spans:
        steps.setdefault((d["arm"], d["deploy"], d["repeat"], d["step"]), set()).add(d["request"])
    out: dict[RequestKey, int] = {}
    for (arm, deploy, repeat, _step), requests in steps.items():
        for request in requests:
            key = (arm, deploy, repeat, request)
            out[key] = out.get(key, 0) + (len(requests) > 1)
    return out


def _schedule(side: Side, rec: RequestRecord) -> str | None:
    return side.schedules.get(rec.key) or rec.schedule


def _events(side: Side, rec: RequestRecord) -> EventCounts:
    return side.events.get(rec.key, rec.events)


def _by_key(side: Side, name: str) -> dict[RequestKey, RequestRecord]:
    out: dict[RequestKey, RequestRecord] = {}
    for rec in side.records:
        if rec.key in out:
            raise UserError(f"{name} run {side.label}: request {_key_text(rec.key)} is recorded twice")
        out[rec.key] = rec
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _mean_of(values: list[int | None]) -> float | None:
    """The mean of a cell's per-request overlaps; None when any request has none (that side has no spans)."""
    return None if not values or any(v is None for v in values) else round(sum(values) / len(values), 2)


def _cell_value(metric: Metric, values: list[float | int | None]) -> float | int | None:
    present = [v for v in values if v is not None]
    if metric.mean:
        return _mean([float(v) for v in present])
    return sum(present) if present else (None if values else 0)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first codec token where two streams differ (a stream that stops early differs at its
    end); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if int(x) != int(y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(sim: Side, real: Side, decode: Callable[[list[int]], str] | None = None) -> Fidelity:
    """Matches the two runs' requests by (arm, deploy, repeat, prompt id); a ``UserError`` when they
    share no arm x deploy x repeat cell (nothing to compare). ``decode``: the family's speaking rules'
    read-back (codes -> transcript), applied to both sides' codes where they differ (None: not shown)."""
    a, b = _by_key(sim, "sim"), _by_key(real, "real")
    cells_a = {k[:3] for k in a}
    cells_b = {k[:3] for k in b}
    common_cells = cells_a & cells_b
    if not common_cells:
        raise UserError(f"no common cells: the sim run {sim.label} has {_cells_text(cells_a)}, the real run "
                        f"{real.label} has {_cells_text(cells_b)} (compare runs of the same arms, deploys and repeats)")
    order = _cell_order([k for k in list(a) + list(b) if k[:3] in common_cells])
    matched = sorted((k for k in a if k in b), key=lambda k: (order[k[:3]], k[3]))
    requests = []
    for key in matched:
        ra, rb = a[key], b[key]
        ea, eb = _events(sim, ra), _events(real, rb)
        values = {m.key: Value(m.value(ra, ea), m.value(rb, eb)) for m in METRICS}
        sa, sb = _schedule(sim, ra), _schedule(real, rb)
        differ_at = first_difference(ra.codec_tokens, rb.codec_tokens)
        said = None
        if differ_at is not None and decode is not None:
            said = (decode(list(ra.codec_tokens)), decode(list(rb.codec_tokens)))
        schedule = "unknown" if sa is None or sb is None else "same" if sa == sb else "differs"
        requests.append(RequestComparison(key, values, differ_at is None, sa is not None and sa == sb, schedule,
                                          differ_at, said, compare_windows(ra, rb),
                                          Value(sim.overlap.get(key), real.overlap.get(key))))
    cells = []
    for cell in sorted(common_cells, key=lambda c: order[c]):
        reqs = [r for r in requests if r.key[:3] == cell]
        values = {m.key: Value(_cell_value(m, [r.values[m.key].sim for r in reqs]),
                               _cell_value(m, [r.values[m.key].real for r in reqs])) for m in METRICS}
        overlap = Value(*(_mean_of([getattr(r.overlap, side) for r in reqs]) for side in ("sim", "real")))
        cells.append(CellComparison(cell, len(reqs), values, overlap))
    only_sim = sorted(k for k in a if k not in b)
    only_real = sorted(k for k in b if k not in a)
    notes = _notes(sim, real, a, b, matched)
    notes += _same_schedule_notes(requests)
    return Fidelity(sim, real, cells, requests, only_sim, only_real, notes)


MISALIGNED_KEYS = ("misaligned_text", "misaligned_end")  # the METRICS keys of the two regions


def _same_schedule_notes(requests: list[RequestComparison]) -> list[str]:
    """On identical spans both sides count misaligned positions the same way (row identities: the sim's
    registry, the real worker's identity codes, issue 32), so a difference there is named."""
    same = [r for r in requests if r.same_schedule]
    if not same:
        return []
    differ = [r for r in same if any(not r.values[k].same for k in MISALIGNED_KEYS)]
    note = f"{len(same)} matched request(s) ran identical spans on both sides"
    if not differ:
        return [note + "; their misaligned counts are equal"]
    interleaved = [r for r in differ if r.overlap.sim is not None and r.overlap.real is not None
                   and not r.overlap.same]
    rest = [r for r in differ if r not in interleaved]
    causes = []
    if interleaved:  # the cause found: the same spans of their own, other neighbours in the Talker's steps
        causes.append(f"on {len(interleaved)}: {_keys_text([r.key for r in interleaved])}, which shared their steps "
                      "with other requests differently (Talker overlap " + ", ".join(
                          f"sim {r.overlap.sim} / real {r.overlap.real}" for r in interleaved[:4])
                      + (", ..." if len(interleaved) > 4 else "") + "): state an arm keeps across requests sees "
                      "other rows on each side")
    if rest:
        same_overlap = " with the same Talker overlap" if all(r.overlap.sim is not None and r.overlap.same
                                                               for r in rest) else ""
        causes.append(f"on {len(rest)}: {_keys_text([r.key for r in rest])}{same_overlap} (rows compared by value "
                      "on the real side: a checkpoint without identity codes, docs/fidelity.md)")
    return [note + "; their misaligned counts differ " + "; ".join(causes)]


def _notes(sim: Side, real: Side, a: dict[RequestKey, RequestRecord], b: dict[RequestKey, RequestRecord],
           matched: list[RequestKey]) -> list[str]:
    notes = []
    if not is_simulated(sim.backend):
        notes.append(f"the first run ({sim.label}) is not a sim run (backend {sim.backend})")
    if is_simulated(sim.backend) and sim.talker != "speaking" and not is_simulated(real.backend):
        notes.append(f"the sim run used the {sim.talker} Talker: only --sim-talker speaking runs the rules of the "
                     "real server's speaking tiny model, so codec tokens and oracle WER cannot match")
    errors = [k for k in matched if a[k].error is not None or b[k].error is not None]
    if errors:
        notes.append(f"{len(errors)} matched request(s) failed in one run or both: {_keys_text(errors)}")
    for name, side, recs in (("sim", sim, a), ("real", real, b)):
        missing = [k for k in matched if recs[k].oracle_wer is None and not recs[k].not_measurable
                   and recs[k].error is None]
        if missing:
            notes.append(f"the {name} run {side.label} has no oracle WER for {len(missing)} request(s) (a Talker "
                         "that is not the speaking model has no oracle transcript on the real backend)")
    return notes


def _cell_order(keys: list[RequestKey]) -> dict[CellKey, int]:
    """Cells in first-seen order of arm, then deploy, then repeat (the runs' own table order)."""
    arms: list[str] = []
    deploys: list[str] = []
    for arm, deploy, _, _ in keys:
        if arm not in arms:
            arms.append(arm)
        if deploy not in deploys:
            deploys.append(deploy)
    cells = sorted({k[:3] for k in keys}, key=lambda c: (arms.index(c[0]), deploys.index(c[1]), c[2]))
    return {c: i for i, c in enumerate(cells)}


def _key_text(key: tuple) -> str:
    return "/".join(str(p) for p in key)


def _keys_text(keys: Sequence[tuple], limit: int = 8) -> str:
    shown = ", ".join(_key_text(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _cells_text(cells: set[CellKey]) -> str:
    if not cells:
        return "no request"
    return ", ".join(f"{arm} x {deploy} (run {r})" for arm, deploy, r in sorted(cells))


# --------------------------------------------------------------------------- rendering


def fmt_value(metric: Metric | str, value: float | int | None) -> str:
    key = metric.key if isinstance(metric, Metric) else metric
    if value is None:
        return "-"
    if key == "oracle_wer":
        return f"{value:.3f}"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.1f}"
    return str(int(value))


def _fmt_overlap(value: float | None) -> str:
    return NOT_MEASURED if value is None else f"{value:g}"


def fmt_ratio(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.2f}"


def _table(header: list[str], rows: list[list[str]], right_from: int) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i >= right_from else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _cell_label(key: CellKey, repeats: bool) -> str:
    arm, deploy, repeat = key
    return f"{arm} x {deploy}" + (f" (run {repeat})" if repeats else "")


def render_text(fid: Fidelity) -> str:
    repeats = len({c.key[2] for c in fid.cells}) > 1
    windows = fid.has_windows
    same = "same codec tokens, Code2Wav windows and every metric" if windows else "same codec tokens and every metric"
    out = [f"sim:  {fid.sim.describe()}", f"real: {fid.real.describe()}",
           f"{len(fid.requests)} requests in both runs, {len(fid.requests) - len(fid.differing)} identical "
           f"({same}); ratio = sim / real (two zeros: 1.00)"]
    for note in fid.notes:
        out.append(f"note: {note}")
    for cell in fid.cells:
        out += ["", f"{_cell_label(cell.key, repeats)}: {cell.requests} request(s) in both runs"]
        rows = []
        for m in METRICS:
            v = cell.values[m.key]
            rows.append([m.label + (" (mean)" if m.mean else ""), fmt_value(m, v.sim), fmt_value(m, v.real),
                         fmt_ratio(v.ratio)])
        out += ["  " + line for line in _table(["Metric", "Sim", "Real", "Sim/Real"], rows, 1)]
        if cell.overlap.sim is not None or cell.overlap.real is not None:
            out.append(f"  Talker overlap (steps shared with another request, mean per request): "
                       f"sim {_fmt_overlap(cell.overlap.sim)}, real {_fmt_overlap(cell.overlap.real)}")
    out += ["", "Per request:"]
    # the windows' column only where some request has windows: a run without them prints what it did before
    header = ["Arm", "Deploy", "Run", "Prompt", "Same codes", *(["Same windows"] if windows else []),
              "Metric", "Sim", "Real", "Sim/Real"]
    rows = []
    for r in fid.requests:
        arm, deploy, repeat, prompt = r.key
        for i, m in enumerate(METRICS):
            v = r.values[m.key]
            ident = [arm, deploy, str(repeat), prompt, "yes" if r.same_codes else "no"]
            if windows:
                ident.append(r.windows.cell_text() if r.windows is not None else NOT_MEASURED)
            if i:
                ident = [""] * len(ident)
            rows.append(ident + [m.label + ("" if v.same else " *"), fmt_value(m, v.sim), fmt_value(m, v.real),
                                 fmt_ratio(v.ratio)])
    out += _table(header, rows, len(header) - 3)
    out.append("(* sim and real differ)")
    apart = [r for r in fid.requests if r in fid.differing or r.schedule == "differs"]
    if apart:  # every request whose codes, counts or spans differ, with its spans and where its codes part
        out += ["", f"Where they differ, per request ({len(apart)}):"]
        out += [f"  {r.difference_line()}" for r in apart]
    for name, side, keys in (("sim", fid.sim, fid.only_sim), ("real", fid.real, fid.only_real)):
        if keys:
            out += ["", f"Only in the {name} run {side.label} ({len(keys)}): "
                        + ", ".join(_key_text(k) for k in keys)]
    if not fid.only_sim and not fid.only_real:
        out += ["", "Every request is in both runs."]
    return "\n".join(out) + "\n"


def _values_json(values: dict[str, Value]) -> dict[str, Any]:
    return {k: {"sim": v.sim, "real": v.real, "ratio": v.ratio} for k, v in values.items()}


def _windows_json(w: WindowComparison | None) -> dict[str, Any]:
    """A request's windows in the JSON (only in a comparison where some request has them): ``windows`` (same,
    differ, not measured), ``first_window_difference`` and each side's ``chunk_frames_sent``."""
    w = w or WindowComparison(None, None)
    return {"windows": w.status, "first_window_difference": w.first_difference,
            "chunk_frames_sent": {"sim": w.sim, "real": w.real}}


def _overlap_json(v: Value) -> dict[str, Any]:
    return {"sim": v.sim, "real": v.real}


def as_json(fid: Fidelity) -> dict[str, Any]:
    def side(s: Side) -> dict[str, Any]:
        return {"run_id": s.label, "backend": s.backend, "sim_talker": s.talker}

    def key(k: RequestKey) -> dict[str, Any]:
        return {"arm": k[0], "deploy": k[1], "repeat": k[2], "prompt_id": k[3]}

    return {
        "sim": side(fid.sim),
        "real": side(fid.real),
        "metrics": [{"key": m.key, "label": m.label, "cell_value": "mean" if m.mean else "sum"} for m in METRICS],
        "cells": [{"arm": c.key[0], "deploy": c.key[1], "repeat": c.key[2], "requests": c.requests,
                   "metrics": _values_json(c.values), "talker_overlap": _overlap_json(c.overlap)} for c in fid.cells],
        "requests": [{**key(r.key), "same_codec_tokens": r.same_codes, "same_schedule": r.same_schedule,
                      "schedule": r.schedule, "first_code_difference": r.first_code_difference,
                      "said": None if r.said is None else {"sim": r.said[0], "real": r.said[1]},
                      **(_windows_json(r.windows) if fid.has_windows else {}),
                      "metrics": _values_json(r.values), "talker_overlap": _overlap_json(r.overlap)}
                     for r in fid.requests],
        "only_sim": [key(k) for k in fid.only_sim],
        "only_real": [key(k) for k in fid.only_real],
        "identical_requests": len(fid.requests) - len(fid.differing),
        "notes": list(fid.notes),
    }
