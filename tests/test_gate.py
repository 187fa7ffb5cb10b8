"""The CI gate: each rule passes and fails, roles and name overrides, vacuous stress runs fail, paired and
worst-of-repeats metrics, complete runs only, JUnit parses, exit codes 0/1/2."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from conftest import run_cli
from harness import gate
from harness.cli import main
from harness.config import DEPLOY_DIR
from harness.errors import ConfigError
from harness.records import EventCounts, JsonlWriter, RequestRecord, write_manifest
from harness.report.summary import CellSummary


def cell(arm: str, deploy: str, repeat: int = 1, wer: float = 0.0, over: int = 0, chunks: int = 0,
         replays: int = 0, mismatches: int = 0, errors: int = 0, requests: int = 16,
         misaligned_known: bool = True, role: str = "candidate", text: int = 0, end: int = 0,
         scores: list[float] | None = None, in_text: int | None = None) -> CellSummary:
    """A cell whose scores have exactly this mean and this many requests over 0.5 (or exactly ``scores``),
    one request record per score (prompts p00, p01, ...). ``in_text``: its replays ending inside the text
    region (default: every replay)."""
    if scores is None:
        scores = [0.9] * over + [0.0] * (requests - over)
        if requests:
            scores[-1] += wer * requests - sum(scores)
    ev = EventCounts(nonzero_offset_chunks=chunks, cross_boundary_replays=replays, row_count_mismatches=mismatches,
                     misaligned_text_positions=text, misaligned_end_positions=end, misaligned_positions=text + end,
                     replays_ending_in_text=replays if in_text is None else in_text)
    records = [RequestRecord(arm=arm, deploy=deploy, repeat=repeat, prompt_id=f"p{i:02d}", backend="sim",
                             reference_text="a b", wer=s) for i, s in enumerate(scores)]
    return CellSummary(arm=arm, deploy=deploy, repeat=repeat, requests=len(scores), scores=list(scores),
                       oracle_scores=[], events=ev, event_source="spans", misaligned_known=misaligned_known,
                       preemptions=0, errors=errors, wall_s=1.0, wer_source="whisper", run_number=repeat, role=role,
                       records=records)


def rules(*items: dict[str, Any], **top: Any) -> gate.Rules:
    return gate.parse_rules({"rules": list(items), **top}, "test.yaml")


def statuses(result: gate.GateResult) -> list[tuple[str, str]]:
    return [(f"{c.rule.name}:{c.cell.arm}/{c.cell.deploy}/{c.cell.repeat}", c.status) for c in result.cases]


GOOD = [
    cell("main", "reference", wer=0.017, role="baseline", text=16, end=11137),
    cell("main", "stress", wer=0.933, over=16, chunks=45, replays=7, mismatches=68, role="baseline", text=2499,
         end=18316),
    cell("main", "stress", 2, wer=0.925, over=16, chunks=47, replays=8, mismatches=71, role="baseline", text=2500,
         end=18000),
    cell("pr", "reference", wer=0.020), cell("pr", "stress", wer=0.016, chunks=91, replays=26),
    cell("pr", "stress", 2, wer=0.016, chunks=92, replays=26),
]


def test_default_rules_pass_on_the_seed_numbers() -> None:
    default = gate.load_rules(DEPLOY_DIR / "gates.yaml")
    result = gate.evaluate(default, GOOD, run_id="seed")
    assert result.exit_code == 0, gate.format_result(result)
    assert statuses(result) == [
        ("candidate-contract:pr/reference/1", "pass"), ("candidate-contract:pr/stress/1", "pass"),
        ("candidate-contract:pr/stress/2", "pass"), ("candidate-reference-speaks:pr/reference/1", "pass"),
        ("candidate-stress-matches-reference:pr/stress/1", "pass"),
        ("candidate-stress-matches-reference:pr/stress/2", "pass"),
        ("baseline-reference-speaks:main/reference/1", "pass"), ("baseline-stress-shows-bug:main/stress/1", "pass"),
        ("baseline-stress-shows-bug:main/stress/2", "pass")]
    assert not result.uncovered and not result.notes
    text = gate.format_result(result)
    assert "bug detected: mean WER = 0.933 >= 0.500" in text
    assert "bug detected: misaligned positions in the text region = 2499 >= 1" in text
    assert text.rstrip().endswith("gate: 9 passed, 0 failed, 0 could not be evaluated -> pass (exit 0)")


def test_default_rules_fail_main_as_a_candidate() -> None:
    """The same numbers with main's role changed in the config: the exact rules fail it (no name decides)."""
    default = gate.load_rules(DEPLOY_DIR / "gates.yaml")
    as_candidate = [dataclasses.replace(c, role="candidate") for c in GOOD]
    result = gate.evaluate(default, as_candidate)
    assert result.exit_code == 1
    failed = [k for k, status in statuses(result) if status == "fail"]
    assert failed == ["candidate-contract:main/reference/1", "candidate-contract:main/stress/1",
                      "candidate-contract:main/stress/2", "candidate-stress-matches-reference:main/stress/1",
                      "candidate-stress-matches-reference:main/stress/2"]
    assert result.notes == ["rule 'baseline-reference-speaks' not applied: no baseline arm in this run",
                            "rule 'baseline-stress-shows-bug' not applied: no baseline arm in this run"]
    msg = next(c for c in result.cases if c.cell.key == ("main", "reference", 1)).message
    assert msg == "max_misaligned_text_positions: misaligned positions in the text region = 16 > 0; " \
                  "max_misaligned_end_positions: misaligned positions in the end region = 11137 > 0"


