"""Tables for a run directory: the seed's table first, then the extended and per-request tables.

Everything here is pure table building (pandas) over a loaded ``Run``, except the entry points
``load_run`` (reads), ``write_reports`` (writes every format) and ``terminal_table`` (reads and
renders), which ``omni-stress run`` and ``omni-stress report`` call. The gate reuses
``summarize_cells`` so the numbers it judges are the numbers the tables show.

Event counts come from ``spans.jsonl`` whenever the cell has spans (the definitive per-call
trace), else from the per-request ``events`` the backend summed; the WER a table shows is
``RequestRecord.score`` (Whisper's when present, else the oracle transcript's), and the source is
always labelled.

Speed: the default matrix writes ~65k spans, and one ``SpanRecord`` object per span cost more than
the rest of the report. ``load_run`` therefore parses ``spans.jsonl`` in one ``json.loads`` call
into plain columns (``SpanTable``) and counts events with numpy (``harness.contract.classify_spans``,
the same predicates as ``classify_span``, checked against it in the tests); ``omni-stress
run`` loads the run once and hands it to both the terminal table and ``write_reports``.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.contract import classify_spans
from harness.errors import UserError
from harness.records import (
    MANIFEST_FILE,
    REQUESTS_FILE,
    SPANS_FILE,
    EventCounts,
    RequestRecord,
    SpanRecord,
    iter_jsonl_numbered,
    read_manifest,
    read_requests,
    span_from_dict,
)

WER_THRESHOLD = 0.5
NA = "n/a"
NONE = "\u2013"  # a number that does not apply to the cell (accepted tokens/step without spec decode)

CellKey = tuple[str, str, int]  # (arm, deploy, repeat)

SEED_COLUMNS = [
    "Arm",
    "WER (mean)",
    f"Requests with WER > {WER_THRESHOLD}",
    "Non-zero-offset prefill chunks",
    "Replays crossing the prompt boundary",
]

WER_SOURCE_TEXT = {
    "whisper": "Whisper",
    "oracle": "oracle transcript",
    "mixed": "mixed (Whisper where transcribed, else oracle transcript)",
    "none": "none (no request scored)",
}


# --------------------------------------------------------------------------- loading


SpanKey = tuple[str, str, int, str]  # (arm, deploy, repeat, request)

_SPAN_STR_FIELDS = ("arm", "deploy", "request")
_SPAN_INT_FIELDS = ("repeat", "step", "P", "c", "n", "rows")
class SpanTable:
    """``spans.jsonl`` as columns: what the report reads of 65k spans, without 65k objects.

    Iterating yields ``SpanRecord`` objects (built on demand, for the few spans a plot draws or for
    callers that want records); ``group_events`` is what the tables count.
    """

    def __init__(self, raw: list[dict[str, Any]] | None = None, path: Path | None = None,
                 lines: list[int] | None = None) -> None:
        """``raw``: one dict per span as in spans.jsonl; ``lines``: their line numbers (for errors)."""
        self.raw = raw or []
        self.path = path
        where = str(path) if path is not None else SPANS_FILE
        line_of = (lambda i: lines[i]) if lines is not None else (lambda i: i + 1)
        cols: dict[str, Any] = {}
        for i, rec in enumerate(self.raw):
            if type(rec) is not dict:
                raise UserError(f"{where}: line {line_of(i)}: malformed record (expected a JSON object)")
        for name in _SPAN_STR_FIELDS + _SPAN_INT_FIELDS:
            values = [rec.get(name) for rec in self.raw]
            kind = str if name in _SPAN_STR_FIELDS else int
            bad = next((i for i, v in enumerate(values) if type(v) is not kind), None)
            if bad is not None:
                got = "missing" if name not in self.raw[bad] else f"got {values[bad]!r}"
                expected = "a string" if kind is str else "an integer"
                raise UserError(f"{where}: line {line_of(bad)}: malformed record ({name}: expected {expected}, {got})")
            cols[name] = values if kind is str else np.array(values, dtype=np.int64)
        misaligned = [rec.get("misaligned") for rec in self.raw]
        bad = next((i for i, v in enumerate(misaligned) if v is not None and type(v) is not int), None)
        if bad is not None:
            raise UserError(f"{where}: line {line_of(bad)}: malformed record "
                            f"(misaligned: expected an integer or null, got {misaligned[bad]!r})")
        cols["misaligned_known"] = np.array([v is not None for v in misaligned], dtype=bool)
        cols["misaligned"] = np.array([v or 0 for v in misaligned], dtype=np.int64)
        P, c, n = cols["P"], cols["c"], cols["n"]
        invalid = np.flatnonzero((P < 0) | (c < 0) | (n < 1))
        if invalid.size:
            i = int(invalid[0])
            raise UserError(f"{where}: line {line_of(i)}: invalid span P={P[i]} c={c[i]} n={n[i]}")
        self.columns = cols

    @classmethod
    def from_records(cls, spans: Iterable[SpanRecord]) -> SpanTable:
        return cls([asdict(s) for s in spans])

    def __len__(self) -> int:
        return len(self.raw)

    def __iter__(self) -> Iterator[SpanRecord]:
        return (span_from_dict(d) for d in self.raw)

    def records(self, indices: Iterable[int]) -> list[SpanRecord]:
        return [span_from_dict(self.raw[int(i)]) for i in indices]

    @cached_property
    def flags(self) -> dict[str, np.ndarray]:
        c = self.columns
        return classify_spans(c["P"], c["c"], c["n"], c["rows"])

    @cached_property
    def group_codes(self) -> tuple[list[SpanKey], np.ndarray]:
        """(keys, code of each span): one group per (arm, deploy, repeat, request), in first-seen order."""
        index: dict[SpanKey, int] = {}
        c = self.columns
        codes = [index.setdefault(k, len(index))
                 for k in zip(c["arm"], c["deploy"], c["repeat"].tolist(), c["request"])]
        return list(index), np.array(codes, dtype=np.int64)

    def group_sums(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-group sums of each column (bincount over the group codes)."""
        keys, codes = self.group_codes
        return {name: np.bincount(codes, weights=v, minlength=len(keys)).astype(np.int64)
                for name, v in values.items()}

    @cached_property
    def group_events(self) -> dict[SpanKey, tuple[EventCounts, bool]]:
        """{(arm, deploy, repeat, request): (EventCounts of its spans, any span's misaligned known)}.

        Equals ``harness.contract.count_events`` over each group's spans (tested).
        """
        keys, _ = self.group_codes
        f = self.flags
        sums = self.group_sums({
            "talker_calls": np.ones(len(self), dtype=np.int64),
            "prefill_calls": f["is_prefill"],
            "nonzero_offset_chunks": f["nonzero_offset"],
            "cross_boundary_replays": f["cross_boundary"],
            "multi_position_decode_spans": f["multi_decode"],
            "one_token_tails": f["one_token_tail"],
            "row_count_mismatches": f["row_mismatch"],
            "prefill_row_count_mismatches": f["row_mismatch"] & f["is_prefill"],
            "misaligned_positions": self.columns["misaligned"],
            "misaligned_known": self.columns["misaligned_known"],
        })
        out = {}
        for g, key in enumerate(keys):
            counts = EventCounts(**{name: int(v[g]) for name, v in sums.items() if name != "misaligned_known"})
            out[key] = (counts, bool(sums["misaligned_known"][g]))
        return out


