"""The CI gate: rules from YAML, evaluated per cell, verdict as exit code and JUnit XML.

Pure except ``load_rules`` (reads the YAML). The gate never decides anything from an arm's or a
deploy's name: a rule selects arms by **role** (``baseline`` / ``candidate``, from arms.yaml via
the run's manifest) or by a name the rules file gives, and which deploy is the WER baseline,
which deploys must show stress and which arms are expected to fail all come from the rules file.

Rules file (``deploy_configs/gates.yaml``)::

    wer_threshold: 0.5            # "requests over" counts requests with WER above this
    reference_deploy: reference   # baseline deploy of wer_delta / worst_paired_delta
    rules:
      - name: candidate-contract
        role: candidate           # baseline, candidate or "*" (default "*")
        deploy: "*"               # deploy name or "*"
        max_misaligned_text_positions: 0
        max_row_count_mismatches: 0
      - name: baseline-stress-shows-bug
        role: baseline
        deploy: stress
        expect: fail              # the harness must still detect the bug
        stress: true              # a stress run that stressed nothing cannot pass
        min_misaligned_text_positions: 1
      - name: my-arm-stress       # a rule naming an arm overrides, on the cells it matches,
        arm: myarm                # every rule that selects by role or by pattern
        deploy: stress
        max_wer_delta: 0.05

Every metric takes ``max_<metric>`` and/or ``min_<metric>`` (see ``METRICS``). A rule is checked
once per matching cell (arm x deploy x repeat): one JUnit testcase per rule x cell. Exit codes:
0 every check passed, 1 a check failed, 2 the run could not be evaluated (an incomplete run, a
rule that matches no cell, a cell with no requests, a missing reference cell).
"""

from __future__ import annotations

import fnmatch
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config import DEPLOY_DIR, load_yaml
from harness.errors import ConfigError, short_repr
from harness.metrics import METRICS as COUNT_METRICS
from harness.metrics import MISALIGNED_COUNTS, STRESS_METRICS
from harness.summary import (
    ROLES,
    CellKey,
    CellSummary,
    reference_cell,
    repeat_group,
    worst_of_repeats,
    worst_paired_delta,
)

DEFAULT_RULES = DEPLOY_DIR / "gates.yaml"

# metric -> what it measures (messages and docs): the WER metrics are the gate's own, the counts
# are harness.metrics' (their labels defined once there)
METRICS: dict[str, str] = {
    "mean_wer": "mean WER",
    "requests_over": "requests with WER over the threshold",
    "wer_delta": "mean WER minus the reference deploy's mean WER",
    "worst_paired_delta": "largest per-prompt WER increase over the same prompt in the reference deploy",
    "worst_of_repeats_mean_wer": "mean over prompts of each prompt's worst WER over the repeats",
    "worst_of_repeats_requests_over": "prompts with WER over the threshold in at least one repeat",
    **{m.name: m.label for m in COUNT_METRICS if m.gate},
    "preemptions": "preemptions",
    "errors": "requests that ended in an error",
}
WER_METRICS = ("mean_wer", "wer_delta", "worst_paired_delta", "worst_of_repeats_mean_wer")
REFERENCE_METRICS = ("wer_delta", "worst_paired_delta")  # need reference_deploy
MISALIGNED_METRICS = tuple(MISALIGNED_COUNTS)
# Bounds that show the bug is detected (an expect: fail rule needs one, and no max_ on a WER metric).
DETECTION_METRICS = ("mean_wer", "requests_over", "wer_delta", "worst_paired_delta", "worst_of_repeats_mean_wer",
                     "worst_of_repeats_requests_over", "row_count_mismatches", *MISALIGNED_METRICS)
NO_MAX_WHEN_FAIL = ("mean_wer", "requests_over", "wer_delta", "worst_paired_delta", "worst_of_repeats_mean_wer",
                    "worst_of_repeats_requests_over")
RULE_KEYS = {"name", "arm", "role", "deploy", "expect", "stress", "reference_deploy", "optional", "description"}
TOP_KEYS = {"wer_threshold", "reference_deploy", "rules"}


@dataclass(frozen=True)
class Bound:
    metric: str
    op: str  # "min" or "max"
    limit: float

    @property
    def key(self) -> str:
        return f"{self.op}_{self.metric}"


