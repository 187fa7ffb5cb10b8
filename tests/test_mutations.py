"""Mutation tests of the shipped gate: one sim run of ``main``, ``pr``, a copy of ``pr`` written with
hooks, five variants of it with one row bug each (tests/fixtures/mutants.py) and ``main`` again as a
plugin arm (a candidate). Every variant fails the shipped rules, ``pr`` passes, ``main`` passes as
the baseline and fails as a candidate; the verdicts come from roles, never from names.

The deploys (tests/data/gate_*.yaml) are the shipped ones shrunk for 4 prompts and named
``reference`` and ``stress``, so the shipped rules apply to them unchanged.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import gate
from harness.report import summary
from harness.config import DEPLOY_DIR
from tests.conftest import REPO, SMALL_PROMPTS, invoke_cli

pytestmark = pytest.mark.slow

DATA = REPO / "tests" / "data"
MUTANTS = {  # arm name -> class in tests/fixtures/mutants.py; each arm fails for its own reason
    "offbyone": "OffByOneDecode",
    "nopad": "NoPersistentPad",
    "sharedpool": "SharedReplyPool",
    "onerow": "OneRowPerSpan",
    "wholeprompt": "WholePromptRows",
}
# arm -> (the failing checks "rule: bound" of the shipped rules over all its cells, exactly those?).
# The first three are what WER alone let through: only the exact contract rules catch them.
EXPECTED_FAILURES = {
    "offbyone": ({"candidate-contract: max_misaligned_text_positions",
                  "candidate-contract: max_misaligned_end_positions"}, True),
    "nopad": ({"candidate-contract: max_misaligned_end_positions"}, True),
    "wholeprompt": ({"candidate-contract: max_row_count_mismatches"}, True),
    "sharedpool": ({"candidate-contract: max_misaligned_text_positions", "candidate-reference-speaks: max_mean_wer"},
                   False),
    "onerow": ({"candidate-contract: max_misaligned_text_positions"}, False),
}


@pytest.fixture(scope="module")
def mutation_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mutations")
    arms = ["--arm", "main", "--arm", "pr", "--arm", "prcopy=tests.fixtures.mutants:PrReimplemented",
            "--arm", "maincand=harness.families.qwen2_5_omni.main:MainTalker"]
    for name, attr in MUTANTS.items():
        arms += ["--arm", f"{name}=tests.fixtures.mutants:{attr}"]
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out),
                     "--run-id", "mut", "--deploy", str(DATA / "gate_reference.yaml"),
                     "--deploy", str(DATA / "gate_stress.yaml"), *arms)
    assert res.exit_code == 0, res.stderr
    return out / "mut"


@pytest.fixture(scope="module")
def cells(mutation_run: Path) -> list[summary.CellSummary]:
    run = summary.load_run(mutation_run)
    assert summary.run_problems(run) == []
    return summary.summarize_cells(run)


def verdict(cells: list[summary.CellSummary], arm: str) -> gate.GateResult:
    """The shipped rules on one arm's cells alone, as if the run had only that arm."""
    return gate.evaluate(gate.load_rules(DEPLOY_DIR / "gates.yaml"), [c for c in cells if c.arm == arm])


def failures(result: gate.GateResult) -> set[str]:
    return {f"{case.rule.name}: {check.bound.key}" for case in result.cases for check in case.checks
            if check.status == "fail"}


def test_roles_come_from_the_config(cells: list[summary.CellSummary]) -> None:
    roles = {c.arm: c.role for c in cells}
    assert roles == {"main": "baseline", "pr": "candidate", "prcopy": "candidate", "maincand": "candidate",
                     **{name: "candidate" for name in MUTANTS}}


def test_pr_and_its_copy_pass(cells: list[summary.CellSummary]) -> None:
    for arm in ("pr", "prcopy"):
        result = verdict(cells, arm)
        assert result.exit_code == 0, gate.format_result(result)
        assert [c.status for c in result.cases] == ["pass"] * 4  # contract x2, reference-speaks, stress
        stress = next(c for c in cells if (c.arm, c.deploy) == (arm, "stress"))
        assert stress.events.cross_boundary_replays >= 1 and stress.events.nonzero_offset_chunks >= 1


def test_main_passes_as_baseline_and_fails_as_candidate(cells: list[summary.CellSummary]) -> None:
    result = verdict(cells, "main")
    assert result.exit_code == 0, gate.format_result(result)
    assert [(c.rule.name, c.status) for c in result.cases] == [("baseline-reference-speaks", "pass"),
                                                               ("baseline-stress-shows-bug", "pass")]
    result = verdict(cells, "maincand")  # the same code, recorded as a candidate
    assert result.exit_code == 1
    assert failures(result) >= {"candidate-contract: max_misaligned_text_positions",
                                "candidate-contract: max_misaligned_end_positions",
                                "candidate-contract: max_row_count_mismatches",
                                "candidate-stress-matches-reference: max_wer_delta",
                                "candidate-stress-matches-reference: max_requests_over"}


@pytest.mark.parametrize("arm", list(MUTANTS))
def test_every_mutant_fails_the_shipped_rules(cells: list[summary.CellSummary], arm: str) -> None:
    result = verdict(cells, arm)
    assert result.exit_code == 1, gate.format_result(result)
    expected, exact = EXPECTED_FAILURES[arm]
    got = failures(result)
    assert (got == expected) if exact else (got >= expected), gate.format_result(result)


def test_the_regions(cells: list[summary.CellSummary]) -> None:
    """0.30.0 unstressed: one text-region position per request (it appends no text-EOS row), the rest
    after text-EOS; a dropped text-PAD only shows after text-EOS; pr: none."""
    by = {(c.arm, c.deploy): c for c in cells}
    main_ref = by[("main", "reference")].events
    assert main_ref.misaligned_text_positions == 4 and main_ref.misaligned_end_positions > 100
    nopad = by[("nopad", "reference")].events
    assert nopad.misaligned_text_positions == 0 and nopad.misaligned_end_positions == main_ref.misaligned_end_positions
    assert by[("nopad", "reference")].mean_wer == 0.0  # WER cannot see it
    offbyone = by[("offbyone", "reference")]
    assert offbyone.mean_wer is not None and offbyone.mean_wer < 0.05  # nor this one: reference-relative rules pass
    for deploy in ("reference", "stress"):
        ev = by[("pr", deploy)].events
        assert (ev.misaligned_text_positions, ev.misaligned_end_positions, ev.row_count_mismatches) == (0, 0, 0)
    onerow = by[("onerow", "reference")].events
    assert onerow.misaligned_positions == 0  # stress-only bug
    assert by[("wholeprompt", "stress")].events.misaligned_positions == 0  # rows right, count wrong


def test_gate_cli_on_the_whole_run(mutation_run: Path, tmp_path: Path) -> None:
    junit = tmp_path / "gate.xml"
    res = invoke_cli("gate", str(mutation_run), "--junit", str(junit))
    assert res.exit_code == 1
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    failed_arms = {tc.get("name", "").split(": ")[1].split("/")[0] for tc in suite.findall("testcase")
                   if tc.find("failure") is not None}
    assert failed_arms == {"maincand", *MUTANTS}
    assert int(suite.get("errors", "-1")) == 0
    data = json.loads((mutation_run / "summary.json").read_text())
    assert data["complete"] is True and data["roles"]["main"] == "baseline"
