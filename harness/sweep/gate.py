"""The gate over a map (``omni-stress gate`` on a sweep's run directory, and the sweep's own verdict).

Each grid point is gated by the rules of its *kind*, the sweep's base deploy (``stress`` for
``stress@mnbt=16,...``): the point's cell is checked as if it were that deploy, against the same
arm's reference cell, with ``harness.gate.check``, so a point's numbers are judged exactly as a
``run``'s. The rules' ``stress: true`` bounds are left out: the map classifies stress itself, per cell.

* A cell **stressed** when its spans show a non-zero-offset chunk, a replay crossing the prompt
  boundary or a multi-position decode span. A cell that did not stress is reported, never counted
  as a pass (nor as the baseline's detection).
* A **candidate** passes when its reference cell passes its rules and every stressed point passes
  its kind's rules (the contract and the WER rules); no stressed point at all: could not evaluate.
* A **baseline** passes when its reference cell passes and at least one stressed point shows the
  bug (its ``expect: fail`` rules detect it).
* The **quality knee** of an arm: the first point, in the sweep's order, where its WER leaves the
  candidate WER bounds of the point's kind (every arm is measured against them, so the knee says
  where ``main`` breaks and that ``pr`` never does).

Exit codes as the gate: 0 every arm passes, 1 an arm fails, 2 could not evaluate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from harness.metrics import STRESSED_POINT_METRICS
from harness.gate import (
    WER_METRICS,
    Bound,
    CaseResult,
    Rule,
    Rules,
    check,
)
from harness.gate.rules import EVIDENCE_METRICS
from harness.report.summary import CellSummary

WER_BOUND_METRICS = (*WER_METRICS, "requests_over", "worst_of_repeats_requests_over")
STRESS_EVENTS = STRESSED_POINT_METRICS  # harness.metrics: the counts that show a point stressed the Talker


def stressed(cell: CellSummary) -> bool:
    return any(getattr(cell.events, name) > 0 for name in STRESS_EVENTS)


@dataclass
class CellVerdict:
    cell: CellSummary  # the point's cell, under its own deploy name
    point: str
    stressed: bool
    cases: list[CaseResult]
    wer_ok: bool | None  # inside the candidate WER bounds of its kind (None: no bound could be computed)

    @property
    def status(self) -> str:
        """pass, fail or error from its rules; ``unstressed`` when the cell did not stress."""
        if not self.stressed:
            return "unstressed"
        statuses = {c.status for c in self.cases}
        return "fail" if "fail" in statuses else "error" if "error" in statuses else "pass"

    @property
    def shows_bug(self) -> bool:
        """Baseline: a stressed cell whose ``expect: fail`` rules all detect the bug."""
        fails = [c for c in self.cases if c.rule.expect == "fail"]
        return self.stressed and bool(fails) and all(c.status == "pass" for c in fails)

    @property
    def message(self) -> str:
        bad = [c.message for c in self.cases if c.status in ("fail", "error")]
        return "; ".join(bad)


@dataclass
class ArmVerdict:
    arm: str
    role: str
    reference: list[CaseResult]
    cells: list[CellVerdict]
    knee: str | None  # first point whose WER leaves the gate, or None
    problems: list[str] = field(default_factory=list)
    knees: dict[str, str | None] = field(default_factory=dict)  # per load (panel): its first such point

    @property
    def stressed_cells(self) -> list[CellVerdict]:
        return [c for c in self.cells if c.stressed]

    @property
    def status(self) -> str:
        """A failure measured anywhere (a reference rule, a stressed cell, a baseline that shows the bug
        nowhere) is ``fail`` even when something else could not be evaluated (issue 47)."""
        if any(c.status == "fail" for c in self.reference):
            return "fail"
        stressed_cells = self.stressed_cells
        if self.role == "baseline":
            if stressed_cells and not any(c.shows_bug for c in stressed_cells):
                return "fail"
        elif any(c.status == "fail" for c in stressed_cells):
            return "fail"
        if self.problems or any(c.status == "error" for c in self.reference) or not stressed_cells:
            return "error"
        if self.role == "baseline":
            return "pass"
        return "error" if any(c.status == "error" for c in stressed_cells) else "pass"

    @property
    def summary(self) -> str:
        s = self.stressed_cells
        unstressed = len(self.cells) - len(s)
        if self.role == "baseline":
            shown = sum(c.shows_bug for c in s)
            core = f"shows the bug in {shown} of {len(s)} stressed cells"
        else:
            held = sum(c.status == "pass" for c in s)
            core = f"holds its rules in {held} of {len(s)} stressed cells"
        return core + (f" ({unstressed} cell{'s' if unstressed != 1 else ''} did not stress: reported, not counted)"
                       if unstressed else "")


@dataclass
class MapVerdict:
    arms: list[ArmVerdict]
    problems: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        statuses = {a.status for a in self.arms}
        if "fail" in statuses:
            return 1
        return 2 if self.problems or "error" in statuses or not self.arms else 0


def _rules_for(rules: Rules, arm: str, role: str, deploy: str) -> list[Rule]:
    matching = [r for r in rules.rules if r.selects(arm, role) and _deploy_match(r.deploy, deploy)]
    named = [r for r in matching if r.names_arm]
    return named or matching


def _deploy_match(pattern: str, name: str) -> bool:
    import fnmatch

    if pattern == "*":
        return True
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern == name


def _without_stress_bounds(rule: Rule) -> Rule:
    bounds = tuple(b for b in rule.bounds if not (b.op == "min" and b.metric in EVIDENCE_METRICS))
    return dataclasses.replace(rule, bounds=bounds, stress=False)


def _as_kind(cell: CellSummary, kind: str) -> CellSummary:
    return dataclasses.replace(cell, deploy=kind)


def wer_bounds(rules: Rules, kind: str) -> list[tuple[Rule, Bound]]:
    """The candidate WER bounds of a kind (what the knee measures every arm against)."""
    out = []
    for rule in rules.rules:
        if rule.expect != "pass" or rule.role not in ("candidate", "*") or rule.names_arm:
            continue
        if not _deploy_match(rule.deploy, kind):
            continue
        out += [(rule, b) for b in rule.bounds if b.op == "max" and b.metric in WER_BOUND_METRICS]
    if not out:  # no WER rule for this kind: no request may be over the threshold
        out = [(Rule(name="wer", arm="*", deploy=kind, bounds=(Bound("requests_over", "max", 0.0),)),
                Bound("requests_over", "max", 0.0))]
    return out


def evaluate_map(rules: Rules, cells: list[CellSummary], sweep: dict[str, Any]) -> MapVerdict:
    """The map's verdict per arm (see the module doc). ``sweep``: the manifest's ``sweep`` entry."""
    kind = str(sweep.get("base"))
    ref_name = sweep.get("reference")
    points = [str(p["deploy"]) for p in sweep.get("points", [])]
    point_set = set(points)
    result = MapVerdict(arms=[])
    arms = list(dict.fromkeys(c.arm for c in cells))
    knee_bounds = wer_bounds(rules, kind)
    load_axis = next((a.get("short") for a in sweep.get("axes", []) if a.get("key") == "load"), None)
    loads = {str(p["deploy"]): (p.get("coords") or {}).get(load_axis) for p in sweep.get("points", [])} \
        if load_axis else {}
    for arm in arms:
        mine = [c for c in cells if c.arm == arm]
        role = mine[0].role
        refs = [c for c in mine if c.deploy == ref_name]
        verdict = ArmVerdict(arm=arm, role=role, reference=[], cells=[], knee=None)
        if ref_name is None or not refs:
            verdict.problems.append(f"no {arm}/{ref_name} reference cell in this run")
        untraced = [c for c in mine if not c.span_facts]
        if untraced:  # which points were stressed is a span fact: without it the map cannot be gated
            verdict.problems.append(f"{len(untraced)} {arm} cell(s) ran with --trace off (no span facts: which "
                                    "points were stressed is unknown); rerun with --trace spans or contract")
        for ref in refs:
            for rule in _rules_for(rules, arm, role, ref.deploy):
                verdict.reference.append(CaseResult(rule, ref, [check(rule, b, ref, mine, rules.wer_threshold)
                                                                for b in rule.bounds]))
        order = {p: i for i, p in enumerate(points)}
        point_cells = sorted((c for c in mine if c.deploy in point_set), key=lambda c: (order[c.deploy], c.repeat))
        kind_rules = [_without_stress_bounds(r) for r in _rules_for(rules, arm, role, kind)]
        kind_rules = [r for r in kind_rules if r.bounds]
        for cell in point_cells:
            as_kind = _as_kind(cell, kind)
            context = refs + [as_kind if c is cell else _as_kind(c, kind) for c in point_cells if c.deploy == cell.deploy]
            as_kind = next(c for c in context if c.deploy == kind and c.repeat == cell.repeat)
            cases = [CaseResult(rule, as_kind, [check(rule, b, as_kind, context, rules.wer_threshold)
                                                for b in rule.bounds]) for rule in kind_rules]
            for case in cases:
                case.cell = cell
            wer_checks = [check(rule, b, as_kind, context, rules.wer_threshold) for rule, b in knee_bounds]
            known = [c for c in wer_checks if c.status in ("pass", "fail")]
            wer_ok = None if not known else all(c.status == "pass" for c in known)
            verdict.cells.append(CellVerdict(cell, cell.deploy, stressed(cell), cases, wer_ok))
            panel = loads.get(cell.deploy)
            if panel is not None:
                verdict.knees.setdefault(panel, None)
            if wer_ok is False:
                if verdict.knee is None:
                    verdict.knee = cell.deploy
                if panel is not None and verdict.knees.get(panel) is None:
                    verdict.knees[panel] = cell.deploy
        result.arms.append(verdict)
    return result


def knee_text(arm: ArmVerdict) -> str:
    if not arm.knee:
        return "no quality knee (WER inside the gate at every point)"
    per_load = ""
    if len(arm.knees) > 1:
        per_load = " (per load: " + ", ".join(f"{load}: {point or 'none'}" for load, point in arm.knees.items()) + ")"
    return f"quality knee at {arm.knee}{per_load}"


def format_map_verdict(verdict: MapVerdict, verbose: bool = False) -> str:
    lines = []
    mark = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "unstressed": "----", "note": "note"}
    for arm in verdict.arms:
        for case in arm.reference:
            if verbose or case.status in ("fail", "error"):
                lines.append(f"{mark.get(case.status, case.status.upper()):5}  {case.rule.name}: {arm.arm}/"
                             f"{case.cell.deploy} run {case.cell.run_number} [{arm.role}]: {case.message}")
        for cell in arm.cells:
            tag = cell.status
            if arm.role == "baseline" and cell.stressed:  # it must show the bug somewhere, not everywhere
                tag = "pass" if cell.shows_bug else "note"
            if verbose or tag in ("fail", "error", "note") or (not cell.stressed and arm.role != "baseline"):
                why = cell.message if tag in ("fail", "error") else f"holds its rules ({len(cell.cases)} rules)"
                if arm.role == "baseline" and cell.stressed:
                    why = "bug detected" if cell.shows_bug else "bug NOT detected"
                if not cell.stressed:
                    why = "did not stress (no non-zero-offset chunk, crossing replay or multi-position decode span): " \
                          "reported, not counted"
                lines.append(f"{mark.get(tag, tag.upper()):5}  {arm.arm} [{arm.role}] {cell.point} run "
                             f"{cell.cell.run_number}: {why}")
        for problem in arm.problems:
            lines.append(f"ERROR  {arm.arm}: {problem}")
        knee = knee_text(arm)
        lines.append(f"{mark.get(arm.status, arm.status):5}  arm {arm.arm} [{arm.role}]: {arm.summary}; {knee}")
    for problem in verdict.problems:
        lines.append(f"ERROR  {problem}")
    word = {0: "pass", 1: "FAIL (an arm failed)", 2: "could not evaluate"}[verdict.exit_code]
    lines.append(f"map gate: {sum(a.status == 'pass' for a in verdict.arms)} of {len(verdict.arms)} arms pass -> "
                 f"{word} (exit {verdict.exit_code})")
    return "\n".join(lines) + "\n"


def map_junit_xml(verdict: MapVerdict, run_id: str = "", suite: str = "omni-stress map gate") -> str:
    """JUnit XML: one testcase per arm (its verdict), one per stressed point cell of each arm."""
    import xml.etree.ElementTree as ET

    cases: list[tuple[str, str, str, str]] = []  # (classname, name, status, message)
    for arm in verdict.arms:
        cases.append((f"omni-stress.map.{arm.arm}", f"arm {arm.arm} [{arm.role}]", arm.status,
                      "; ".join(arm.problems) or arm.summary))
        for cell in arm.cells:
            if not cell.stressed:
                status, msg = "skip", "did not stress: reported, not counted"
            elif arm.role == "baseline":
                status, msg = "pass", "bug detected" if cell.shows_bug else "bug not detected here"
            else:
                status, msg = cell.status, cell.message or "holds its rules"
            cases.append((f"omni-stress.map.{arm.arm}", f"{cell.point} run {cell.cell.run_number}", status, msg))
    for i, problem in enumerate(verdict.problems):
        cases.append(("omni-stress.map", f"could not evaluate ({i + 1})", "error", problem))
    failures = sum(c[2] == "fail" for c in cases)
    errors = sum(c[2] == "error" for c in cases)
    skipped = sum(c[2] == "skip" for c in cases)
    name = f"{suite}: {run_id}" if run_id else suite
    root = ET.Element("testsuites", name=suite, tests=str(len(cases)), failures=str(failures), errors=str(errors))
    ts = ET.SubElement(root, "testsuite", name=name, tests=str(len(cases)), failures=str(failures),
                       errors=str(errors), skipped=str(skipped), time="0")
    for classname, case_name, status, message in cases:
        tc = ET.SubElement(ts, "testcase", classname=classname, name=case_name, time="0")
        if status in ("fail", "error"):
            tag = "failure" if status == "fail" else "error"
            el = ET.SubElement(tc, tag, message=message, type=f"gate.{tag}")
            el.text = message
        elif status == "skip":
            ET.SubElement(tc, "skipped", message=message)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