@dataclass
class Run:
    """A run directory's records, read once (``spans`` as columns, see ``SpanTable``)."""

    run_dir: Path
    manifest: dict[str, Any]
    requests: list[RequestRecord]
    spans: SpanTable = field(default_factory=SpanTable)

    def __post_init__(self) -> None:
        if not isinstance(self.spans, SpanTable):  # a list of SpanRecord, for a Run built by hand
            self.spans = SpanTable.from_records(self.spans)

    @property
    def run_id(self) -> str:
        return str(self.manifest.get("run_id") or self.run_dir.name)


def load_run(run_dir: Path) -> Run:
    """Reads manifest, requests and spans; any problem is one UserError naming the file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: run directory not found")
    if not (run_dir / MANIFEST_FILE).is_file():
        raise UserError(f"{run_dir}: no {MANIFEST_FILE} (not a run directory?)")
    try:
        manifest = read_manifest(run_dir)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{run_dir / MANIFEST_FILE}: not valid JSON ({exc})") from None
    _validate_manifest(manifest, run_dir / MANIFEST_FILE)
    if not (run_dir / REQUESTS_FILE).is_file():
        raise UserError(f"{run_dir}: no {REQUESTS_FILE} (the run recorded no request)")
    requests = _read_records(run_dir, REQUESTS_FILE, read_requests)
    raw, lines = _read_jsonl_fast(run_dir / SPANS_FILE)
    return Run(run_dir=run_dir, manifest=manifest, requests=requests,
               spans=SpanTable(raw, path=run_dir / SPANS_FILE, lines=lines))


def _read_jsonl_fast(path: Path) -> tuple[list[Any], list[int] | None]:
    """(objects, their line numbers or None when line i+1 holds object i); same result as
    ``records.iter_jsonl`` (torn last line dropped, a broken line in the middle an error).

    The whole file is parsed as one JSON array (one ``json.loads`` call instead of 65k); any
    doubt (a torn tail, a blank line, a line that is not exactly one value) falls back to the
    line-by-line reader, which also names the broken line.
    """
    if not path.exists():
        return [], None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc})") from None
    body = text[:-1] if text.endswith("\n") else text
    if not body.strip():
        return [], None
    try:
        data = json.loads("[" + body.replace("\n", ",") + "]")
        if isinstance(data, list) and len(data) == body.count("\n") + 1:
            return data, None
    except json.JSONDecodeError:
        pass
    objects, lines = [], []
    try:
        for number, obj in iter_jsonl_numbered(path):
            objects.append(obj)
            lines.append(number)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return objects, lines


def _read_records(run_dir: Path, name: str, reader: Any) -> list[Any]:
    try:
        return reader(run_dir)
    except ValueError as exc:  # iter_jsonl: a broken line that is not the torn tail
        raise UserError(str(exc)) from None
    except TypeError as exc:  # a record missing a required field
        raise UserError(f"{run_dir / name}: malformed record ({exc})") from None


def _validate_manifest(manifest: Any, path: Path) -> None:
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: expected a JSON object")
    cells = manifest.get("cells")
    if not isinstance(cells, list):
        raise UserError(f"{path}: cells: expected a list of {{arm, deploy, repeat}}")
    for i, cell in enumerate(cells):
        if not isinstance(cell, dict) or not all(k in cell for k in ("arm", "deploy", "repeat")):
            raise UserError(f"{path}: cells[{i}]: expected an object with arm, deploy and repeat")
        if isinstance(cell["repeat"], bool) or not isinstance(cell["repeat"], int):
            raise UserError(f"{path}: cells[{i}].repeat: expected an integer, got {cell['repeat']!r}")


# --------------------------------------------------------------------------- cells


@dataclass
class CellSummary:
    """Everything the tables and the gate say about one arm x deploy x repeat."""

    arm: str
    deploy: str
    repeat: int
    requests: int
    scores: list[float]  # RequestRecord.score of each scored request
    oracle_scores: list[float]
    events: EventCounts
    event_source: str  # "spans" or "requests"
    misaligned_known: bool
    preemptions: int
    errors: int
    wall_s: float
    wer_source: str  # key of WER_SOURCE_TEXT
    run_number: int  # the repeat as the tables show it ("run 1")
    accepted: list[float] = field(default_factory=list)  # accepted_tokens_per_step of each request that has it

    @property
    def accepted_tokens_per_step(self) -> float | None:
        """Plain mean over the cell's requests that report it (speculative decoding); None without."""
        return statistics.fmean(self.accepted) if self.accepted else None

    @property
    def key(self) -> CellKey:
        return (self.arm, self.deploy, self.repeat)

    @property
    def scored(self) -> int:
        return len(self.scores)

    @property
    def mean_wer(self) -> float | None:
        return statistics.fmean(self.scores) if self.scores else None

    @property
    def median_wer(self) -> float | None:
        return statistics.median(self.scores) if self.scores else None

    @property
    def oracle_mean_wer(self) -> float | None:
        return statistics.fmean(self.oracle_scores) if self.oracle_scores else None

    def requests_over(self, threshold: float = WER_THRESHOLD) -> int:
        return sum(s > threshold for s in self.scores)


