"""The gate's evaluation: every rule checked against every cell it matches, pure over the cells
(``harness.report.summary``); the verdict's exit code and its text."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from harness.config import StreamingSlo
from harness.streaming_figures import RATIO_METRICS, STREAM_METRICS
from harness.streaming_figures import metric as stream_metric
from harness.report.summary import (
    CellKey,
    CellSummary,
    reference_cell,
    repeat_group,
    worst_of_repeats,
    worst_paired_delta,
)

from harness.metrics import REAL_TEXT_COUNTS, RECORD_COUNTS
from harness.gate.rules import (
    DETECTION_METRICS,
    METRICS,
    MISALIGNED_METRICS,
    REFERENCE_METRICS,
    WER_METRICS,
    Bound,
    Rule,
    Rules,
)

@dataclass
class CheckResult:
    bound: Bound
    value: float | None
    status: str  # "pass", "fail", "error" or "skip" (not measured by this backend)
    message: str


@dataclass
class CaseResult:
    """One rule applied to one cell: the JUnit testcase."""

    rule: Rule
    cell: CellSummary
    checks: list[CheckResult]

    @property
    def status(self) -> str:
        """A measured FAIL wins over a bound that could not be evaluated: a case is ERROR only when none
        of its bounds failed (issue 47: an ERROR hid a failing bound from a CI that skips on 2)."""
        statuses = {c.status for c in self.checks}
        if statuses == {"skip"}:
            return "skip"
        return "fail" if "fail" in statuses else "error" if "error" in statuses else "pass"

    @property
    def cell_label(self) -> str:
        return f"{self.cell.arm}/{self.cell.deploy} run {self.cell.run_number} [{self.cell.role}]"

    @property
    def message(self) -> str:
        bad = [c.message for c in self.checks if c.status in ("fail", "error")] or [c.message for c in self.checks]
        return "; ".join(bad)


@dataclass
class GateResult:
    cases: list[CaseResult]
    problems: list[str] = field(default_factory=list)  # rules that could not be applied
    uncovered: list[CellKey] = field(default_factory=list)  # cells no rule covers (reported, not failed)
    run_id: str = ""
    notes: list[str] = field(default_factory=list)  # role rules with no arm of their role in the run
    overridden: list[tuple[str, CellKey, str]] = field(default_factory=list)  # (rule, cell, the named rule)

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.cases)

    @property
    def exit_code(self) -> int:
        """1 whenever a bound failed on measured data, whatever else could not be judged; 2 only when
        nothing failed and something could not be evaluated (a CI that retries on 2 never misses a
        regression)."""
        if self.count("fail"):
            return 1
        return 2 if self.problems or self.count("error") else 0

    @property
    def failed(self) -> list[CaseResult]:
        return [c for c in self.cases if c.status == "fail"]


# Bounds a cell run with ``--trace off`` can still be checked on: WER (from Whisper; the speaking
# model's oracle needs the traced codec stream, so it is unknown there) and errors. Every other metric
# counts span facts (events, row counts, misaligned positions, preemptions), which were never traced.
SPAN_FREE_METRICS = (*WER_METRICS, "requests_over", "worst_of_repeats_requests_over", "errors",
                     *(m for m in STREAM_METRICS if m != "chunk_violations_beyond_replays"), *RATIO_METRICS)


def _fmt(metric: str, value: float) -> str:
    if metric in ("continuity_rate", "goodput"):
        return f"{value:.0%}"
    if metric in ("ttfp_p99_s", *RATIO_METRICS):
        return f"{value:.3f}"
    if metric in WER_METRICS:
        return f"{value:+.3f}" if metric in REFERENCE_METRICS else f"{value:.3f}"
    return f"{value:g}"


def _metric_value(cell: CellSummary, metric: str, cells: list[CellSummary], threshold: float) -> float | None:
    """The cell's value of a metric that needs no reference cell; NaN: not measured by this backend."""
    if metric == "mean_wer":
        return cell.mean_wer
    if metric == "requests_over":
        return float(cell.requests_over(threshold)) if cell.scored else None
    if metric.startswith("worst_of_repeats_"):
        worst = worst_of_repeats(cell, cells)
        if not worst:
            return None
        if metric == "worst_of_repeats_mean_wer":
            return sum(worst.values()) / len(worst)
        return float(sum(v > threshold for v in worst.values()))
    if metric in ("preemptions", "errors", "crashed"):
        return float(getattr(cell, metric))
    if metric in STREAM_METRICS:  # NaN: the cell streamed nothing (or its connector was not traced)
        value = stream_metric(cell.records, metric, cell.slo or StreamingSlo())
        return math.nan if value is None else value
    if metric in MISALIGNED_METRICS and not cell.misaligned_known:
        return math.nan  # the backend does not measure it
    if metric in RECORD_COUNTS and cell.trace is not None and not (
            metric in REAL_TEXT_COUNTS and cell.records and all(r.text_len is not None for r in cell.records)):
        return math.nan  # a real server's records count it only where its worker reported each request's text
    return float(getattr(cell.events, metric))