def test_any_arm_gets_a_verdict_by_role() -> None:
    """A plugin arm (a candidate by default) is gated by the shipped rules: no 'not gated', no exit 2."""
    default = gate.load_rules(DEPLOY_DIR / "gates.yaml")
    mine = [cell("mine", "reference", wer=0.02), cell("mine", "stress", wer=0.02, chunks=30, replays=4)]
    assert gate.evaluate(default, mine).exit_code == 0
    # one text-region position misaligned, WER untouched: the exact rule fails it
    result = gate.evaluate(default, [mine[0], cell("mine", "stress", wer=0.02, chunks=30, replays=4, text=1)])
    assert result.exit_code == 1 and statuses(result)[1] == ("candidate-contract:mine/stress/1", "fail")
    # the end region alone (a dropped persistent text-PAD) fails too
    result = gate.evaluate(default, [mine[0], cell("mine", "stress", wer=0.02, chunks=30, replays=4, end=5)])
    assert result.exit_code == 1
    assert "max_misaligned_end_positions: misaligned positions in the end region = 5 > 0" in result.cases[1].message
    # not measured by the backend (real server without the row check): skipped, the rest still decides
    unmeasured = [cell("mine", "reference", misaligned_known=False),
                  cell("mine", "stress", chunks=3, replays=1, misaligned_known=False)]
    for c in unmeasured:
        c.trace = "spans"
    result = gate.evaluate(default, unmeasured)
    assert result.exit_code == 0
    assert [(c.bound.metric, c.status) for c in result.cases[0].checks] == [
        ("misaligned_text_positions", "skip"), ("misaligned_end_positions", "skip"),
        ("cross_request_positions", "skip"), ("row_count_mismatches", "pass"), ("errors", "pass")]


def _stress_evidence(result: Any) -> list[tuple[str, str, float | None]]:
    return [(c.bound.metric, c.status, c.value) for case in result.cases for c in case.checks
            if c.bound.metric == "replays_ending_in_text"]


def test_a_real_cell_counts_replays_ending_in_text_where_its_worker_reported_the_text() -> None:
    """Issue 45, item 4: a real cell's records count the replays ending inside the text where the worker's
    contract check reported each request's text length (``RequestRecord.text_len``); without it (an older run,
    a family whose worker does not check the contract) the bound is skipped, as before. Cross-request positions
    stay the sim's."""
    default = gate.load_rules(DEPLOY_DIR / "gates.yaml")
    ref = cell("main", "reference", misaligned_known=False)
    real = cell("main", "stress", wer=0.9, over=16, chunks=3, replays=2, in_text=0, misaligned_known=False)
    for c in (ref, real):
        c.trace = "contract"
    assert _stress_evidence(gate.evaluate(default, [ref, real])) == [("replays_ending_in_text", "skip", None)]
    for r in real.records:
        r.text_len = 40
    result = gate.evaluate(default, [ref, real])
    assert _stress_evidence(result) == [("replays_ending_in_text", "fail", 0.0)]
    assert "min_replays_ending_in_text: multi-position spans (replays, their chunks, verify spans) ending inside " \
           "the text region = 0 < 1" in gate.format_result(result)
    real.events.replays_ending_in_text = 2
    assert _stress_evidence(gate.evaluate(default, [ref, real])) == [("replays_ending_in_text", "pass", 2.0)]
    real.records[0].text_len = None  # one request the worker did not report: the cell's count is not known
    assert _stress_evidence(gate.evaluate(default, [ref, real])) == [("replays_ending_in_text", "skip", None)]


def test_a_rule_naming_an_arm_overrides_role_rules() -> None:
    r = rules({"name": "cand-stress", "role": "candidate", "deploy": "stress", "max_mean_wer": 0.05},
              {"name": "cand-any", "role": "candidate", "deploy": "*", "max_errors": 0},
              {"name": "mine-stress", "arm": "mine", "deploy": "stress", "max_mean_wer": 0.3})
    cells = [cell("mine", "reference"), cell("mine", "stress", wer=0.2), cell("other", "stress", wer=0.2)]
    result = gate.evaluate(r, cells)
    assert statuses(result) == [("cand-stress:other/stress/1", "fail"), ("cand-any:mine/reference/1", "pass"),
                                ("cand-any:other/stress/1", "pass"), ("mine-stress:mine/stress/1", "pass")]
    assert result.overridden == [("cand-stress", ("mine", "stress", 1), "mine-stress"),
                                 ("cand-any", ("mine", "stress", 1), "mine-stress")]
    assert "note   rule 'cand-stress' not applied to mine/stress repeat 1: overridden by 'mine-stress', which " \
           "names the arm" in gate.format_result(result)


def test_role_rule_without_arms_of_its_role_is_a_note_but_a_missing_deploy_cannot_evaluate() -> None:
    r = rules({"name": "base", "role": "baseline", "deploy": "stress", "expect": "fail", "min_mean_wer": 0.5},
              {"name": "cand", "role": "candidate", "deploy": "stress", "max_mean_wer": 0.1})
    result = gate.evaluate(r, [cell("pr", "reference")])
    assert result.exit_code == 2 and result.notes == ["rule 'base' not applied: no baseline arm in this run"]
    assert result.problems == ["rule 'cand': no cell of this run matches role 'candidate' x deploy 'stress' "
                               "(run has arms pr (candidate); deploys reference)"]


