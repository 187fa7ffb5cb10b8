"""The CI gate: each rule passes and fails, vacuous stress runs fail, JUnit parses, exit codes 0/1/2."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from harness import gate
from harness.cli import main
from harness.config import DEPLOY_DIR
from harness.errors import ConfigError
from harness.records import EventCounts, JsonlWriter, RequestRecord, write_manifest
from harness.report import CellSummary


def cell(arm: str, deploy: str, repeat: int = 1, wer: float = 0.0, over: int = 0, chunks: int = 0,
         replays: int = 0, mismatches: int = 0, errors: int = 0, requests: int = 16,
         misaligned_known: bool = True) -> CellSummary:
    """A cell whose scores have exactly this mean and this many requests over 0.5."""
    scores = [0.9] * over + [0.0] * (requests - over)
    if requests:
        scores[-1] += wer * requests - sum(scores)
    ev = EventCounts(nonzero_offset_chunks=chunks, cross_boundary_replays=replays, row_count_mismatches=mismatches)
    return CellSummary(arm=arm, deploy=deploy, repeat=repeat, requests=requests, scores=scores, oracle_scores=[],
                       events=ev, event_source="spans", misaligned_known=misaligned_known, preemptions=0,
                       errors=errors, wall_s=1.0, wer_source="whisper", run_number=repeat)


def rules(*items: dict[str, Any], **top: Any) -> gate.Rules:
    return gate.parse_rules({"rules": list(items), **top}, "test.yaml")


def statuses(result: gate.GateResult) -> list[tuple[str, str]]:
    return [(f"{c.rule.name}:{c.cell.arm}/{c.cell.deploy}/{c.cell.repeat}", c.status) for c in result.cases]


GOOD = [
    cell("main", "reference", wer=0.017), cell("main", "stress", wer=0.933, over=16, chunks=45, replays=7,
                                               mismatches=68),
    cell("main", "stress", 2, wer=0.925, over=16, chunks=47, replays=8, mismatches=71),
    cell("pr", "reference", wer=0.020), cell("pr", "stress", wer=0.016, chunks=91, replays=26),
    cell("pr", "stress", 2, wer=0.016, chunks=92, replays=26),
]


def test_default_rules_pass_on_the_seed_numbers() -> None:
    default = gate.load_rules(DEPLOY_DIR / "gates.yaml")
    result = gate.evaluate(default, GOOD, run_id="seed")
    assert result.exit_code == 0, gate.format_result(result)
    assert len(result.cases) == 6 and not result.uncovered
    text = gate.format_result(result)
    assert "bug detected: mean WER = 0.933 >= 0.500" in text
    assert text.rstrip().endswith("-> pass (exit 0)")


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
                                "(run has arms pr; deploys reference, stress)")]
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
    ({"rules": [{"arm": "pr"}]}, "rules[0]: needs 'arm' and 'deploy'"),
    ({"rules": [{"arm": "pr", "deploy": "x", "max_wer": 1}]}, "rules[0] (pr/x).max_wer: unknown key"),
    ({"rules": [{"arm": "pr", "deploy": "x", "max_mean_wer": "low"}]}, "max_mean_wer: must be a number"),
    ({"rules": [{"arm": "pr", "deploy": "x"}]}, "no bound"),
    ({"rules": [{"arm": "pr", "deploy": "x", "max_wer_delta": 0.1}]}, "needs reference_deploy"),
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
    assert [c.get("name") for c in cases] == ["ref: main/reference run 1", "ref: pr/reference run 1",
                                              "pr-stress: pr/stress run 1", "pr-stress: pr/stress run 2",
                                              "could not evaluate (1)"]
    failure = cases[2].find("failure")
    assert failure is not None and failure.get("message", "").startswith("max_wer_delta: mean WER minus")
    assert cases[3].find("error") is not None and cases[4].find("error") is not None
    assert cases[0].find("failure") is None and cases[0].find("error") is None


# --------------------------------------------------------------------------- CLI


def write_gate_run(root: Path, cells: list[tuple[str, str, int, float, int, int]]) -> Path:
    """A run dir with events only in the request records: (arm, deploy, repeat, wer, chunks, replays)."""
    root.mkdir(parents=True)
    w = JsonlWriter(root / "requests.jsonl")
    for arm, deploy, repeat, wer, chunks, replays in cells:
        for i in range(4):
            ev = EventCounts(nonzero_offset_chunks=chunks if i == 0 else 0, cross_boundary_replays=replays if i == 0
                             else 0)
            w.write(RequestRecord(arm=arm, deploy=deploy, repeat=repeat, prompt_id=f"p{i}", backend="sim",
                                  reference_text="a b", wer=wer, events=ev))
    w.close()
    write_manifest(root, {"run_id": root.name, "argv": [], "started": None, "finished": None, "backend": "sim",
                          "asr": None, "cells": [{"arm": a, "deploy": d, "repeat": r} for a, d, r, *_ in cells]})
    return root


SEED_CELLS = [("main", "reference", 1, 0.0, 0, 0), ("main", "stress", 1, 0.9, 45, 7),
              ("pr", "reference", 1, 0.0, 0, 0), ("pr", "stress", 1, 0.0, 91, 26)]


def test_cli_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    good = write_gate_run(tmp_path / "good", SEED_CELLS)
    junit = tmp_path / "out" / "gate.xml"
    res = runner.invoke(main, ["gate", str(good), "--junit", str(junit)])
    assert res.exit_code == 0, res.output
    assert ET.parse(junit).getroot().get("tests") == "4"

    broken = write_gate_run(tmp_path / "broken", SEED_CELLS[:3] + [("pr", "stress", 1, 0.5, 91, 26)])
    res = runner.invoke(main, ["gate", str(broken)])
    assert res.exit_code == 1 and "FAIL   pr-stress-matches-reference: pr/stress run 1" in res.output

    vacuous = write_gate_run(tmp_path / "vacuous", SEED_CELLS[:3] + [("pr", "stress", 1, 0.0, 0, 0)])
    assert runner.invoke(main, ["gate", str(vacuous)]).exit_code == 1

    only_pr = write_gate_run(tmp_path / "only_pr", SEED_CELLS[2:])
    res = runner.invoke(main, ["gate", str(only_pr)])
    assert res.exit_code == 2 and "rule 'main-stress-detects-bug': no cell of this run matches arm 'main'" in res.output

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


def test_ci_workflow_runs_the_matrix_and_the_gate() -> None:
    path = Path(__file__).resolve().parent.parent / ".github" / "workflows" / "omni-stress.yml"
    doc = yaml.safe_load(path.read_text())
    assert "pull_request" in doc[True]  # YAML 1.1 reads the key `on` as True
    runs = "\n".join(step.get("run", "") for step in doc["jobs"]["gate"]["steps"])
    assert "bash scripts/install.sh" in runs  # the same install as .ci/run
    assert "omni-stress run --arm main --arm pr --out results/ci" in runs
    assert "--junit gate.xml" in runs
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in doc["jobs"]["gate"]["steps"])
