"""The CI verdict: gate rules per arm role, loaded and validated (``rules``), evaluated over a run's
cells (``evaluate``), written as JUnit XML for CI (``junit``). The package's names are the gate's API
(``from harness import gate``; ``gate.load_rules``, ``gate.evaluate``, ``gate.junit_xml``)."""

from harness.gate.rules import (  # noqa: F401
    Bound,
    DEFAULT_RULES,
    METRICS,
    DETECTION_METRICS,
    MISALIGNED_METRICS,
    NO_MAX_WHEN_FAIL,
    REFERENCE_METRICS,
    RULE_KEYS,
    Rule,
    Rules,
    STRESS_METRICS,
    TOP_KEYS,
    WER_METRICS,
    check_rules_family,
    family_rules_path,
    load_rules,
    parse_rules,
    resolve_rules_path,
)
from harness.gate.evaluate import (  # noqa: F401
    CaseResult,
    CheckResult,
    GateResult,
    check,
    evaluate,
    format_result,
)
from harness.gate.junit import (  # noqa: F401
    junit_error_xml,
    junit_xml,
)
