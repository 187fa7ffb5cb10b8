"""The CI gate: rules from YAML, evaluated per cell, verdict as exit code and JUnit XML.

Pure except ``load_rules`` (reads the YAML). The gate never decides anything from an arm's or a
deploy's name: a rule selects arms by **role** (``baseline`` / ``candidate``, from arms.yaml via
the run's manifest) or by a name the rules file gives, and which deploy is the WER baseline,
which deploys must show stress and which arms are expected to fail all come from the rules file.

Rules file (``deploy_configs/gates.yaml``)::

    wer_threshold: 0.5            # "requests over" counts requests with WER above this
    reference_deploy: pair        # baseline deploy of wer_delta / worst_paired_delta: "pair" (the
                                  # default) is each deploy's declared pair, else a name or a pattern
    rules:
      - name: candidate-contract
        role: candidate           # baseline, candidate or "*" (default "*")
        deploy: "*"               # deploy name or "*"
        deploy_role: "*"          # reference, stress or "*" (default "*"): the deploy's declared role
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config import DEPLOY_DIR, load_yaml
from harness.errors import ConfigError, UserError, short_repr
from harness.metrics import METRICS as COUNT_METRICS
from harness.metrics import MISALIGNED_COUNTS, RECORD_COUNTS, STRESS_METRICS
from harness.roles import DEPLOY_ROLES
from harness.streaming_figures import RATIO_METRICS, STREAM_METRICS
from harness.report.summary import (
    ROLES,
    CellSummary,
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
    "crashed": "requests a server crash took down",
    **STREAM_METRICS,  # streamed cells only (harness.streaming_figures); skipped where nothing streamed
    **RATIO_METRICS,
}
WER_METRICS = ("mean_wer", "wer_delta", "worst_paired_delta", "worst_of_repeats_mean_wer")
REFERENCE_METRICS = ("wer_delta", "worst_paired_delta", *RATIO_METRICS)  # need reference_deploy
MISALIGNED_METRICS = tuple(MISALIGNED_COUNTS)
# Bounds that only say whether a stress deploy stressed: a map (harness.sweep.gate) judges that per point itself
EVIDENCE_METRICS = (*STRESS_METRICS, *RECORD_COUNTS)
# Bounds that show the bug is detected (an expect: fail rule needs one, and no max_ on a WER metric).
DETECTION_METRICS = ("mean_wer", "requests_over", "wer_delta", "worst_paired_delta", "worst_of_repeats_mean_wer",
                     "worst_of_repeats_requests_over", "row_count_mismatches", *MISALIGNED_METRICS)
NO_MAX_WHEN_FAIL = ("mean_wer", "requests_over", "wer_delta", "worst_paired_delta", "worst_of_repeats_mean_wer",
                    "worst_of_repeats_requests_over")
RULE_KEYS = {"name", "arm", "role", "deploy", "deploy_role", "expect", "stress", "reference_deploy", "optional",
             "description"}
PAIR = "pair"  # reference_deploy: each deploy's declared pair (harness.roles), the default
TOP_KEYS = {"family", "wer_threshold", "reference_deploy", "rules"}


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
    reference_deploy: str = PAIR
    optional: bool = False  # true: matching no cell is fine (else the gate cannot evaluate)
    description: str = ""
    role: str = "*"  # baseline, candidate or "*"
    deploy_role: str = "*"  # reference, stress or "*" (harness.roles)

    @property
    def reference_target(self) -> str | None:
        """The ``reference_deploy`` that ``summary.reference_cell`` takes: None for ``pair``."""
        return None if self.reference_deploy == PAIR else self.reference_deploy

    @property
    def names_arm(self) -> bool:
        """The rule names one arm (no pattern): it overrides role and pattern rules on its cells."""
        return not _is_pattern(self.arm)

    def selects(self, arm: str, role: str) -> bool:
        return _match(self.arm, arm) and (self.role == "*" or self.role == role)

    def matches(self, cell: CellSummary) -> bool:
        return (self.selects(cell.arm, cell.role) and _match(self.deploy, cell.deploy)
                and self.deploy_role in ("*", cell.deploy_role))

    @property
    def selector(self) -> str:
        parts = [] if self.arm == "*" else [f"arm {self.arm!r}"]
        parts += [] if self.role == "*" else [f"role {self.role!r}"]
        parts += [f"deploy {self.deploy!r}"]
        parts += [] if self.deploy_role == "*" else [f"deploy role {self.deploy_role!r}"]
        return " x ".join(parts)


def _is_pattern(text: str) -> bool:
    return text == "*" or any(c in text for c in "*?[")


def _match(pattern: str, name: str) -> bool:
    return pattern == "*" or (fnmatch.fnmatchcase(name, pattern) if _is_pattern(pattern) else pattern == name)


@dataclass(frozen=True)
class Rules:
    rules: tuple[Rule, ...]
    wer_threshold: float = 0.5
    source: str = "<rules>"
    family: str | None = None  # the model family the rules are written for (None: not said, any family)


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
    family = data.get("family")
    if family is not None:
        from harness.family import family_names

        if _string(source, "family", family) not in family_names():
            raise ConfigError(f"{source}: family: unknown model family {short_repr(family)} "
                              f"(known: {', '.join(family_names())})")
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
    return Rules(rules=tuple(rules), wer_threshold=threshold, source=source, family=family)


def check_rules_family(rules: Rules, family: str, what: str, any_family: bool = False) -> None:
    """Refuses rules written for another model family than the run's (their bounds and deploy patterns
    mean something else there), unless ``any_family``; rules that name no family apply to any."""
    if rules.family is None or rules.family == family or any_family:
        return
    raise UserError(f"--rules {rules.source}: rules for the {rules.family} family, but {what} is of family "
                    f"{family}; give --any-family to apply them anyway")


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
        lo = -1.0 if metric in REFERENCE_METRICS and metric not in RATIO_METRICS else 0.0
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
    # the evidence counted from each request's text comes after the scheduler's own (a stress run that never
    # chunked or replayed is named as such first)
    bounds.sort(key=lambda b: b.op == "min" and b.metric in RECORD_COUNTS)
    if expect == "fail":
        if not any(f"min_{m}" in keys for m in DETECTION_METRICS):
            raise ConfigError(f"{source}: {where}: expect: fail needs a detection bound "
                              f"({', '.join('min_' + m for m in DETECTION_METRICS)})")
        clash = sorted(k for k in keys if k in {f"max_{m}" for m in NO_MAX_WHEN_FAIL})
        if clash:
            raise ConfigError(f"{source}: {where}: expect: fail contradicts {', '.join(clash)}")
    ref = _string(source, f"{where}.reference_deploy", item.get("reference_deploy", default_ref or PAIR))
    deploy_role = _string(source, f"{where}.deploy_role", item.get("deploy_role", "*"))
    if deploy_role != "*" and deploy_role not in DEPLOY_ROLES:
        raise ConfigError(f"{source}: {where}.deploy_role: must be {', '.join(DEPLOY_ROLES)} or \"*\", "
                          f"got {short_repr(deploy_role)}")
    if not bounds:
        raise ConfigError(f"{source}: {where}: no bound (give at least one min_<metric> or max_<metric>)")
    description = item.get("description", "")
    return Rule(name=name, arm=arm, deploy=deploy, bounds=tuple(bounds), expect=expect, stress=stress,
                reference_deploy=ref, optional=optional, description=str(description), role=role,
                deploy_role=deploy_role)


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


def family_rules_path(family: str, where: str = "--family") -> Path:
    """The default rules of a run of ``family`` (``Family.gate_rules``: ``gates`` for Qwen2.5-Omni): what
    ``gate``, ``sweep`` and ``report`` read when no ``--rules`` is given."""
    from harness.family import get_family

    return resolve_rules_path(get_family(family, where).gate_rules)