def test_paired_and_worst_of_repeats_metrics() -> None:
    """A mean that hides one bad prompt: the paired delta and the worst of N repeats see it."""
    r = rules({"arm": "pr", "deploy": "stress", "max_wer_delta": 0.05, "max_worst_paired_delta": 0.2},
              {"name": "repeats", "arm": "pr", "deploy": "stress", "max_worst_of_repeats_requests_over": 0,
               "max_worst_of_repeats_mean_wer": 0.05},
              reference_deploy="reference")
    ref = cell("pr", "reference", scores=[0.0, 0.1, 0.0, 0.0])
    run1 = cell("pr", "stress", 1, scores=[0.0, 0.0, 0.0, 0.15])  # mean delta +0.0125, worst pair +0.15
    run2 = cell("pr", "stress", 2, scores=[0.0, 0.0, 0.6, 0.0])  # p02 over 0.5 in this repeat only
    result = gate.evaluate(r, [ref, run1, run2])
    assert statuses(result) == [("pr/stress:pr/stress/1", "pass"), ("pr/stress:pr/stress/2", "fail"),
                                ("repeats:pr/stress/1", "fail"), ("repeats:pr/stress/2", "fail")]
    assert result.cases[0].checks[1].message == (
        "max_worst_paired_delta: largest per-prompt WER increase over the same prompt in the reference deploy = "
        "+0.150 <= +0.200 (prompt p03: 0.150 vs 0.000 in pr/reference)")
    assert result.cases[1].checks[1].value == pytest.approx(0.6)
    worst = result.cases[2].checks
    assert [c.value for c in worst] == [1.0, pytest.approx((0.0 + 0.0 + 0.6 + 0.15) / 4)]
    assert worst[0].message == ("max_worst_of_repeats_requests_over: prompts with WER over 0.5 in at least one repeat "
                                "(2 repeats) = 1 > 0")


@pytest.mark.parametrize("bound,value_cell,ok", [
    ({"max_mean_wer": 0.1}, cell("pr", "reference", wer=0.05), True),
    ({"max_mean_wer": 0.1}, cell("pr", "reference", wer=0.15), False),
    ({"max_requests_over": 0}, cell("pr", "reference", over=0), True),
    ({"max_requests_over": 0}, cell("pr", "reference", wer=0.9 / 16, over=1), False),
    ({"max_row_count_mismatches": 0}, cell("pr", "reference", mismatches=0), True),
    ({"max_row_count_mismatches": 0}, cell("pr", "reference", mismatches=3), False),
    ({"max_errors": 0}, cell("pr", "reference", errors=0), True),
    ({"max_errors": 0}, cell("pr", "reference", errors=1), False),
    ({"min_nonzero_offset_chunks": 10}, cell("pr", "reference", chunks=10), True),
    ({"min_nonzero_offset_chunks": 10}, cell("pr", "reference", chunks=9), False),
    ({"min_cross_boundary_replays": 1}, cell("pr", "reference", replays=1), True),
    ({"min_cross_boundary_replays": 1}, cell("pr", "reference", replays=0), False),
])
def test_each_bound_passes_and_fails(bound: dict, value_cell: CellSummary, ok: bool) -> None:
    result = gate.evaluate(rules({"arm": "pr", "deploy": "reference", **bound}), [value_cell])
    assert result.exit_code == (0 if ok else 1)
    assert result.cases[0].checks[0].status == ("pass" if ok else "fail")


def test_requests_over_uses_the_rules_threshold() -> None:
    c = cell("pr", "reference", wer=0.9 / 16, over=1)  # one request at 0.9
    assert gate.evaluate(rules({"arm": "pr", "deploy": "reference", "max_requests_over": 0},
                               wer_threshold=0.95), [c]).exit_code == 0


def test_wer_delta_pairs_same_arm_and_repeat() -> None:
    r = rules({"arm": "pr", "deploy": "stress", "max_wer_delta": 0.03, "reference_deploy": "reference"})
    cells = [cell("pr", "reference", 1, wer=0.02), cell("pr", "reference", 2, wer=0.10),
             cell("pr", "stress", 1, wer=0.04), cell("pr", "stress", 2, wer=0.12)]
    result = gate.evaluate(r, cells)
    assert statuses(result) == [("pr/stress:pr/stress/1", "pass"), ("pr/stress:pr/stress/2", "pass")]
    cells[3] = cell("pr", "stress", 2, wer=0.14)
    result = gate.evaluate(r, cells)
    assert result.exit_code == 1
    assert result.cases[1].message == ("max_wer_delta: mean WER minus the reference deploy's mean WER = +0.040 > "
                                       "+0.030 (vs pr/reference run 2: 0.100)")


def test_wer_delta_single_reference_serves_all_repeats_and_missing_reference_cannot_evaluate() -> None:
    r = rules({"arm": "*", "deploy": "stress", "max_wer_delta": 0.03}, reference_deploy="reference")
    assert gate.evaluate(r, GOOD[3:]).exit_code == 0  # pr: one reference run, two stress runs
    result = gate.evaluate(r, [cell("pr", "stress", wer=0.0)])
    assert result.exit_code == 2
    assert "no pr/reference cell for run 1" in result.cases[0].message