def check(rule: Rule, bound: Bound, cell: CellSummary, cells: list[CellSummary], threshold: float) -> CheckResult:
    """One bound on one cell; 'error' when the value cannot be computed."""
    what = METRICS[bound.metric]
    if bound.metric in ("requests_over", "worst_of_repeats_requests_over"):
        what = what.replace("the threshold", f"{threshold:g}")
    if bound.metric.startswith("worst_of_repeats_"):
        what += f" ({len(repeat_group(cell, cells))} repeat{'s' if len(repeat_group(cell, cells)) > 1 else ''})"
    if cell.requests == 0:
        return CheckResult(bound, None, "error", f"{bound.key}: no requests recorded for this cell")
    if not cell.span_facts and bound.metric not in SPAN_FREE_METRICS:
        return CheckResult(bound, None, "error", f"{bound.key}: {what} not measured: the cell ran with --trace off "
                                                 "(no span facts); rerun with --trace spans or contract")
    ref_note = ""
    if bound.metric not in REFERENCE_METRICS:
        value = _metric_value(cell, bound.metric, cells, threshold)
    else:
        target = rule.reference_target  # None: the pair the cell's deploy declares
        ref = reference_cell(cell, target, cells)
        if ref is None:
            wanted = target or cell.pair or f"(none: {cell.deploy} is a {cell.deploy_role} deploy with no pair)"
            return CheckResult(bound, None, "error", f"{bound.key}: no {cell.arm}/{wanted} cell "
                                                     f"for run {cell.run_number} in this run")
        if bound.metric in RATIO_METRICS:
            mine, theirs = (stream_metric(c.records, "ttfp_p99_s") for c in (cell, ref))
            value = math.nan if mine is None or theirs is None else mine / theirs if theirs > 0 else None
            if theirs is not None and mine is not None:
                ref_note = f" (p99 {mine:.3f} s vs {theirs:.3f} s in {ref.arm}/{ref.deploy} run {ref.run_number})"
        elif bound.metric == "wer_delta":
            value = None if cell.mean_wer is None or ref.mean_wer is None else cell.mean_wer - ref.mean_wer
            if value is not None:
                ref_note = f" (vs {ref.arm}/{ref.deploy} run {ref.run_number}: {ref.mean_wer:.3f})"
        else:
            value = worst_paired_delta(cell, cells, target)
            worst = _worst_pair(cell, ref)
            if value is not None and worst is not None:
                ref_note = f" (prompt {worst[0]}: {worst[2]:.3f} vs {worst[1]:.3f} in {ref.arm}/{ref.deploy})"
    if value is None:
        return CheckResult(bound, None, "error", f"{bound.key}: {what} unknown (no scored requests or no data)")
    if math.isnan(value):
        if bound.metric in STREAM_METRICS or bound.metric in RATIO_METRICS:
            return CheckResult(bound, None, "skip", f"{bound.key}: {what} not measured: nothing streamed in this cell "
                                                    "or its connector's windows were not traced or modelled (skipped)")
        return CheckResult(bound, None, "skip", f"{bound.key}: {what} not measured by this backend (skipped)")
    ok = value <= bound.limit if bound.op == "max" else value >= bound.limit
    sign = ("<=" if ok else ">") if bound.op == "max" else (">=" if ok else "<")
    text = f"{what} = {_fmt(bound.metric, value)} {sign} {_fmt(bound.metric, bound.limit)}{ref_note}"
    if rule.expect == "fail" and bound.op == "min" and bound.metric in DETECTION_METRICS:
        text = f"bug detected: {text}" if ok else f"expected failure NOT detected: {text}"
    return CheckResult(bound, value, "pass" if ok else "fail", f"{bound.key}: {text}")


def crash_check(cell: CellSummary) -> CheckResult:
    """A cell whose server crashed fails every rule applied to it, expected failures included: its
    numbers are those of the requests that survived, and a crash is not the bug a rule expects
    (issue 31: the Talker crash on preempt and resume is a finding of its own). No rule file names
    it, so runs without a crash are gated exactly as before."""
    bound = Bound("crashed", "max", 0.0)
    return CheckResult(bound, float(cell.crashed), "fail",
                       f"{bound.key}: {METRICS['crashed']} = {cell.crashed} > 0 (the server crashed: see the "
                       f"requests' errors and the manifest's cells[].crashes)")


