"""The gate's verdict in one line per arm, for the top of a page (issue 46: pages that answer first).

Pure over the gate's own evaluation (``harness.gate.evaluate``): the rules are the run's family's
default rules (what ``omni-stress gate RUN_DIR`` reads without ``--rules``), the run is refused for
the same reasons the gate refuses it (``refusal``), and nothing here restates a rule.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UserError
from harness.gate.evaluate import CaseResult, GateResult, evaluate
from harness.gate.rules import REFERENCE_METRICS, WER_METRICS, Rules, family_rules_path, load_rules
from harness.report.summary import (
    CellSummary,
    Run,
    event_problems,
    not_measurable_problem,
    problems_line,
    run_problems,
)

__all__ = ["ArmLine", "PageVerdict", "arm_lines", "cell_outcomes", "page_verdict", "refusal", "verdict_html",
           "verdict_text"]


def refusal(run: Run) -> str | None:
    """Why ``omni-stress gate`` refuses the run (an incomplete run, records that disagree with their spans,
    requests that are not measurable), as the gate says it; None: the run can be gated."""
    problems = run_problems(run) + event_problems(run)
    if problems:
        return f"{problems_line(run, problems)}; not gated"
    unmeasurable = not_measurable_problem(run)
    if unmeasurable:
        return f"{run.run_dir}: {unmeasurable}; not gated"
    return None


@dataclass
class ArmLine:
    """One arm's part of the verdict line: pass, fail or error, and what to say."""

    arm: str
    role: str
    status: str  # "pass", "fail", "error" or "none" (no rule covers the arm)
    text: str
    detail: str = ""  # the failing or unevaluable checks in full (the tooltip)


@dataclass
class PageVerdict:
    rules_name: str  # the rules file's name (``gates.yaml``)
    arms: list[ArmLine] = field(default_factory=list)
    refused: str | None = None  # the gate refuses the run: why
    problems: list[str] = field(default_factory=list)  # rules that could not be applied (exit 2)
    # per cell (arm, deploy, repeat): "fail", "error", "expected" (a baseline's expected bug detected) or
    # "pass"; a cell no rule covers is absent (the run page tints its summary rows by it)
    outcomes: dict[tuple[str, str, int], str] = field(default_factory=dict)

    @property
    def html(self) -> str:
        return verdict_html(self)

    @property
    def status(self) -> str:
        if self.refused is not None:
            return "error"
        statuses = {a.status for a in self.arms}
        return "fail" if "fail" in statuses else "error" if self.problems or "error" in statuses else "pass"


def _short(case: CaseResult, status: str) -> str:
    """The first check of ``case`` with ``status``, short: ``wer_delta +0.412 > +0.030``."""
    check = next(c for c in case.checks if c.status == status)
    if check.value is None:
        return f"{check.bound.key} unknown"
    ok = status == "pass"
    sign = ("≤" if ok else ">") if check.bound.op == "max" else ("≥" if ok else "<")

    def fmt(v: float) -> str:
        if check.bound.metric in WER_METRICS:
            return f"{v:+.3f}" if check.bound.metric in REFERENCE_METRICS else f"{v:.3f}"
        return f"{v:g}"
    return f"{check.bound.metric} {fmt(check.value)} {sign} {fmt(check.bound.limit)}"


def _where(case: CaseResult, cells: list[CellSummary]) -> str:
    """The cell a case ran on, as few words as tell it apart: the deploy, the run when there are repeats."""
    repeats = len({c.repeat for c in cells if c.arm == case.cell.arm and c.deploy == case.cell.deploy})
    return case.cell.deploy + (f" run {case.cell.run_number}" if repeats > 1 else "")