def test_vacuous_stress_run_fails() -> None:
    """A stress deploy that produced no chunk and no replay must not pass, even with a perfect WER."""
    r = rules({"name": "pr-stress", "arm": "pr", "deploy": "stress", "stress": True, "max_mean_wer": 0.1})
    result = gate.evaluate(r, [cell("pr", "stress", wer=0.0, chunks=0, replays=0)])
    assert result.exit_code == 1
    assert [c.status for c in result.cases[0].checks] == ["pass", "fail", "fail"]
    assert "non-zero-offset prefill chunks = 0 < 1" in result.cases[0].message
    assert "replays crossing the prompt boundary = 0 < 1" in result.cases[0].message
    # replays alone are not enough either
    assert gate.evaluate(r, [cell("pr", "stress", chunks=5, replays=0)]).exit_code == 1
    assert gate.evaluate(r, [cell("pr", "stress", chunks=5, replays=1)]).exit_code == 0


def test_expected_failure_passes_when_the_bug_is_detected() -> None:
    r = rules({"name": "main-bug", "arm": "main", "deploy": "stress", "expect": "fail", "stress": True,
               "min_mean_wer": 0.5})
    detected = gate.evaluate(r, [cell("main", "stress", wer=0.933, over=16, chunks=45, replays=7)])
    assert detected.exit_code == 0
    assert detected.cases[0].checks[0].message == "min_mean_wer: bug detected: mean WER = 0.933 >= 0.500"
    missed = gate.evaluate(r, [cell("main", "stress", wer=0.02, chunks=45, replays=7)])
    assert missed.exit_code == 1
    assert missed.cases[0].message == "min_mean_wer: expected failure NOT detected: mean WER = 0.020 < 0.500"
    vacuous = gate.evaluate(r, [cell("main", "stress", wer=0.9, over=16)])  # high WER but nothing stressed
    assert vacuous.exit_code == 1


def test_no_implicit_names() -> None:
    """Nothing about 'main' is special: without an expect: fail rule, main under stress simply fails."""
    r = rules({"arm": "*", "deploy": "*", "max_mean_wer": 0.1})
    assert gate.evaluate(r, GOOD).exit_code == 1
    renamed = [cell("base", "tight", wer=0.9, over=16, chunks=3, replays=1), cell("fix", "tight", chunks=3, replays=1)]
    r = rules({"arm": "base", "deploy": "tight", "expect": "fail", "stress": True, "min_requests_over": 8},
              {"arm": "fix", "deploy": "tight", "stress": True, "max_requests_over": 0})
    assert gate.evaluate(r, renamed).exit_code == 0


def test_rule_matching_no_cell_cannot_evaluate() -> None:
    r = rules({"arm": "main", "deploy": "stress", "max_mean_wer": 0.1})
    result = gate.evaluate(r, GOOD[3:])
    assert result.exit_code == 2
    assert result.problems == [("rule 'main/stress': no cell of this run matches arm 'main' x deploy 'stress' "
                                "(run has arms pr (candidate); deploys reference, stress)")]
    r = rules({"arm": "main", "deploy": "stress", "max_mean_wer": 0.1, "optional": True})
    result = gate.evaluate(r, GOOD[3:])
    assert result.exit_code == 0 and len(result.uncovered) == 3


def test_empty_cell_cannot_evaluate_and_unmeasured_misalignment_is_skipped() -> None:
    r = rules({"arm": "pr", "deploy": "stress", "max_mean_wer": 0.1})
    assert gate.evaluate(r, [cell("pr", "stress", requests=0)]).exit_code == 2
    r = rules({"arm": "pr", "deploy": "stress", "max_misaligned_positions": 0, "max_errors": 0})
    result = gate.evaluate(r, [cell("pr", "stress", misaligned_known=False)])
    assert result.exit_code == 0 and [c.status for c in result.cases[0].checks] == ["skip", "pass"]