def _run_offset(keys: Iterable[CellKey]) -> int:
    """Repeats are shown 1-based like the seed ("run 1 / run 2") whether stored from 0 or 1."""
    repeats = [k[2] for k in keys]
    return 1 if repeats and min(repeats) == 0 else 0


def cell_order(run: Run) -> list[CellKey]:
    """Arms in manifest order, then deploys in manifest order (reference before stress), then repeat.

    Cells that only the records name (a manifest written before a resumed run added cells) follow.
    """
    keys: list[CellKey] = []
    for cell in run.manifest.get("cells", []):
        keys.append((str(cell["arm"]), str(cell["deploy"]), int(cell["repeat"])))
    for rec in run.requests:
        keys.append((rec.arm, rec.deploy, rec.repeat))
    arm_rank: dict[str, int] = {}
    deploy_rank: dict[str, int] = {}
    for arm, deploy, _ in keys:
        arm_rank.setdefault(arm, len(arm_rank))
        deploy_rank.setdefault(deploy, len(deploy_rank))
    unique = list(dict.fromkeys(keys))
    return sorted(unique, key=lambda k: (arm_rank[k[0]], deploy_rank[k[1]], k[2]))


def request_events(run: Run) -> dict[tuple[str, str, int, str], EventCounts]:
    """Per-request events: counted from spans where the request has spans, else the record's."""
    groups = run.spans.group_events
    out: dict[tuple[str, str, int, str], EventCounts] = {}
    for rec in run.requests:
        counted = groups.get(rec.key)
        out[rec.key] = counted[0] if counted else rec.events
    return out