def arm_lines(result: GateResult, cells: list[CellSummary]) -> list[ArmLine]:
    """Per arm (in the run's order): ``fails RULE on DEPLOY (metric value > limit)``, naming each failing
    rule; ``could not evaluate RULE``; or ``passes N rules`` (an expected failure that detects the bug
    passes: the harness still sees it)."""
    arms = list(dict.fromkeys(c.arm for c in cells))
    roles = {c.arm: c.role for c in cells}
    out = []
    for arm in arms:
        cases = [c for c in result.cases if c.cell.arm == arm]
        failed = [c for c in cases if c.status == "fail"]
        errors = [c for c in cases if c.status == "error"]
        rules = list(dict.fromkeys(c.rule.name for c in cases))
        if failed:
            names = list(dict.fromkeys(c.rule.name for c in failed))
            parts = []
            for name in names:
                mine = [c for c in failed if c.rule.name == name]
                where = ", ".join(dict.fromkeys(_where(c, cells) for c in mine))
                parts.append(f"{name} on {where} ({_short(mine[0], 'fail')})")
            text = "fails " + "; ".join(parts)
            if len(rules) > len(names):
                n = len(rules) - len(names)
                text += f"; {n} other rule{'s pass' if n != 1 else ' passes'}"
            detail = "\n".join(f"{c.rule.name}: {c.cell_label}: {c.message}" for c in failed)
            out.append(ArmLine(arm, roles[arm], "fail", text, detail))
        elif errors:
            names = list(dict.fromkeys(c.rule.name for c in errors))
            detail = "\n".join(f"{c.rule.name}: {c.cell_label}: {c.message}" for c in errors)
            out.append(ArmLine(arm, roles[arm], "error", f"could not evaluate {', '.join(names)}", detail))
        elif cases:
            expected = [c for c in cases if c.rule.expect == "fail"]
            text = f"passes {len(rules)} rule{'s' if len(rules) != 1 else ''}"
            if expected:
                text += " (the expected bug detected under " + ", ".join(
                    dict.fromkeys(c.cell.deploy for c in expected)) + ")"
            skipped = sum(c.status == "skip" for c in cases)
            if skipped:
                text += f", {skipped} not measured"
            out.append(ArmLine(arm, roles[arm], "pass", text))
        else:
            out.append(ArmLine(arm, roles[arm], "none", "not gated (no rule covers it)"))
    return out


def page_verdict(run: Run, cells: list[CellSummary], rules: Rules | None = None) -> PageVerdict:
    """The verdict ``omni-stress gate RUN_DIR`` would give (the family's default rules unless ``rules``),
    per arm. A sweep's run directory is gated over its map (``harness.sweep``), not here."""
    from harness.rundir import manifest_family

    if rules is None:
        try:
            rules = load_rules(family_rules_path(manifest_family(run.manifest)))
        except UserError as exc:  # a broken rules file: the page still comes, and says why there is no verdict
            return PageVerdict("gate rules", refused=f"could not read the rules: {exc}")
    name = Path(rules.source).name
    refused = refusal(run)
    if refused is not None:  # the page is the run's own: its directory need not be said
        return PageVerdict(name, refused=refused.removeprefix(f"{run.run_dir}: ").removesuffix("; not gated"))
    result = evaluate(rules, cells, run_id=run.run_id)
    return PageVerdict(name, arm_lines(result, cells), problems=list(result.problems),
                       outcomes=cell_outcomes(result))


def cell_outcomes(result: GateResult) -> dict[tuple[str, str, int], str]:
    """Each gated cell's outcome: ``fail`` (a rule failed), ``error`` (one could not be evaluated),
    ``expected`` (it passes, and an ``expect: fail`` rule among them detected the bug) or ``pass``."""
    by_cell: dict[tuple[str, str, int], list[CaseResult]] = {}
    for case in result.cases:
        by_cell.setdefault(case.cell.key, []).append(case)
    out = {}
    for key, cases in by_cell.items():
        statuses = {c.status for c in cases}
        out[key] = ("fail" if "fail" in statuses else "error" if "error" in statuses else
                    "expected" if any(c.rule.expect == "fail" for c in cases) else "pass")
    return out


_WORD = {"pass": "pass", "fail": "FAIL", "error": "could not evaluate", "none": "not gated"}


def verdict_text(v: PageVerdict) -> str:
    """The verdict line as plain text: ``Gate (gates.yaml): main — passes 2 rules · pr — fails ...``."""
    if v.refused is not None:
        return f"Gate ({v.rules_name}): not evaluated (the gate refuses the run): {v.refused}"
    parts = [f"{a.arm} — {a.text}" for a in v.arms]
    parts += [f"could not apply: {p}" for p in v.problems]
    return f"Gate ({v.rules_name}): " + " · ".join(parts)


def verdict_html(v: PageVerdict) -> str:
    """One ``<p class="verdict">``: each arm coloured by its status (pass green, fail red, could not evaluate
    purple), the failing rule named, the full check messages as the tooltip."""
    e = html.escape
    head = f"<b>Gate</b> ({e(v.rules_name)}):"
    if v.refused is not None:  # the first words of why; the whole of it as the tooltip
        short = v.refused if len(v.refused) <= 120 else v.refused[:120].rsplit(" ", 1)[0] + " …"
        return (f"<p class=\"verdict error\">{head} <span class=\"arm error\" title=\"{e(v.refused)}\">not evaluated "
                f"(the gate refuses the run): {e(short)}</span></p>")
    parts = []
    for a in v.arms:
        title = f" title=\"{e(a.detail)}\"" if a.detail else ""
        parts.append(f"<span class=\"arm {a.status}\"{title}><b>{e(a.arm)}</b> <span class=\"role\">({e(a.role)})"
                     f"</span> — {e(a.text)}</span>")
    parts += [f"<span class=\"arm error\">could not apply: {e(p)}</span>" for p in v.problems]
    return f"<p class=\"verdict {v.status}\">{head} " + " · ".join(parts) + "</p>"
