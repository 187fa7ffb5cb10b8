"""The conformance matrix: terminal text, JSON and a self-contained HTML page."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any

from harness.conform.check import ModelResult, columns
from harness.conform.models import CALIBRATION
from harness.report.style import VERDICT_CSS

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
        counts = model_counts(self)
        shipped, only = counts.shipped, counts.only
        if not shipped and not only:
            return f"all {counts.models} models conform"
        out = f"{len(shipped) + len(only)} of {counts.models} models do not conform{counts.rows_note}"
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


def base_model(name: str) -> str:
    """The model a matrix row checks: a row per (runner, ``async_chunk``) mode its deploys use is named
    ``MODEL@MODE`` (``qwen3-tts@mrv2``); the model is the name before the ``@``."""
    return name.split("@", 1)[0]


def _names(models: list[str]) -> str:
    return ", ".join(models)


@dataclass
class ModelCounts:
    """A matrix's rows joined per model (a row per runner mode is ``MODEL@MODE``): a model fails when any
    of its rows fails, and fails under a shipped deploy when a shipped deploy reaches any failing row."""

    models: int
    shipped: list[str]
    only: list[str]
    conform: list[str]
    rows_note: str  # " (9 of 10 rows, one per model and runner mode)" where rows and models differ


def model_counts(m: Matrix) -> ModelCounts:
    rows: dict[str, list[ModelResult]] = {}
    for r in m.results:
        rows.setdefault(base_model(r.model), []).append(r)
    shipped = [n for n, rs in rows.items() if any(r.reach_status in FAIL_ON["shipped"] for r in rs)]
    only = [n for n, rs in rows.items() if n not in shipped and any(r.status != "conforms" for r in rs)]
    conform = [n for n in rows if n not in shipped and n not in only]
    failing_rows = sum(r.status != "conforms" for r in m.results)
    note = (f" ({failing_rows} of {len(m.results)} rows, one per model and runner mode)"
            if len(m.results) != len(rows) else "")
    return ModelCounts(len(rows), shipped, only, conform, note)


def release_line(m: Matrix) -> tuple[str, str]:
    """(status, text) of one release for the page's headline: counts of **models** (rows joined per model:
    a model fails when any of its mode rows fails, under a shipped deploy when any failing row is reached
    by one), the rows said beside them, the exit code once. Status: pass, fail or error (could not check)."""
    label = m.source.split(" = ")[0]
    problems = m.calibration_problems()
    if problems:
        return "error", f"{label}: could not check: the oracle failed its calibration: {'; '.join(problems)} (exit 2)"
    errors = [f"{r.model}: {r.error}" for r in m.results if r.error]
    if errors:
        return "error", f"{label}: could not check {'; '.join(errors)} (exit {m.exit_code})"
    counts = model_counts(m)
    shipped, only, conform = counts.shipped, counts.only, counts.conform
    text = f"{label}: {len(shipped) + len(only)} of {counts.models} models do not conform{counts.rows_note}"
    if shipped:
        text += f"; under a shipped deploy: {_names(shipped)}"
    if only:
        text += f"; only with changed settings: {_names(only)}"
    if conform:
        text += f"; {'conforms' if len(conform) == 1 else 'conform'}: {_names(conform)}"
    if m.calibration or any(r.model in CALIBRATION for r in m.results):
        text += "; calibration ok"
    text += f" (exit {m.exit_code}"
    if m.fail_on == "shipped" and only and not shipped:
        text += " with --fail-on shipped; --fail-on any counts them"
    text += ")"
    return {EXIT_CONFORMS: "pass", EXIT_FAILS: "fail"}.get(m.exit_code, "error"), text


def _release_verdict(m: Matrix) -> str:
    """A release's line of the headline, its name in bold."""
    status, text = release_line(m)
    label, rest = text.split(": ", 1)
    return f"<span class='arm {status}'><b>{html.escape(label)}</b>: {html.escape(rest)}</span>"


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
    lines = "".join(f"  {m.source.split(' = ')[0]}: {m.verdict()} (exit {m.exit_code})\n" for m in ms)
    return "\n".join(parts) + f"\noverall (exit {x.exit_code}), one line per release:\n{lines}"


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