@dataclass(frozen=True)
class Rule:
    name: str
    arm: str  # name, glob or "*"
    deploy: str  # name, glob or "*"
    bounds: tuple[Bound, ...]
    expect: str = "pass"  # "fail": the arm is known-broken, the checks assert the bug is detected
    stress: bool = False
    reference_deploy: str | None = None
    optional: bool = False  # true: matching no cell is fine (else the gate cannot evaluate)
    description: str = ""
    role: str = "*"  # baseline, candidate or "*"

    @property
    def names_arm(self) -> bool:
        """The rule names one arm (no pattern): it overrides role and pattern rules on its cells."""
        return not _is_pattern(self.arm)

    def selects(self, arm: str, role: str) -> bool:
        return _match(self.arm, arm) and (self.role == "*" or self.role == role)

    def matches(self, cell: CellSummary) -> bool:
        return self.selects(cell.arm, cell.role) and _match(self.deploy, cell.deploy)

    @property
    def selector(self) -> str:
        parts = [] if self.arm == "*" else [f"arm {self.arm!r}"]
        parts += [] if self.role == "*" else [f"role {self.role!r}"]
        return " x ".join(parts + [f"deploy {self.deploy!r}"])


def _is_pattern(text: str) -> bool:
    return text == "*" or any(c in text for c in "*?[")


def _match(pattern: str, name: str) -> bool:
    return pattern == "*" or (fnmatch.fnmatchcase(name, pattern) if _is_pattern(pattern) else pattern == name)


@dataclass(frozen=True)
class Rules:
    rules: tuple[Rule, ...]
    wer_threshold: float = 0.5
    source: str = "<rules>"


# --------------------------------------------------------------------------- parsing