@pytest.mark.parametrize("doc,message", [
    ([], "top level: expected a mapping"),
    ({"rules": []}, "rules: expected a non-empty list"),
    ({"rules": [{"arm": "pr"}]}, "rules[0]: needs 'deploy' and 'arm' or 'role'"),
    ({"rules": [{"deploy": "stress", "max_errors": 0}]}, "rules[0]: needs 'deploy' and 'arm' or 'role'"),
    ({"rules": [{"role": "fix", "deploy": "s", "max_errors": 0}]},
     "rules[0].role: must be baseline, candidate or .{3}, got 'fix'"),
    ({"rules": [{"role": "candidate", "deploy": "s", "deploy_role": "heavy", "max_errors": 0}]},
     "deploy_role: must be reference, stress or \"\\*\", got 'heavy'"),
    ({"rules": [{"role": "baseline", "deploy": "s", "expect": "fail", "min_misaligned_text_positions": 1,
                 "max_worst_paired_delta": 1}], "reference_deploy": "r"}, "contradicts max_worst_paired_delta"),
    ({"rules": [{"arm": "pr", "deploy": "x", "max_wer": 1}]}, "rules[0] (pr/x).max_wer: unknown key"),
    ({"rules": [{"arm": "pr", "deploy": "x", "max_mean_wer": "low"}]}, "max_mean_wer: must be a finite number >= 0, got 'low'"),
    ({"rules": [{"arm": "pr", "deploy": "x"}]}, "no bound"),
    ({"rules": [{"arm": "pr", "deploy": "x", "max_wer_delta": 0.1, "reference_deploy": 3}]},
     "reference_deploy: must be a non-empty string"),
    ({"rules": [{"arm": "m", "deploy": "x", "expect": "fail", "max_errors": 0}]}, "needs a detection bound"),
    ({"rules": [{"arm": "m", "deploy": "x", "expect": "fail", "min_mean_wer": 0.5, "max_mean_wer": 1}]},
     "contradicts max_mean_wer"),
    ({"rules": [{"arm": "m", "deploy": "x", "expect": "maybe", "min_mean_wer": 0.5}]}, "expect: must be"),
    ({"rules": [{"arm": "p", "deploy": "s", "stress": True, "min_cross_boundary_replays": 0}]},
     "must be >= 1 with stress: true"),
    ({"rules": [{"arm": "p", "deploy": "s", "stress": "yes"}]}, "stress: must be true or false"),
    ({"rules": [{"arm": "p", "deploy": "s", "max_errors": 0}] * 2}, "duplicate rule name 'p/s'"),
    ({"rules": [{"arm": "p", "deploy": "s", "max_errors": 0}], "threshold": 1}, "threshold: unknown key"),
])
def test_bad_rules_name_file_and_key(doc: Any, message: str) -> None:
    with pytest.raises(ConfigError, match="^test.yaml: .*" + message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        gate.parse_rules(doc, "test.yaml")


def test_junit_xml_counts_and_messages() -> None:
    r = rules({"name": "ref", "arm": "*", "deploy": "reference", "max_mean_wer": 0.1},
              {"name": "pr-stress", "arm": "pr", "deploy": "stress", "stress": True, "max_wer_delta": 0.03},
              {"name": "ghost", "arm": "nope", "deploy": "stress", "max_errors": 0},
              reference_deploy="reference")
    cells = GOOD[:4] + [cell("pr", "stress", wer=0.3, chunks=91, replays=26), cell("pr", "stress", 2, requests=0)]
    result = gate.evaluate(r, cells, run_id="r1")
    root = ET.fromstring(gate.junit_xml(result))
    suite = root.find("testsuite")
    assert suite is not None and suite.get("name") == "omni-stress gate: r1"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("5", "1", "2")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["ref: main/reference run 1 [baseline]",
                                              "ref: pr/reference run 1 [candidate]",
                                              "pr-stress: pr/stress run 1 [candidate]",
                                              "pr-stress: pr/stress run 2 [candidate]", "could not evaluate (1)"]
    failure = cases[2].find("failure")
    assert failure is not None and failure.get("message", "").startswith("max_wer_delta: mean WER minus")
    assert cases[3].find("error") is not None and cases[4].find("error") is not None
    assert cases[0].find("failure") is None and cases[0].find("error") is None


# --------------------------------------------------------------------------- CLI


ROLES = {"main": "baseline", "pr": "candidate"}


def write_gate_run(root: Path, cells: list[tuple[str, str, int, float, int, int]], finished: bool = True,
                   prompts: int = 4) -> Path:
    """A complete run dir with events only in the request records: (arm, deploy, repeat, wer, chunks, replays).

    A cell with WER >= 0.5 also gets text-region misaligned positions (the bug shows in the rows)."""
    root.mkdir(parents=True)
    w = JsonlWriter(root / "requests.jsonl")
    for arm, deploy, repeat, wer, chunks, replays in cells:
        for i in range(prompts):
            ev = EventCounts(nonzero_offset_chunks=chunks if i == 0 else 0, cross_boundary_replays=replays if i == 0
                             else 0, misaligned_text_positions=10 if wer >= 0.5 else 0,
                             misaligned_positions=10 if wer >= 0.5 else 0,
                             replays_ending_in_text=replays if i == 0 else 0)
            w.write(RequestRecord(arm=arm, deploy=deploy, repeat=repeat, prompt_id=f"p{i}", backend="sim",
                                  reference_text="a b", wer=wer, events=ev))
    w.close()
    arms = list(dict.fromkeys(c[0] for c in cells))
    write_manifest(root, {"run_id": root.name, "argv": [], "started": "2026-01-01T00:00:00",
                          "finished": "2026-01-01T00:01:00" if finished else None, "backend": "sim", "asr": None,
                          "arms": [{"name": a, "talker": "x:y", "role": ROLES.get(a, "candidate")} for a in arms],
                          "prompt_ids": [f"p{i}" for i in range(prompts)],
                          "cells": [{"arm": a, "deploy": d, "repeat": r} for a, d, r, *_ in cells]})
    return root


SEED_CELLS = [("main", "reference", 1, 0.0, 0, 0), ("main", "stress", 1, 0.9, 45, 7),
              ("pr", "reference", 1, 0.0, 0, 0), ("pr", "stress", 1, 0.0, 91, 26)]


def test_cli_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    good = write_gate_run(tmp_path / "good", SEED_CELLS)
    junit = tmp_path / "out" / "gate.xml"
    res = runner.invoke(main, ["gate", str(good), "--junit", str(junit)])
    assert res.exit_code == 0, res.output
    assert ET.parse(junit).getroot().get("tests") == "6"

    broken = write_gate_run(tmp_path / "broken", SEED_CELLS[:3] + [("pr", "stress", 1, 0.5, 91, 26)])
    res = runner.invoke(main, ["gate", str(broken)])
    assert res.exit_code == 1 and "FAIL   candidate-stress-matches-reference: pr/stress run 1 [candidate]" in res.output
    assert "FAIL   candidate-contract: pr/stress run 1 [candidate]" in res.output  # its rows are wrong too

    vacuous = write_gate_run(tmp_path / "vacuous", SEED_CELLS[:3] + [("pr", "stress", 1, 0.0, 0, 0)])
    assert runner.invoke(main, ["gate", str(vacuous)]).exit_code == 1
    vacuous_base = write_gate_run(tmp_path / "vacuous_base", [SEED_CELLS[0], ("main", "stress", 1, 0.9, 0, 0)])
    res = runner.invoke(main, ["gate", str(vacuous_base)])
    assert res.exit_code == 1 and "replays crossing the prompt boundary = 0 < 1" in res.output

    only_ref = write_gate_run(tmp_path / "only_ref", [SEED_CELLS[2]])
    res = runner.invoke(main, ["gate", str(only_ref)])
    assert res.exit_code == 2
    assert "rule 'candidate-stress-matches-reference': no cell of this run matches role 'candidate' x deploy " \
           "'*stress'" in res.output

    res = runner.invoke(main, ["gate", str(tmp_path / "nowhere"), "--junit", str(junit)])
    assert res.exit_code == 2 and "run directory not found" in res.output
    assert ET.parse(junit).getroot().get("errors") == "1"

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"rules": [{"arm": "pr", "deploy": "stress", "max_wer": 0.1}]}))
    res = runner.invoke(main, ["gate", str(good), "--rules", str(bad)])
    assert res.exit_code == 2 and f"omni-stress: error: {bad}: rules[0] (pr/stress).max_wer: unknown key" in res.output
    res = runner.invoke(main, ["gate", str(good), "--rules", str(tmp_path / "none.yaml")])
    assert res.exit_code == 2 and "file not found" in res.output
    bad.write_text("rules: [\n")
    res = runner.invoke(main, ["gate", str(good), "--rules", str(bad)])
    assert res.exit_code == 2 and "malformed YAML" in res.output