def summarize_cells(run: Run) -> list[CellSummary]:
    """One CellSummary per cell, in table order (see ``cell_order``)."""
    order = cell_order(run)
    offset = _run_offset(order)
    by_cell: dict[CellKey, list[RequestRecord]] = {k: [] for k in order}
    for rec in run.requests:
        by_cell[(rec.arm, rec.deploy, rec.repeat)].append(rec)
    span_cells: dict[CellKey, tuple[EventCounts, bool]] = {}  # every span of the cell, whether or not
    for (arm, deploy, repeat, _), (counts, known) in run.spans.group_events.items():  # its request has a record
        total, any_known = span_cells.get((arm, deploy, repeat), (EventCounts(), False))
        total.add(counts)
        span_cells[(arm, deploy, repeat)] = (total, any_known or known)
    manifest_wall = {
        (str(c["arm"]), str(c["deploy"]), int(c["repeat"])): c.get("wall_s") for c in run.manifest.get("cells", [])
    }

    out = []
    for key in order:
        recs = by_cell[key]
        if key in span_cells:
            events, misaligned_known = span_cells[key]
            source = "spans"
        else:
            events, source = EventCounts(), "requests"
            for rec in recs:
                events.add(rec.events)
            misaligned_known = any(rec.backend == "sim" for rec in recs)
        scores = [r.score for r in recs if r.score is not None]
        whisper = sum(r.wer is not None for r in recs)
        oracle_only = sum(r.wer is None and r.oracle_wer is not None for r in recs)
        wer_source = ("whisper" if whisper and not oracle_only else "oracle" if oracle_only and not whisper
                      else "mixed" if whisper else "none")
        wall = manifest_wall.get(key)
        if not isinstance(wall, (int, float)) or isinstance(wall, bool):
            wall = sum(r.wall_s for r in recs)
        out.append(CellSummary(
            arm=key[0], deploy=key[1], repeat=key[2], requests=len(recs),
            scores=[float(s) for s in scores],
            oracle_scores=[float(r.oracle_wer) for r in recs if r.oracle_wer is not None],
            events=events, event_source=source, misaligned_known=misaligned_known,
            preemptions=sum(r.preemptions for r in recs),
            errors=sum(r.error is not None for r in recs),
            wall_s=float(wall), wer_source=wer_source, run_number=key[2] + offset,
            accepted=[float(r.accepted_tokens_per_step) for r in recs if r.accepted_tokens_per_step is not None],
        ))
    return out