def _worst_pair(cell: CellSummary, ref: CellSummary) -> tuple[str, float, float] | None:
    """(prompt, reference WER, this cell's WER) of the largest paired increase (first prompt on a tie)."""
    mine, theirs = cell.prompt_scores, ref.prompt_scores
    pairs = [(pid, theirs[pid], mine[pid]) for pid in sorted(mine) if pid in theirs]
    if not pairs:
        return None
    best = pairs[0]
    for pair in pairs[1:]:
        if pair[2] - pair[1] > best[2] - best[1]:
            best = pair
    return best


def evaluate(rules: Rules, cells: list[CellSummary], run_id: str = "") -> GateResult:
    """Applies every rule to every cell it selects.

    A rule that names an arm (``arm: pr``, no pattern) overrides, on the cells it matches, every
    rule that selects by role or pattern. A non-optional rule that matches no cell is a problem
    (exit 2), except a role rule when the run has no arm of that role (reported as a note).
    """
    result = GateResult(cases=[], run_id=run_id)
    covered: set[CellKey] = set()
    arms = list(dict.fromkeys(c.arm for c in cells))
    deploys = list(dict.fromkeys(c.deploy for c in cells))
    roles = {c.arm: c.role for c in cells}
    named = {c.key: [r for r in rules.rules if r.names_arm and r.matches(c)] for c in cells}
    for rule in rules.rules:
        matched = [c for c in cells if rule.matches(c)]
        if not matched:
            if rule.role != "*" and not any(rule.selects(a, roles[a]) for a in arms):
                result.notes.append(f"rule {rule.name!r} not applied: no {rule.role} arm in this run")
            elif not rule.optional:
                have = ", ".join(f"{a} ({roles[a]})" for a in arms) or "none"
                result.problems.append(
                    f"rule {rule.name!r}: no cell of this run matches {rule.selector} "
                    f"(run has arms {have}; deploys {', '.join(deploys) or 'none'})")
            continue
        for cell in matched:
            if not rule.names_arm and named[cell.key]:
                result.overridden.append((rule.name, cell.key, named[cell.key][0].name))
                continue
            covered.add(cell.key)
            checks = [check(rule, b, cell, cells, rules.wer_threshold) for b in rule.bounds]
            if cell.crashed:
                checks.append(crash_check(cell))
            result.cases.append(CaseResult(rule, cell, checks))
    result.uncovered = [c.key for c in cells if c.key not in covered]
    return result


# --------------------------------------------------------------------------- output


def format_result(result: GateResult) -> str:
    """Plain text: one line per testcase, its checks indented, then the verdict."""
    mark = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skip": "SKIP"}
    lines = [f"FAILED {case.rule.name}: {case.cell_label}: {case.message}" for case in result.failed]
    for case in result.cases:
        tag = " (expected failure)" if case.rule.expect == "fail" else ""
        lines.append(f"{mark[case.status]:5}  {case.rule.name}{tag}: {case.cell_label}")
        for c in case.checks:
            lines.append(f"         {mark[c.status]:5} {c.message}")
    for problem in result.problems:
        lines.append(f"ERROR  {problem}")
    for note in result.notes:
        lines.append(f"note   {note}")
    for rule_name, key, by in result.overridden:
        lines.append(f"note   rule {rule_name!r} not applied to {key[0]}/{key[1]} repeat {key[2]}: "
                     f"overridden by {by!r}, which names the arm")
    for key in result.uncovered:
        lines.append(f"note   no rule covers {key[0]}/{key[1]} repeat {key[2]} (not gated)")
    verdict = {0: "pass", 1: "FAIL (a rule failed)", 2: "could not evaluate"}[result.exit_code]
    if result.failed:
        names = list(dict.fromkeys(c.rule.name for c in result.failed))
        arms = list(dict.fromkeys(f"{c.cell.arm} ({c.cell.role})" for c in result.failed))
        verdict = f"FAIL ({', '.join(names)} failed; arm{'s' if len(arms) > 1 else ''} {', '.join(arms)})"
    skipped = f", {result.count('skip')} skipped" if result.count("skip") else ""
    lines.append(f"gate: {result.count('pass')} passed, {result.count('fail')} failed{skipped}, "
                 f"{result.count('error') + len(result.problems)} could not be evaluated -> {verdict} "
                 f"(exit {result.exit_code})")
    return "\n".join(lines) + "\n"