# --------------------------------------------------------------------------- complete runs only


def _damage(run_dir: Path, how: str) -> None:
    path = run_dir / "requests.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    if how == "killed":  # 1 of 4 records per cell, finished null
        keep = [ln for ln in lines if '"prompt_id": "p0"' in ln]
        path.write_text("".join(keep))
        manifest["finished"] = None
    elif how == "torn":  # the last record cut off mid-write
        path.write_text("".join(lines[:-1]) + lines[-1][:40])
    elif how == "duplicated":  # two --resume of the same run at once
        path.write_text("".join(lines + lines[1:]))
    elif how == "foreign":  # a record of a cell the manifest does not list
        path.write_text("".join(lines) + lines[0].replace('"deploy": "stress"', '"deploy": "specdec"')
                        .replace('"deploy": "reference"', '"deploy": "specdec"'))
    elif how == "backend":
        path.write_text("".join(lines[:-1]) + lines[-1].replace('"backend": "sim"', '"backend": "vllm-omni"'))
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how,line", [
    ("killed", "incomplete run (2 problems): the run did not finish (manifest.json: finished is null; killed, still "
               "running, or resumed without completing); 12 of 16 request records missing (first: main/reference "
               "repeat 1 prompt p1); not gated"),
    ("torn", "incomplete run (2 problems): requests.jsonl: the last line is cut off (a write was interrupted; that "
             "record is lost); 1 of 16 request records missing (first: pr/stress repeat 1 prompt p3); not gated"),
    ("duplicated", "incomplete run (1 problem): 15 request records written more than once (first: main/reference "
                   "repeat 1 prompt p1, 2 times); not gated"),
    ("foreign", "incomplete run (1 problem): 1 request record for a cell manifest.json does not list (first: "
                "main/specdec repeat 1 prompt p0); not gated"),
    ("backend", "incomplete run (1 problem): 1 request record from backend 'vllm-omni', manifest.json says 'sim' "
                "(first: pr/stress repeat 1 prompt p3); not gated"),
])
def test_gate_refuses_incomplete_runs(tmp_path: Path, how: str, line: str) -> None:
    run_dir = write_gate_run(tmp_path / how, SEED_CELLS)
    _damage(run_dir, how)
    junit = tmp_path / "gate.xml"
    res = CliRunner().invoke(main, ["gate", str(run_dir), "--junit", str(junit)])
    assert res.exit_code == 2
    assert res.stdout == ""
    assert res.stderr == f"omni-stress: error: {run_dir}: {line}\n"  # one line
    root = ET.parse(junit).getroot()
    assert (root.get("tests"), root.get("errors")) == ("1", "1")
    # report and compare still show it, with a visible warning
    res = CliRunner().invoke(main, ["report", str(run_dir), "--no-write"])
    assert res.exit_code == 0
    assert res.stderr.startswith(f"omni-stress: warning: {run_dir}: incomplete run (")
    assert "WARNING: incomplete run, the gate refuses it: " in res.stdout
    res = CliRunner().invoke(main, ["compare", str(run_dir), str(run_dir)])
    assert res.exit_code == 0 and res.stderr.count("omni-stress: warning:") == 2


def test_gate_reads_roles_from_the_run(tmp_path: Path) -> None:
    """The same records with main recorded as a candidate: the shipped rules fail it (exit 1)."""
    run_dir = write_gate_run(tmp_path / "roles", SEED_CELLS)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["arms"][0]["role"] = "candidate"
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(main, ["gate", str(run_dir)])
    assert res.exit_code == 1 and "FAIL   candidate-contract: main/stress run 1 [candidate]" in res.output
    manifest["arms"][0]["role"] = "reference"
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(main, ["gate", str(run_dir)])
    assert res.exit_code == 2
    assert res.stderr == (f"omni-stress: error: {run_dir / 'manifest.json'}: arms[0].role: expected baseline or "
                          f"candidate, got 'reference'\n")