def group_rows(cells: list[CellSummary]) -> list[list[CellSummary]]:
    """Cells grouped per arm x deploy (the seed's rows), repeats in order."""
    groups: dict[tuple[str, str], list[CellSummary]] = {}
    for cell in cells:
        groups.setdefault((cell.arm, cell.deploy), []).append(cell)
    return list(groups.values())


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


def wer_source_note(run: Run, cells: list[CellSummary]) -> str:
    """The line under the seed table saying where the WER came from."""
    source = wer_source(cells)
    note = f"WER source: {WER_SOURCE_TEXT[source]}"
    asr = run.manifest.get("asr")
    if source in ("whisper", "mixed") and asr:
        note += f" ({_describe(asr)})"
    if source == "oracle":
        note += " (the sim's spoken word sequence before TTS; no ASR ran)"
    if source == "mixed":
        per_cell = ", ".join(f"{c.arm}/{c.deploy}/run {c.run_number}: {c.wer_source}" for c in cells)
        note += f"; per cell: {per_cell}"
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
            SEED_COLUMNS[3]: _join(str(c.events.nonzero_offset_chunks) for c in group),
            SEED_COLUMNS[4]: _join(str(c.events.cross_boundary_replays) for c in group),
        })
    return pd.DataFrame(rows, columns=SEED_COLUMNS, dtype=object)


EXTENDED_COLUMNS = [
    "Arm", "Deploy", "Run", "Requests", "WER source", "WER (mean)", "WER (median)", "Oracle WER (mean)",
    f"Requests with WER > {WER_THRESHOLD}", "Non-zero-offset chunks", "Cross-boundary replays",
    "Multi-position decode spans", "Accepted tokens/step", "One-token tails", "Row-count mismatches / prefill calls",
    "Misaligned positions", "Preemptions", "Errors", "Wall time (s)",
]


def extended_table(cells: list[CellSummary]) -> pd.DataFrame:
    """One row per cell (repeats separate): the seed's numbers plus everything that explains them."""
    rows = []
    for c in cells:
        ev = c.events
        rows.append([
            c.arm, c.deploy, str(c.run_number), str(c.requests), WER_SOURCE_TEXT[c.wer_source].split(" (")[0],
            fmt_wer(c.mean_wer), fmt_wer(c.median_wer), fmt_wer(c.oracle_mean_wer),
            fmt_ratio(c.requests_over(), c.scored), str(ev.nonzero_offset_chunks), str(ev.cross_boundary_replays),
            str(ev.multi_position_decode_spans), fmt_accepted(c.accepted_tokens_per_step), str(ev.one_token_tails),
            fmt_ratio(ev.prefill_row_count_mismatches, ev.prefill_calls),
            str(ev.misaligned_positions) if c.misaligned_known else NA,
            str(c.preemptions), str(c.errors), f"{c.wall_s:.1f}",
        ])
    return pd.DataFrame(rows, columns=EXTENDED_COLUMNS, dtype=object)


def cells_frame(cells: list[CellSummary]) -> pd.DataFrame:
    """Numbers, not strings: one row per cell, for summary.csv and summary.json."""
    rows = []
    for c in cells:
        row: dict[str, Any] = {
            "arm": c.arm, "deploy": c.deploy, "repeat": c.repeat, "run": c.run_number,
            "requests": c.requests, "scored": c.scored, "wer_source": c.wer_source,
            "wer_mean": c.mean_wer, "wer_median": c.median_wer, "oracle_wer_mean": c.oracle_mean_wer,
            "requests_over_threshold": c.requests_over(), "wer_threshold": WER_THRESHOLD,
        }
        row.update({k: v for k, v in vars(c.events).items()})
        if not c.misaligned_known:
            row["misaligned_positions"] = None
        accepted = c.accepted_tokens_per_step
        row["accepted_tokens_per_step"] = None if accepted is None else round(accepted, 4)
        row.update({"event_source": c.event_source, "preemptions": c.preemptions, "errors": c.errors,
                    "wall_s": round(c.wall_s, 3)})
        rows.append(row)
    return pd.DataFrame(rows)


REQUEST_COLUMNS = [
    "Arm", "Deploy", "Run", "Prompt", "WER", "Oracle WER", "Codec tokens", "Finish", "Preemptions",
    "Non-zero-offset chunks", "Cross-boundary replays", "Multi-position decode spans", "Accepted tokens/step",
    "Row-count mismatches / prefill calls", "Misaligned", "Error", "Transcript",
]