_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;padding:.8em 1.5em 2em;color:#222;
max-width:1400px;line-height:1.35}
h1{font-size:1.5em;margin:.3em 0}
h2{font-size:1.25em;margin:1.3em 0 .3em;padding-top:.4em;border-top:1px solid #ddd}
h3{font-size:1.08em;margin:1em 0 .3em}
p{margin:.35em 0}
code{background:#f4f4f4;padding:1px 4px;overflow-wrap:anywhere}
nav.toc{border:1px solid #ddd;background:#fafafa;padding:.5em .9em;margin:.6em 0;font-size:14px}
nav.toc ol{margin:.2em 0;padding-left:1.4em}
nav.toc li{margin:.1em 0}
nav.toc .models a{margin-right:.9em;white-space:nowrap}
nav.toc a.fails{color:#b71c1c}nav.toc a.conforms{color:#2e7d32}nav.toc a.error{color:#6a1b9a}
.scroll{max-width:100%;overflow-x:auto;margin:.5em 0}
table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #aaa;padding:4px 7px;vertical-align:top;text-align:left}
thead th,tr.head th{background:#eee}
td.c{font-family:ui-monospace,monospace;font-size:12px}
td.path{font-family:ui-monospace,monospace;font-size:12px;overflow-wrap:anywhere;min-width:14em;max-width:22em}
td.why{min-width:18em;max-width:30em}
td.sched{font-family:ui-monospace,monospace;font-size:12px;min-width:12em;max-width:20em}
td.reach{min-width:12em;max-width:22em;overflow-wrap:anywhere}
td.issue{min-width:10em;max-width:18em}
table.upstream{width:100%}
table.upstream tbody.model{border-top:3px solid #888}
th a,td a{color:#0645ad;text-decoration:none}
details{border:1px solid #ddd;border-radius:4px;margin:.35em 0;padding:.2em .8em;background:#fff}
details[open]{background:#fcfcfc}
summary{cursor:pointer;padding:.25em 0;font-size:14px}
summary .what{color:#666;font-size:12.5px}
dl{margin:.3em 0 .6em}
dt{font-weight:600;margin-top:.4em}
dd{margin:.1em 0 .3em 1.4em;overflow-wrap:anywhere}
.badge{display:inline-block;padding:1px 7px;border-radius:9px;font-size:12px;font-weight:600;white-space:nowrap}
.badge.conforms{background:#2e7d32;color:#fff}.badge.fails{background:#c62828;color:#fff}
.badge.error{background:#6a1b9a;color:#fff}
.note{color:#555}
"""


def _verdict_class(r: ModelResult) -> str:
    return "error" if r.error else "conforms" if r.status == "conforms" else "fails"


def _anchor(prefix: str, model: str) -> str:
    return prefix + "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in model)


def format_html(x: Matrix | Report) -> str:
    """One page: a table of contents, then per release the matrix, the report for upstream (each upstream
    line and what it does said once, over the cells it decides) and each model's detail, collapsed."""
    e = html.escape
    ms = _matrices(x)
    toc = []
    for i, m in enumerate(ms):
        p = f"r{i}-" if len(ms) > 1 else ""
        models = "".join(f"<a class='{_verdict_class(r)}' href='#{_anchor(p + 'm-', r.model)}'>{e(r.model)}</a>"
                         for r in m.results + m.calibration)
        items = [f"<li><a href='#{p}matrix'>Matrix</a></li>"]
        if any(r.upstream for r in m.results):
            items.append(f"<li><a href='#{p}upstream'>For upstream</a></li>")
        items.append(f"<li><a href='#{p}details'>Details per model</a> (red: does not conform, green: conforms): "
                     f"<span class='models'>{models}</span></li>")
        label = f"<a href='#{p}release'><b>{e(m.source.split(' = ')[0])}</b></a>" if len(ms) > 1 else ""
        toc.append((f"<li>{label}<ol>" + "".join(items) + "</ol></li>") if len(ms) > 1 else "".join(items))
    status = {EXIT_CONFORMS: "pass", EXIT_FAILS: "fail"}.get(x.exit_code, "error")
    # the page answers first: one line per release, coloured (conforms green, fails red, could not check purple)
    overall = f" (overall exit {x.exit_code})" if len(ms) > 1 else ""
    headline = (f"<p class='verdict {status}'><b>Verdict</b>{overall}:{'<br>' if len(ms) > 1 else ' '}"
                + "<br>".join(_release_verdict(m) for m in ms) + "</p>")
    out = ["<!doctype html><html><head><meta charset='utf-8'>"
           "<meta name='viewport' content='width=device-width, initial-scale=1'><title>omni-stress conform</title>"
           f"<style>{_CSS}{VERDICT_CSS}p.verdict .arm{{font-weight:normal}}</style></head><body>",
           "<h1>omni-stress conform</h1>", headline,
           "<p>Schedule invariance of each model's preprocess. Each cell: the first position whose row differs from "
           "the unchunked reference schedule's, or that the call raised; <em>row count</em>: calls that returned a "
           "row count other than the span length. Schedule invariance is necessary, not sufficient: a model that is "
           "wrong the same way under every schedule conforms.</p>",
           f"<nav class='toc'><b>Contents</b><ol>{''.join(toc)}</ol></nav>"]
    for i, m in enumerate(ms):
        if i:
            out.append("<hr>")
        out.append(_html_one(m, f"r{i}-" if len(ms) > 1 else "", len(ms) > 1))
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _html_one(m: Matrix, p: str = "", titled: bool = False) -> str:
    e = html.escape
    cols = m.columns
    rows = m.results + m.calibration
    out = []
    if titled:
        out.append(f"<h2 id='{p}release'>{e(m.source)}</h2>")
    out.append(f"<h2 id='{p}matrix'>Matrix</h2>" if not titled else f"<h3 id='{p}matrix'>Matrix</h3>")
    out.append(f"<p>Source <code>{e(m.source)}</code>; vLLM deploys {e(', '.join(m.deploys) or 'none')}.</p>")
    if titled:  # one release of several: its line of the headline again, above its matrix
        status = release_line(m)[0]
        out.append(f"<p class='verdict {status}'><b>Verdict</b>: {_release_verdict(m)}</p>")
    out.append("<div class='scroll'><table><tr class='head'><th>model</th>"
               + "".join(f"<th>{e(h)}</th>" for h in cols.values()) + "<th>verdict</th></tr>")
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
        out.append(f"<tr><th><a href='#{_anchor(p + 'm-', r.model)}'>{e(label)}</a></th>{''.join(cells)}"
                   f"<td>{e(r.verdict)}</td></tr>")
    out.append("</table></div>")
    out.extend(_html_upstream(m, p, titled))
    h = "h3" if titled else "h2"
    out.append(f"<{h} id='{p}details'>Details per model</{h}>"
               "<p class='note'>Click a model to open its detail: each column's first differing position and "
               "the deploys that reach it.</p>")
    for r in rows:
        what = r.provenance.what if r.provenance else ""
        cls = _verdict_class(r)
        label = r.model + (" (calibration)" if r in m.calibration else "")
        out.append(f"<details id='{_anchor(p + 'm-', r.model)}'><summary><b>{e(label)}</b> "
                   f"<span class='badge {cls}'>{e('error' if r.error else r.status)}</span> "
                   f"{e(r.verdict)} <span class='what'>{e(what)} ({r.seconds:.1f}s)</span></summary><dl>")
        if r.error:
            out.append(f"<dt>could not check</dt><dd>{e(r.error)}</dd>")
        elif r.restart_verdict:
            out.append(f"<dt>restart verdict</dt><dd>{e(r.restart_verdict)}</dd>")
        if r.reach is not None and r.reach.note:
            out.append(f"<dt>reach</dt><dd>{e(r.reach.note)}</dd>")
        for key, heading in cols.items():
            cell = r.cells.get(key)
            if cell is not None:
                reach = r.reach.cells.get(key) if r.reach is not None else None
                out.append(f"<dt>{e(heading)}</dt><dd>{e(cell.detail)}"
                           + (f"<br><i>reach</i>: {e(reach.text)}" if reach is not None else "") + "</dd>")
        out.append("</dl></details>")
    return "\n".join(out)


def _html_upstream(m: Matrix, p: str = "", titled: bool = False) -> list[str]:
    """The report for upstream: per failing cell of an upstream model, the line in this release that decides the
    row, the smallest schedule that shows it, the shipped deploy that reaches it, the related upstream issue. The
    line, what it does and the issue are said once for the cells that line decides (rowspan), and the reach once
    for consecutive cells it shares."""
    e = html.escape
    entries = [(r.model, f) for r in m.results for f in r.upstream]
    if not entries:
        return []
    h = "h3" if titled else "h2"
    out = [f"<section id='{p}upstream'><{h}>For upstream</{h}>",
           "<p class='note'>Per failing cell of an upstream model: the line of this release that decides the row and "
           "what it does (once for every cell it decides), the smallest schedule that shows it, its reach and the "
           "related upstream issue.</p>",
           "<div class='scroll'><table class='upstream'><thead><tr><th>model</th><th>upstream line</th>"
           "<th>what it does</th><th>column</th><th>cell</th><th>smallest schedule</th><th>reach</th>"
           "<th>upstream issue</th></tr></thead>"]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for model, f in entries:
        by_model.setdefault(model, []).append(f)
    for model, findings in by_model.items():
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for f in findings:  # each line (and what it does) once, in the order the columns first show it
            groups.setdefault((f["file"], f["line"], f["why"]), []).append(f)
        rows = []
        first_model = True
        for (file, line, why), fs in groups.items():
            where = f"{file}:{line}" if file and line else "-"
            reach_runs = _runs([f["reach"] or "-" for f in fs])
            issues = [f"#{f['issue']}: {f['issue_why']}" if f["issue"] else "-" for f in fs]
            issue_runs = _runs(issues)
            for j, f in enumerate(fs):
                tds = []
                if first_model:
                    tds.append(f"<th rowspan='{len(findings)}'>{e(model)}</th>")
                    first_model = False
                if j == 0:
                    tds += [f"<td class='path' rowspan='{len(fs)}'>{e(where)}</td>",
                            f"<td class='why' rowspan='{len(fs)}'>{e(why or '-')}</td>"]
                tds += [f"<td>{e(f['column'])}</td>", f"<td class='c'>{e(f['cell'])}</td>",
                        f"<td class='sched'>{e(f['schedule'] or '-')}</td>"]
                if j in reach_runs:
                    tds.append(f"<td class='reach' rowspan='{reach_runs[j]}'>{e(f['reach'] or '-')}</td>")
                if j in issue_runs:
                    tds.append(f"<td class='issue' rowspan='{issue_runs[j]}'>{e(issues[j])}</td>")
                rows.append("<tr>" + "".join(tds) + "</tr>")
        out.append("<tbody class='model'>" + "".join(rows) + "</tbody>")
    out.append("</table></div></section>")
    return out


def _runs(values: list[str]) -> dict[int, int]:
    """{index where a run of equal consecutive values starts: its length}."""
    starts: dict[int, int] = {}
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            starts[start] = i - start
            start = i
    return starts