def test_arm_roles_in_arms_yaml(tmp_path: Path) -> None:
    from harness.config import load_arms
    from harness.talkers import resolve_arm

    arms = load_arms()
    assert (arms["main"].role, arms["pr"].role) == ("baseline", "candidate")
    assert resolve_arm("mine=tests.fixtures.mutants:OffByOneDecode", arms).role == "candidate"
    assert resolve_arm("main=harness.families.qwen2_5_omni.main:MainTalker", arms).role == "candidate"  # a plugin arm
    res = CliRunner().invoke(main, ["list", "arms"])
    assert "harness.families.qwen2_5_omni.main:MainTalker (role: baseline, family: qwen2.5-omni)" in res.stdout
    assert "harness.families.qwen2_5_omni.pr:FixedTalker (role: candidate, family: qwen2.5-omni)" in res.stdout
    bad = tmp_path / "arms.yaml"
    bad.write_text("arms:\n  main:\n    talker: harness.families.qwen2_5_omni.main:MainTalker\n    role: reference\n")
    with pytest.raises(ConfigError) as exc:
        load_arms(bad)
    assert str(exc.value) == f"{bad}: arms.main.role: must be one of baseline, candidate, got 'reference'"
    res = CliRunner().invoke(main, ["run", "--arms-file", str(bad), "--arm", "main", "--asr", "none",
                                    "--out", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert res.stderr == f"omni-stress: error: {bad}: arms.main.role: must be one of baseline, candidate, " \
                         f"got 'reference'\n"
    assert not (tmp_path / "out").exists()


def test_ci_workflow_runs_the_matrix_and_the_gate() -> None:
    path = Path(__file__).resolve().parent.parent / ".github" / "workflows" / "omni-stress.yml"
    doc = yaml.safe_load(path.read_text())
    assert "pull_request" in doc[True]  # YAML 1.1 reads the key `on` as True
    runs = "\n".join(step.get("run", "") for step in doc["jobs"]["gate"]["steps"])
    assert "bash scripts/install.sh" in runs  # the same install as .ci/run
    assert "omni-stress run --arm main --arm pr --out results/ci" in runs
    assert "--junit gate.xml" in runs
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in doc["jobs"]["gate"]["steps"])


def test_a_pattern_reference_deploy_pairs_within_the_name_prefix() -> None:
    from types import SimpleNamespace as Cell

    from harness.report.summary import resolve_reference_deploy

    cells = [Cell(arm="pr", deploy=d) for d in ("reference", "stress", "cpu-reference", "cpu-stress")]
    cells.append(Cell(arm="main", deploy="gpu2-reference"))
    assert resolve_reference_deploy(cells[3], "*reference", cells) == "cpu-reference"
    assert resolve_reference_deploy(cells[1], "*reference", cells) == "reference"
    assert resolve_reference_deploy(cells[1], "reference", cells) == "reference"  # a name is taken as it is
    assert resolve_reference_deploy(Cell(arm="pr", deploy="gpu2-stress"), "*reference", cells) is None
    two = cells + [Cell(arm="pr", deploy="cpu-reference2")]
    assert resolve_reference_deploy(cells[3], "cpu-ref*", two) is None  # two names qualify: ambiguous


def test_measured_fail_beside_unevaluable_rules_exits_1_and_is_named_first(tmp_path: Path) -> None:
    """Issue 47: a run with a single deploy (stress only) whose candidate breaks the contract. The
    reference-paired rules cannot be evaluated, but the measured FAIL decides: exit 1, named first."""
    run_dir = write_gate_run(tmp_path / "single", [("main", "stress", 1, 0.9, 45, 7)])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["arms"][0]["role"] = "candidate"
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(main, ["gate", str(run_dir)])
    assert res.exit_code == 1, res.output
    lines = res.stdout.splitlines()
    assert lines[0].startswith("FAILED candidate-contract: main/stress run 1 [candidate]: "
                               "max_misaligned_text_positions: ")
    assert lines[-1].startswith("gate: 0 passed, 2 failed, ")
    # the verdict names the failing arm with its role (issue 45)
    assert lines[-1].endswith("-> FAIL (candidate-contract, candidate-stress-matches-reference failed; arm main "
                              "(candidate)) (exit 1)")


def test_a_rule_with_a_failing_bound_and_an_unevaluable_bound_is_a_failure() -> None:
    r = rules({"name": "pr-stress", "arm": "pr", "deploy": "stress", "max_mean_wer": 0.1, "max_wer_delta": 0.03},
              reference_deploy="reference")
    result = gate.evaluate(r, [cell("pr", "stress", wer=0.4)])  # no reference cell: the delta is unknown
    assert [c.status for c in result.cases[0].checks] == ["fail", "error"]
    assert result.cases[0].status == "fail" and result.exit_code == 1
    assert result.failed == [result.cases[0]]
    assert result.cases[0].message == ("max_mean_wer: mean WER = 0.400 > 0.100; max_wer_delta: no pr/reference cell "
                                       "for run 1 in this run")
    # nothing failed, something unknown: still 2
    assert gate.evaluate(r, [cell("pr", "stress", wer=0.0)]).exit_code == 2


def test_map_gate_a_measured_failure_beside_a_problem_exits_1() -> None:
    from harness.sweep.gate import ArmVerdict, CellVerdict, MapVerdict

    r = rules({"name": "c", "arm": "*", "deploy": "*", "max_mean_wer": 0.1})
    bad = gate.evaluate(r, [cell("pr", "s1", wer=0.4, chunks=3, replays=1)]).cases
    failing = ArmVerdict("pr", "candidate", reference=[], knee=None, problems=["no reference cell for load c4"],
                         cells=[CellVerdict(bad[0].cell, "s1", True, bad, wer_ok=False)])
    assert failing.status == "fail"
    assert MapVerdict([failing]).exit_code == 1
    unknown = ArmVerdict("pr", "candidate", reference=[], knee=None, problems=["no reference cell for load c4"],
                         cells=[])
    assert unknown.status == "error" and MapVerdict([unknown]).exit_code == 2


@pytest.mark.parametrize("how", ["killed", "torn", "torn-spans"])
def test_conform_beside_and_compare_warn_on_incomplete_runs_and_refuse_with_strict(tmp_path: Path, how: str) -> None:
    """Issue 47, case 3: ``conform --beside`` printed its table without a word on a killed run or a torn last
    line; now the same warning as ``report``, ``compare`` and ``fidelity``, and the same ``--strict``."""
    run_dir = write_gate_run(tmp_path / how, SEED_CELLS)
    if how == "torn-spans":
        (run_dir / "spans.jsonl").write_text('{"arm": "pr", "deploy": "stress", "repe')
    else:
        _damage(run_dir, how)
    from harness.report import summary

    line = summary.problems_line(summary.load_run(run_dir), summary.run_problems(summary.load_run(run_dir)))
    conform = ["conform", "--beside", str(run_dir), "--source", "vllm-omni:0.30.0", "--deploy", "none",
               "--requests", "1"]
    # in a subprocess: conform's per-call limit starts a watchdog thread, which must not stay in the test runner
    res = run_cli(*conform)
    assert res.exit_code == 0, res.stderr[-2000:]  # no shipped deploy reaches the bug here: the matrix as usual
    assert f"omni-stress: warning: {line}; its numbers may be partial\n" in res.stderr
    assert "conform beside run" in res.stdout
    res = run_cli(*conform, "--strict")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == f"omni-stress: error: {line}; not put beside (--strict)\n"
    res = CliRunner().invoke(main, ["compare", str(run_dir), str(run_dir), "--strict"])
    assert res.exit_code == 2 and res.stderr == f"omni-stress: error: {line}; not compared (--strict)\n"


def test_rules_and_runs_of_another_family_are_refused_unless_asked(tmp_path: Path) -> None:
    """Issue 47, case 4: ``gate --rules`` with another family's rules applied them silently; ``compare`` of two
    families gave a table of n/a with exit 0. Both refuse in one line (exit 2) without ``--any-family``."""
    omni = write_gate_run(tmp_path / "omni", SEED_CELLS)
    tts = write_gate_run(tmp_path / "tts", SEED_CELLS)
    manifest = json.loads((tts / "manifest.json").read_text())
    manifest["family"] = "qwen3-tts"
    (tts / "manifest.json").write_text(json.dumps(manifest))
    tts_rules = DEPLOY_DIR / "gates-qwen3-tts.yaml"
    runner = CliRunner()
    res = runner.invoke(main, ["gate", str(omni), "--rules", "gates-qwen3-tts"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == (f"omni-stress: error: --rules {tts_rules}: rules for the qwen3-tts family, but the run {omni} "
                          f"is of family qwen2.5-omni; give --any-family to apply them anyway\n")
    res = runner.invoke(main, ["gate", str(omni), "--rules", "gates-qwen3-tts", "--any-family"])
    assert res.exit_code == 0 and res.stdout.splitlines()[-1].endswith("-> pass (exit 0)")
    res = runner.invoke(main, ["gate", str(tts), "--rules", "gates"])
    assert res.exit_code == 2 and "rules for the qwen2.5-omni family, but the run" in res.stderr
    # rules that name no family apply to any run (a user's own file)
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({"rules": [{"role": "*", "deploy": "*", "max_errors": 0}]}))
    res = runner.invoke(main, ["gate", str(tts), "--rules", str(own)])
    assert res.exit_code == 0 and res.stderr == "", res.output
    res = runner.invoke(main, ["compare", str(omni), str(tts)])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == (f"omni-stress: error: compare {omni} {tts}: the first run is of family 'qwen2.5-omni', the "
                          f"second of 'qwen3-tts'; their cells and prompts do not pair (give --any-family to compare "
                          f"anyway)\n")
    assert runner.invoke(main, ["compare", str(omni), str(tts), "--any-family"]).exit_code == 0
    with pytest.raises(ConfigError, match=r"^r\.yaml: family: unknown model family 'qwen9' \(known: "):
        gate.parse_rules({"family": "qwen9", "rules": [{"arm": "*", "deploy": "*", "max_errors": 0}]}, "r.yaml")
    assert gate.load_rules(DEPLOY_DIR / "gates.yaml").family == "qwen2.5-omni"
    assert gate.load_rules(tts_rules).family == "qwen3-tts"


def test_run_header_names_the_asr_model_as_the_asrs_and_the_served_checkpoint(tmp_path: Path) -> None:
    """Issue 47, case 5: the header said ``model=base`` (the Whisper model) where a reader looks for the model."""
    run_dir = write_gate_run(tmp_path / "h", SEED_CELLS)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["asr"] = {"backend": "faster-whisper", "model": "base", "beam_size": 1}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(main, ["report", str(run_dir), "--no-write"])
    assert res.stdout.splitlines()[0] == "Run h: backend sim, ASR faster-whisper (Whisper model base, beam size 1)"
    manifest.update(asr={"backend": "none", "model": "base", "beam_size": 1}, served_model="/models/tiny-omni")
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(main, ["report", str(run_dir), "--no-write"])
    assert res.stdout.splitlines()[0] == "Run h: backend sim, served model /models/tiny-omni, ASR none (oracle transcripts)"