def requests_table(run: Run, cells: list[CellSummary], max_text: int = 80) -> pd.DataFrame:
    """Per-request rows in table order, so a reader can find the request a plot points at."""
    events = request_events(run)
    rank = {c.key: i for i, c in enumerate(cells)}
    run_number = {c.key: c.run_number for c in cells}
    rows = []
    for rec in sorted(run.requests, key=lambda r: (rank[(r.arm, r.deploy, r.repeat)], r.prompt_id)):
        ev = events[rec.key]
        cell = (rec.arm, rec.deploy, rec.repeat)
        text = rec.transcript if rec.transcript is not None else rec.oracle_transcript
        rows.append([
            rec.arm, rec.deploy, str(run_number[cell]), rec.prompt_id, fmt_wer(rec.score), fmt_wer(rec.oracle_wer),
            str(rec.num_codec_tokens), rec.finish_reason or NA, str(rec.preemptions),
            str(ev.nonzero_offset_chunks), str(ev.cross_boundary_replays), str(ev.multi_position_decode_spans),
            fmt_accepted(rec.accepted_tokens_per_step), fmt_ratio(ev.prefill_row_count_mismatches, ev.prefill_calls),
            str(ev.misaligned_positions) if rec.backend == "sim" else NA,
            _shorten(rec.error or "", max_text), _shorten(text or "", max_text),
        ])
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS, dtype=object)


def _shorten(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


COMPARE_NOTE = (f"WER = mean WER; WER>{WER_THRESHOLD} = requests over it; chunks = non-zero-offset prefill chunks; "
                "replays = replays crossing the prompt boundary; \u0394 = B - A of the means over runs.")


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
        ]
        for value, text, wer in getters:
            mean_a = _mean([v for v in (value(c) for c in a) if v is not None])
            mean_b = _mean([v for v in (value(c) for c in b) if v is not None])
            row += [text(a) if a else NA, text(b) if b else NA, _fmt_delta(mean_a, mean_b, wer)]
        rows.append(row)
    columns = ["Arm"]
    for name in ("WER", f"WER>{WER_THRESHOLD}", "Chunks", "Replays"):
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


def run_header(run: Run) -> list[str]:
    m = run.manifest
    lines = [f"Run {run.run_id}: backend {_describe(m.get('backend', NA))}, ASR {_describe(m.get('asr') or 'none')}"]
    finished = m.get("finished")
    lines.append(f"Started {m.get('started') or NA}, " + (f"finished {finished}" if finished else "not finished"))
    return lines


def terminal_text(run: Run, cells: list[CellSummary], with_requests: bool = False) -> str:
    parts = run_header(run) + ["", render_text(seed_table(cells)), wer_source_note(run, cells), "",
                               render_text(extended_table(cells))]
    if with_requests:
        parts += ["", render_text(requests_table(run, cells))]
    return "\n".join(parts) + "\n"


def markdown_text(run: Run, cells: list[CellSummary], with_requests: bool = True) -> str:
    parts = [f"### omni-stress run `{run.run_id}`", "", render_markdown(seed_table(cells)), "",
             wer_source_note(run, cells), "", "<details><summary>Extended table</summary>", "",
             render_markdown(extended_table(cells)), "", "</details>"]
    if with_requests:
        parts += ["", "<details><summary>Per-request rows</summary>", "",
                  render_markdown(requests_table(run, cells)), "", "</details>"]
    parts += ["", "_" + "; ".join(run_header(run)) + "_"]
    return "\n".join(parts) + "\n"


