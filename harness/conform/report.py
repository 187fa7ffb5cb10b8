"""The conformance matrix: terminal text, JSON and a self-contained HTML page."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any

from harness.conform.check import ModelResult, columns
from harness.conform.models import CALIBRATION

EXIT_CONFORMS, EXIT_FAILS, EXIT_COULD_NOT_CHECK = 0, 1, 2
# --fail-on: which reach statuses (harness.conform.check.ModelResult.reach_status) make the exit code 1.
# "unknown" (no deploy files to read: a single-file source, a toy adapter) counts as shipped.
FAIL_ON = {"shipped": ("shipped", "unknown"), "any": ("shipped", "unknown", "only")}


@dataclass
class Matrix:
    source: str
    deploys: tuple[str, ...]
    results: list[ModelResult]  # the models asked for
    calibration: list[ModelResult] = field(default_factory=list)  # main / pr, when not asked for
    settings: dict[str, Any] = field(default_factory=dict)
    fail_on: str = "shipped"  # exit 1 for: "shipped" a failure a shipped deploy reaches; "any" every failure

    @property
    def columns(self) -> dict[str, str]:
        return columns(self.deploys)

    def calibration_problems(self) -> list[str]:
        out = []
        for r in self.results + self.calibration:
            want = CALIBRATION.get(r.model)
            if want is not None and r.status != want:
                out.append(f"{r.model} {r.status}, expected {want}" + (f" ({r.error})" if r.error else ""))
        return out

    @property
    def exit_code(self) -> int:
        if any(r.error for r in self.results) or self.calibration_problems():
            return EXIT_COULD_NOT_CHECK
        counted = FAIL_ON[self.fail_on]
        return EXIT_FAILS if any(r.reach_status in counted for r in self.results) else EXIT_CONFORMS

    def verdict(self) -> str:
        problems = self.calibration_problems()
        if problems:
            return "could not check: the oracle failed its calibration: " + "; ".join(problems)
        errors = [f"{r.model}: {r.error}" for r in self.results if r.error]
        if errors:
            return "could not check: " + "; ".join(errors)
        failing = [r for r in self.results if r.status != "conforms"]
        if not failing:
            return f"all {len(self.results)} models conform"
        shipped = [r.model for r in failing if r.reach_status in FAIL_ON["shipped"]]
        only = [r.model for r in failing if r.reach_status not in FAIL_ON["shipped"]]
        out = f"{len(failing)} of {len(self.results)} models do not conform"
        if shipped:
            out += f"; under a shipped deploy: {', '.join(shipped)}"
        if only:
            out += f"; only with changed settings: {', '.join(only)}"
        if self.fail_on == "shipped" and only and not shipped:
            out += " (exit 0 with --fail-on shipped; --fail-on any counts them)"
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "deploys": list(self.deploys), "columns": self.columns,
            "settings": self.settings, "fail_on": self.fail_on,
            "models": [r.to_json() for r in self.results],
            "calibration": {r.model: {"status": r.status, "expected": CALIBRATION.get(r.model)}
                            for r in self.results + self.calibration if r.model in CALIBRATION},
            "verdict": self.verdict(), "exit_code": self.exit_code,
        }


@dataclass
class Report:
    """One matrix per release (``--source``, repeatable); the calibration runs with the first."""

    matrices: list[Matrix]

    @property
    def exit_code(self) -> int:
        codes = [m.exit_code for m in self.matrices]
        return EXIT_COULD_NOT_CHECK if EXIT_COULD_NOT_CHECK in codes else max(codes, default=EXIT_CONFORMS)

    def verdict(self) -> str:
        return "; ".join(f"{m.source.split(' = ')[0]}: {m.verdict()} (exit {m.exit_code})" for m in self.matrices)

    def to_json(self) -> dict[str, Any]:
        if len(self.matrices) == 1:
            return self.matrices[0].to_json()
        return {"releases": [m.to_json() for m in self.matrices], "verdict": self.verdict(),
                "exit_code": self.exit_code}


def _matrices(x: Matrix | Report) -> list[Matrix]:
    return x.matrices if isinstance(x, Report) else [x]


_REACH_SHORT = {"conforms": "", "shipped": "shipped deploy", "only": "changed deploy only",
                "unknown": "unknown", "error": ""}


def _cell_text(r: ModelResult, key: str) -> str:
    if r.error:
        return "error"
    cell = r.cells.get(key)
    return "-" if cell is None else cell.summary


def format_text(x: Matrix | Report) -> str:
    ms = _matrices(x)
    if len(ms) == 1:
        return _format_one(ms[0])
    parts = [_format_one(m) for m in ms]
    return "\n".join(parts) + f"\noverall (exit {x.exit_code}): {x.verdict()}\n"


def _format_one(m: Matrix) -> str:
    cols = m.columns
    rows = m.results + m.calibration
    head = ["model", *cols.values(), "verdict", "reach"]
    body = [[r.model + (" (calibration)" if r in m.calibration else ""), *[_cell_text(r, k) for k in cols],
             r.status, _REACH_SHORT.get(r.reach_status, "")] for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [f"omni-stress conform: schedule invariance of each model's preprocess ({m.source}; vLLM deploys: "
             f"{', '.join(m.deploys) or 'none'})", ""]
    for row in [head, ["-" * w for w in widths], *body]:
        lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
    lines.append("")
    for r in rows:
        what = r.provenance.what if r.provenance else ""
        lines.append(f"{r.model}: {r.verdict}" + (f" -- {what}" if what else "") + f" ({r.seconds:.1f}s)")
        if r.error:
            lines.append(f"  could not check: {r.error}")
            continue
        if r.restart_verdict and r.restart_verdict.startswith("restarts"):
            lines.append(f"  restart verdict: {r.restart_verdict}")
        if r.reach is not None and r.reach.note:
            lines.append(f"  {r.reach.note}")
        for key, heading in cols.items():
            cell = r.cells.get(key)
            if cell is not None and cell.status not in ("conforms", "not-run"):
                lines.append(f"  {heading}: {cell.detail}")
                reach = r.reach.cells.get(key) if r.reach is not None else None
                if reach is not None:
                    lines.append(f"    reach: {reach.text}")
    by_model = {r.model: r for r in rows}
    cal = [f"{n} {by_model[n].status} (expected {want})" for n, want in CALIBRATION.items() if n in by_model]
    if cal:
        lines.append("")
        lines.append("calibration: " + "; ".join(cal) + (": ok" if not m.calibration_problems() else ": BROKEN"))
    lines.append("")
    lines.append(f"verdict: {m.verdict()} (exit {m.exit_code})")
    lines.append("Schedule invariance is necessary, not sufficient: a model that is wrong the same way under every "
                 "schedule conforms.")
    return "\n".join(lines) + "\n"


def format_json(x: Matrix | Report) -> str:
    return json.dumps(x.to_json(), indent=2) + "\n"


_COLORS = {"conforms": "#d8f0d8", "differs": "#f6d2d2", "raised": "#f3c9a8", "row-count": "#f6d2d2",
           "not-run": "#eeeeee"}


def format_html(x: Matrix | Report) -> str:
    ms = _matrices(x)
    if len(ms) == 1:
        return _html_one(ms[0])
    bodies = [_html_one(m).split("<body>", 1)[1].rsplit("</body>", 1)[0] for m in ms]
    head = _html_one(ms[0]).split("<body>", 1)[0]
    return (head + "<body>" + "<hr>".join(bodies) + f"<p><b>Overall</b>: {html.escape(x.verdict())} "
            f"(exit {x.exit_code})</p></body></html>\n")


def _html_one(m: Matrix) -> str:
    e = html.escape
    cols = m.columns
    rows = m.results + m.calibration
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>omni-stress conform</title><style>",
           "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
           "td,th{border:1px solid #999;padding:4px 8px;vertical-align:top}td.c{font-family:monospace}"
           "dl dd{margin-bottom:.6em}</style></head><body>",
           f"<h1>omni-stress conform</h1><p>Source <code>{e(m.source)}</code>; vLLM deploys "
           f"{e(', '.join(m.deploys) or 'none')}. Each cell: the first position whose row differs from the "
           f"unchunked reference schedule's, or that the call raised; <em>row count</em>: calls that returned "
           f"a row count other than the span length.</p>",
           "<table><tr><th>model</th>" + "".join(f"<th>{e(h)}</th>" for h in cols.values()) + "<th>verdict</th></tr>"]
    for r in rows:
        cells = []
        for key in cols:
            cell = r.cells.get(key)
            if r.error or cell is None:
                cells.append("<td class='c'>error</td>" if r.error else "<td>-</td>")
                continue
            cells.append(f"<td class='c' style='background:{_COLORS.get(cell.status, '#fff')}' "
                         f"title='{e(cell.detail, quote=True)}'>{e(cell.summary)}</td>")
        label = r.model + (" (calibration)" if r in m.calibration else "")
        out.append(f"<tr><th>{e(label)}</th>{''.join(cells)}<td>{e(r.verdict)}</td></tr>")
    out.append("</table>")
    out.extend(_html_upstream(m))
    out.append("<h2>Details</h2><dl>")
    for r in rows:
        what = r.provenance.what if r.provenance else ""
        out.append(f"<dt><b>{e(r.model)}</b> {e(what)}</dt>")
        if r.error:
            out.append(f"<dd>could not check: {e(r.error)}</dd>")
        else:
            out.append(f"<dd><b>verdict</b>: {e(r.verdict)}</dd>")
            if r.restart_verdict:
                out.append(f"<dd><b>restart verdict</b>: {e(r.restart_verdict)}</dd>")
        for key, heading in cols.items():
            cell = r.cells.get(key)
            if cell is not None:
                reach = r.reach.cells.get(key) if r.reach is not None else None
                out.append(f"<dd><b>{e(heading)}</b>: {e(cell.detail)}"
                           + (f"<br><i>reach</i>: {e(reach.text)}" if reach is not None else "") + "</dd>")
    out.append(f"</dl><p><b>Verdict</b>: {e(m.verdict())} (exit {m.exit_code}). Schedule invariance is necessary, "
               f"not sufficient: a model that is wrong the same way under every schedule conforms.</p></body></html>")
    return "\n".join(out) + "\n"


def _html_upstream(m: Matrix) -> list[str]:
    """The report for upstream: per failing cell of an upstream model, the line in this release that decides the
    row, the smallest schedule that shows it, the shipped deploy that reaches it, the related upstream issue."""
    e = html.escape
    entries = [(r.model, f) for r in m.results for f in r.upstream]
    if not entries:
        return []
    out = ["<h2>For upstream</h2><table><tr><th>model</th><th>column</th><th>cell</th><th>upstream line</th>"
           "<th>what it does</th><th>smallest schedule</th><th>reach</th><th>upstream issue</th></tr>"]
    for model, f in entries:
        where = f"{f['file']}:{f['line']}" if f["file"] and f["line"] else "-"
        issue = f"#{f['issue']}: {f['issue_why']}" if f["issue"] else "-"
        out.append(f"<tr><td>{e(model)}</td><td>{e(f['column'])}</td><td class='c'>{e(f['cell'])}</td>"
                   f"<td class='c'>{e(where)}</td><td>{e(f['why'] or '-')}</td><td class='c'>{e(f['schedule'] or '-')}"
                   f"</td><td>{e(f['reach'] or '-')}</td><td>{e(issue)}</td></tr>")
    out.append("</table>")
    return out