def _number(source: str, where: str, value: Any, lo: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= lo or value == float("inf"):
        raise ConfigError(f"{source}: {where}: must be a finite number >= {lo:g}, got {short_repr(value)}")
    return float(value)


def _string(source: str, where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}: {where}: must be a non-empty string, got {short_repr(value)}")
    return value


def _bool(source: str, where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {where}: must be true or false, got {short_repr(value)}")
    return value


def parse_rules(data: Any, source: str = "<rules>") -> Rules:
    """Validates a loaded rules document; every error names the file, the rule and the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level: expected a mapping with a 'rules' list")
    for key in data:
        if key not in TOP_KEYS:
            raise ConfigError(f"{source}: {key}: unknown key (allowed: {', '.join(sorted(TOP_KEYS))})")
    threshold = _number(source, "wer_threshold", data.get("wer_threshold", 0.5))
    default_ref = data.get("reference_deploy")
    if default_ref is not None:
        _string(source, "reference_deploy", default_ref)
    raw = data.get("rules")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: rules: expected a non-empty list of rules")
    rules = []
    names: set[str] = set()
    for i, item in enumerate(raw):
        rule = _parse_rule(item, f"rules[{i}]", source, default_ref)
        if rule.name in names:
            raise ConfigError(f"{source}: rules[{i}].name: duplicate rule name {rule.name!r}")
        names.add(rule.name)
        rules.append(rule)
    return Rules(rules=tuple(rules), wer_threshold=threshold, source=source)


def _parse_rule(item: Any, where: str, source: str, default_ref: str | None) -> Rule:
    if not isinstance(item, dict):
        raise ConfigError(f"{source}: {where}: expected a mapping, got {type(item).__name__}")
    if "deploy" not in item or ("arm" not in item and "role" not in item):
        raise ConfigError(f"{source}: {where}: needs 'deploy' and 'arm' or 'role' (a name or \"*\")")
    arm = _string(source, f"{where}.arm", item.get("arm", "*"))
    role = _string(source, f"{where}.role", item.get("role", "*"))
    if role != "*" and role not in ROLES:
        raise ConfigError(f"{source}: {where}.role: must be {', '.join(ROLES)} or \"*\", got {short_repr(role)}")
    deploy = _string(source, f"{where}.deploy", item["deploy"])
    default_name = f"{arm}/{deploy}" if "arm" in item else f"{role}/{deploy}"
    name = _string(source, f"{where}.name", item.get("name", default_name))
    where = f"{where} ({name})"
    metric_keys = {f"{op}_{m}" for m in METRICS for op in ("min", "max")}
    bounds: list[Bound] = []
    for key, value in item.items():
        if key in RULE_KEYS:
            continue
        if key not in metric_keys:
            allowed = ", ".join(sorted(RULE_KEYS) + ["min_<metric>", "max_<metric>"])
            raise ConfigError(f"{source}: {where}.{key}: unknown key (allowed: {allowed}; metrics: "
                              f"{', '.join(METRICS)})")
        op, metric = key.split("_", 1)
        lo = -1.0 if metric in REFERENCE_METRICS else 0.0
        bounds.append(Bound(metric, op, _number(source, f"{where}.{key}", value, lo)))
    expect = item.get("expect", "pass")
    if expect not in ("pass", "fail"):
        raise ConfigError(f"{source}: {where}.expect: must be 'pass' or 'fail', got {short_repr(expect)}")
    stress = _bool(source, f"{where}.stress", item.get("stress", False))
    optional = _bool(source, f"{where}.optional", item.get("optional", False))
    keys = {b.key for b in bounds}
    if stress:
        for metric in STRESS_METRICS:
            given = next((b for b in bounds if b.key == f"min_{metric}"), None)
            if given is None:
                bounds.append(Bound(metric, "min", 1.0))
            elif given.limit < 1:
                raise ConfigError(f"{source}: {where}.min_{metric}: must be >= 1 with stress: true "
                                  f"(a stress deploy that stressed nothing must fail)")
    if expect == "fail":
        if not any(f"min_{m}" in keys for m in DETECTION_METRICS):
            raise ConfigError(f"{source}: {where}: expect: fail needs a detection bound "
                              f"({', '.join('min_' + m for m in DETECTION_METRICS)})")
        clash = sorted(k for k in keys if k in {f"max_{m}" for m in NO_MAX_WHEN_FAIL})
        if clash:
            raise ConfigError(f"{source}: {where}: expect: fail contradicts {', '.join(clash)}")
    ref = item.get("reference_deploy", default_ref)
    if ref is not None:
        ref = _string(source, f"{where}.reference_deploy", ref)
    if any(b.metric in REFERENCE_METRICS for b in bounds) and ref is None:
        raise ConfigError(f"{source}: {where}: a {' / '.join(REFERENCE_METRICS)} bound needs reference_deploy "
                          f"(in the rule or at the top level)")
    if not bounds:
        raise ConfigError(f"{source}: {where}: no bound (give at least one min_<metric> or max_<metric>)")
    description = item.get("description", "")
    return Rule(name=name, arm=arm, deploy=deploy, bounds=tuple(bounds), expect=expect, stress=stress,
                reference_deploy=ref, optional=optional, description=str(description), role=role)


def load_rules(path: Path) -> Rules:
    """Reads and validates a rules file; ConfigError (exit 2) names the file and the key."""
    return parse_rules(load_yaml(Path(path)), str(path))


def resolve_rules_path(text: str | None) -> Path:
    """A path, or a bare name looked up in deploy_configs/ (``gates`` -> deploy_configs/gates.yaml)."""
    if text is None:
        return DEFAULT_RULES
    path = Path(text)
    if path.exists() or "/" in text or path.suffix in (".yaml", ".yml"):
        return path
    return DEPLOY_DIR / f"{text}.yaml"


# --------------------------------------------------------------------------- evaluation


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
        statuses = {c.status for c in self.checks}
        if statuses == {"skip"}:
            return "skip"
        return "error" if "error" in statuses else "fail" if "fail" in statuses else "pass"

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
        if self.problems or self.count("error"):
            return 2
        return 1 if self.count("fail") else 0


def _fmt(metric: str, value: float) -> str:
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
    if metric in ("preemptions", "errors"):
        return float(getattr(cell, metric))
    if metric in MISALIGNED_METRICS and not cell.misaligned_known:
        return math.nan  # the backend does not measure it
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
    ref_note = ""
    if bound.metric not in REFERENCE_METRICS:
        value = _metric_value(cell, bound.metric, cells, threshold)
    else:
        assert rule.reference_deploy is not None  # parse_rules guarantees it
        ref = reference_cell(cell, rule.reference_deploy, cells)
        if ref is None:
            return CheckResult(bound, None, "error", f"{bound.key}: no {cell.arm}/{rule.reference_deploy} cell "
                                                     f"for run {cell.run_number} in this run")
        if bound.metric == "wer_delta":
            value = None if cell.mean_wer is None or ref.mean_wer is None else cell.mean_wer - ref.mean_wer
            if value is not None:
                ref_note = f" (vs {ref.arm}/{ref.deploy} run {ref.run_number}: {ref.mean_wer:.3f})"
        else:
            value = worst_paired_delta(cell, cells, rule.reference_deploy)
            worst = _worst_pair(cell, ref)
            if value is not None and worst is not None:
                ref_note = f" (prompt {worst[0]}: {worst[2]:.3f} vs {worst[1]:.3f} in {ref.arm}/{ref.deploy})"
    if value is None:
        return CheckResult(bound, None, "error", f"{bound.key}: {what} unknown (no scored requests or no data)")
    if math.isnan(value):
        return CheckResult(bound, None, "skip", f"{bound.key}: {what} not measured by this backend (skipped)")
    ok = value <= bound.limit if bound.op == "max" else value >= bound.limit
    sign = ("<=" if ok else ">") if bound.op == "max" else (">=" if ok else "<")
    text = f"{what} = {_fmt(bound.metric, value)} {sign} {_fmt(bound.metric, bound.limit)}{ref_note}"
    if rule.expect == "fail" and bound.op == "min" and bound.metric in DETECTION_METRICS:
        text = f"bug detected: {text}" if ok else f"expected failure NOT detected: {text}"
    return CheckResult(bound, value, "pass" if ok else "fail", f"{bound.key}: {text}")


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
            result.cases.append(CaseResult(rule, cell, checks))
    result.uncovered = [c.key for c in cells if c.key not in covered]
    return result


# --------------------------------------------------------------------------- output


def format_result(result: GateResult) -> str:
    """Plain text: one line per testcase, its checks indented, then the verdict."""
    mark = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skip": "SKIP"}
    lines = []
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
    skipped = f", {result.count('skip')} skipped" if result.count("skip") else ""
    lines.append(f"gate: {result.count('pass')} passed, {result.count('fail')} failed{skipped}, "
                 f"{result.count('error') + len(result.problems)} could not be evaluated -> {verdict} "
                 f"(exit {result.exit_code})")
    return "\n".join(lines) + "\n"


def junit_xml(result: GateResult, suite: str = "omni-stress gate") -> str:
    """JUnit XML: one testcase per rule x cell; failures and errors carry the check messages."""
    tests = len(result.cases) + len(result.problems)
    failures = result.count("fail")
    errors = result.count("error") + len(result.problems)
    name = f"{suite}: {result.run_id}" if result.run_id else suite
    root = ET.Element("testsuites", name=suite, tests=str(tests), failures=str(failures), errors=str(errors))
    ts = ET.SubElement(root, "testsuite", name=name, tests=str(tests), failures=str(failures), errors=str(errors),
                       skipped=str(result.count("skip")), time="0")
    for case in result.cases:
        tc = ET.SubElement(ts, "testcase", classname=f"omni-stress.gate.{case.rule.name}",
                           name=f"{case.rule.name}: {case.cell_label}", time="0")
        if case.status in ("fail", "error"):
            tag = "failure" if case.status == "fail" else "error"
            el = ET.SubElement(tc, tag, message=case.message, type=f"gate.{tag}")
            el.text = case.message
        elif case.status == "skip":
            ET.SubElement(tc, "skipped", message=case.message)
        out = ET.SubElement(tc, "system-out")
        out.text = "\n".join(f"{c.status}: {c.message}" for c in case.checks)
    for i, problem in enumerate(result.problems):
        tc = ET.SubElement(ts, "testcase", classname="omni-stress.gate", name=f"could not evaluate ({i + 1})",
                           time="0")
        el = ET.SubElement(tc, "error", message=problem, type="gate.error")
        el.text = problem
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def junit_error_xml(message: str, suite: str = "omni-stress gate") -> str:
    """A JUnit file for a gate that could not start (bad rules, missing run), so CI shows why."""
    return junit_xml(GateResult(cases=[], problems=[message]), suite)