def json_summary(run: Run, cells: list[CellSummary], full_requests: pd.DataFrame | None = None) -> dict[str, Any]:
    """summary.json; ``full_requests``: ``requests_table(run, cells, max_text=10_000)`` if already built."""
    if full_requests is None:
        full_requests = requests_table(run, cells, max_text=10_000)
    return {
        "run_id": run.run_id,
        "backend": run.manifest.get("backend"),
        "asr": run.manifest.get("asr"),
        "started": run.manifest.get("started"),
        "finished": run.manifest.get("finished"),
        "wer_source": wer_source(cells),
        "wer_threshold": WER_THRESHOLD,
        "seed_table": seed_table(cells).to_dict(orient="records"),
        "cells": _records(cells_frame(cells)),
        "requests": full_requests.to_dict(orient="records"),
    }


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
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:14px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}
th{background:#f2f2f2}
tr:nth-child(even) td{background:#fafafa}
.note{color:#555}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}
code{background:#f4f4f4;padding:1px 4px}
"""


def html_report(run: Run, cells: list[CellSummary], plots: dict[str, bytes]) -> str:
    """A self-contained page: tables as HTML, PNG plots inlined as base64 data URIs."""
    def table(df: pd.DataFrame, cls: str) -> str:
        return df.to_html(index=False, escape=True, classes=cls, border=0, na_rep=NA)

    parts = [
        "<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>omni-stress {html.escape(run.run_id)}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>omni-stress run <code>{html.escape(run.run_id)}</code></h1>",
        "".join(f"<p class=\"note\">{html.escape(line)}</p>" for line in run_header(run)),
        "<h2>Summary (the seed's table)</h2>", table(seed_table(cells), "seed"),
        f"<p class=\"note\">{html.escape(wer_source_note(run, cells))}</p>",
    ]
    titles = {"wer": "WER per request", "events": "Scheduler events per cell",
              "timeline": "Span timeline of one stressed request"}
    for name, png in plots.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<h2>{html.escape(titles.get(name, name))}</h2>")
        parts.append(f"<img alt=\"{html.escape(name)}\" src=\"data:image/png;base64,{data}\">")
    parts += ["<h2>Extended table</h2>", table(extended_table(cells), "extended"),
              "<h2>Per-request rows</h2>", table(requests_table(run, cells), "requests")]
    argv = run.manifest.get("argv")
    if argv:
        command = " ".join(argv) if isinstance(argv, list) else str(argv)
        parts.append(f"<p class=\"note\">Command: <code>{html.escape(command)}</code></p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------- entry points (I/O)


def _loaded(run: Run | Path, cells: list[CellSummary] | None) -> tuple[Run, list[CellSummary]]:
    run = run if isinstance(run, Run) else load_run(run)
    return run, cells if cells is not None else summarize_cells(run)


def terminal_table(run: Run | Path, cells: list[CellSummary] | None = None) -> str:
    """The seed table, its WER-source note and the extended table as aligned text.

    Takes a loaded ``Run`` (and its cells) to reuse them, or a run directory to read.
    """
    return terminal_text(*_loaded(run, cells))


def write_reports(run: Run | Path, cells: list[CellSummary] | None = None) -> dict[str, Path]:
    """Writes summary.csv, summary.md, summary.json, requests.csv, the plots and report.html.

    Takes a loaded ``Run`` (and its cells, as ``omni-stress run`` does after printing them) or a
    run directory. Returns {kind: path}. Plots are written under ``plots/`` and embedded in the HTML.
    """
    from harness import plots  # matplotlib is imported only when plots are drawn

    run, cells = _loaded(run, cells)
    run_dir = run.run_dir
    out: dict[str, Path] = {}

    full_requests = requests_table(run, cells, max_text=10_000)
    out["csv"] = run_dir / "summary.csv"
    cells_frame(cells).to_csv(out["csv"], index=False)
    out["requests_csv"] = run_dir / "requests.csv"
    full_requests.to_csv(out["requests_csv"], index=False)
    out["markdown"] = run_dir / "summary.md"
    out["markdown"].write_text(markdown_text(run, cells), encoding="utf-8")
    out["json"] = run_dir / "summary.json"
    out["json"].write_text(json.dumps(json_summary(run, cells, full_requests), indent=2) + "\n", encoding="utf-8")

    plot_dir = run_dir / "plots"
    plot_dir.mkdir(exist_ok=True)
    images = plots.render_all(run, cells)
    for name, png in images.items():
        path = plot_dir / f"{name}.png"
        path.write_bytes(png)
        out[f"plot_{name}"] = path
    out["html"] = run_dir / "report.html"
    out["html"].write_text(html_report(run, cells, images), encoding="utf-8")
    return out
