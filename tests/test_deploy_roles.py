"""Roles, not names (issue 46 item 3): a deploy declares ``role:`` (reference or stress) and, as a stress
deploy, ``pair:`` (its reference); the paired table, its audio players and the gate's pairing use them
for every family and any deploy name. Runs recorded before roles infer both from the deploy names."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import REPO, SMALL_PROMPTS, run_cli

from harness.config import parse_deploy
from harness.errors import ConfigError
from harness.roles import deploy_role


@pytest.mark.parametrize(("name", "expected"), [
    ("reference", ("reference", None)),
    ("cpu-reference", ("reference", None)),
    ("stress", ("stress", "reference")),
    ("specdec", ("stress", "reference")),
    ("cpu-stress", ("stress", "cpu-reference")),
    ("qwen3-tts-mrv2-stress", ("stress", "qwen3-tts-mrv2-reference")),
    ("calm", ("stress", "reference")),  # an undeclared name is a stress deploy
])
def test_undeclared_roles_follow_the_names_of_runs_before_roles(name: str, expected: tuple) -> None:
    assert deploy_role(name) == expected


def test_a_declared_role_and_pair_win_over_the_name() -> None:
    assert deploy_role("calm", "reference") == ("reference", None)
    assert deploy_role("heavy", "stress", "calm") == ("stress", "calm")
    assert deploy_role("x-reference", "stress") == ("stress", "x-reference")  # a stress deploy pairs by its prefix


def _deploy_doc(name: str, **extra: object) -> dict:
    return {"name": name, "talker": {"max_num_seqs": 4}, **extra}


@pytest.mark.parametrize(("extra", "message"), [
    ({"role": "heavy"}, "t.yaml: role: must be one of reference, stress, got 'heavy'"),
    ({"role": "stress", "pair": "heavy"}, "t.yaml: pair: names the deploy itself (heavy); a stress deploy pairs "
                                          "with a reference deploy"),
    ({"role": "reference", "pair": "calm"}, "t.yaml: pair: a reference deploy has no pair (it is what stress "
                                            "deploys pair with)"),
    ({"pair": "../calm"}, "t.yaml: pair: '../calm' is not a safe name"),
])
def test_bad_roles_name_the_file_and_the_field(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_deploy(Path("t.yaml"), _deploy_doc("heavy", **extra))
    assert str(err.value).startswith(message)


def test_the_shipped_deploys_declare_their_roles() -> None:
    shipped = [p for p in sorted((REPO / "deploy_configs").glob("*.yaml")) if p.stem != "arms" and
               not p.stem.startswith("gates")]
    assert len(shipped) == 26
    for path in shipped:
        text = path.read_text()
        assert "\nrole: " in text, path.name
        deploy = parse_deploy(path, __import__("yaml").safe_load(text))
        assert (deploy.role, deploy.pair) == deploy_role(deploy.name), path.name  # declared as the names say


RULES = """\
reference_deploy: pair
rules:
  - name: candidate-speaks-unstressed
    role: candidate
    deploy: "*"
    deploy_role: reference
    max_mean_wer: 0.15
  - name: candidate-stress-matches-its-pair
    role: candidate
    deploy: "*"
    deploy_role: stress
    stress: true
    max_wer_delta: 0.03
    max_worst_paired_delta: 0.2
  - name: baseline-stress-shows-bug
    role: baseline
    deploy: "*"
    deploy_role: stress
    expect: fail
    min_misaligned_text_positions: 1
"""


@pytest.mark.slow
def test_deploys_named_anything_pair_by_their_declared_roles(tmp_path: Path) -> None:
    calm = (REPO / "deploy_configs" / "reference.yaml").read_text().replace("name: reference\n", "name: calm\n")
    heavy = (REPO / "deploy_configs" / "stress.yaml").read_text().replace("name: stress\n", "name: heavy\n")
    (tmp_path / "calm.yaml").write_text(calm)
    (tmp_path / "heavy.yaml").write_text(heavy.replace("pair: reference ", "pair: calm "))
    res = run_cli("run", "--asr", "none", "--quiet", "--no-cache", "--prompts", str(SMALL_PROMPTS), "--arm", "main",
                  "--arm", "pr", "--deploy", str(tmp_path / "calm.yaml"), "--deploy", str(tmp_path / "heavy.yaml"),
                  "--out", str(tmp_path), "--run-id", "named")
    assert res.exit_code == 0, res.stderr[-3000:]
    run = tmp_path / "named"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["deploy_roles"] == {"calm": {"role": "reference", "pair": None},
                                        "heavy": {"role": "stress", "pair": "calm"}}
    with open(run / "paired.csv", newline="") as fh:
        paired = list(csv.DictReader(fh))
    assert [(p["arm"], p["deploy"], p["reference_deploy"], p["prompt"]) for p in paired] == [
        (arm, "heavy", "calm", pid) for arm in ("main", "pr") for pid in ("p01-weather", "p03-sleep", "p05-garden",
                                                                        "p07-rainbow")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reference_deploy"] == "calm"
    markdown = (run / "summary.md").read_text()
    assert "same prompt's WER in the same arm's calm deploy (same run)" in markdown
    html = (run / "report.html").read_text()
    # one worst request per paired cell, with its players; tinted where worse than its pair (main's, not pr's)
    assert html.count('<tr class="worst">') == 1 and html.count('<tr class="plays">') == 1

    rules = tmp_path / "roles.yaml"
    rules.write_text(RULES)
    gate = run_cli("gate", str(run), "--rules", str(rules))
    assert gate.exit_code == 0, gate.stdout[-3000:]
    assert gate.stdout.splitlines()[-1] == "gate: 3 passed, 0 failed, 0 could not be evaluated -> pass (exit 0)"
    assert "PASS   candidate-stress-matches-its-pair: pr/heavy run 1 [candidate]" in gate.stdout
    assert "(vs pr/calm run 1: " in gate.stdout  # wer_delta against the declared pair

    # The same run as a run recorded before roles: the names say "calm" is a stress deploy like
    # "heavy" and neither has its reference in the run, so nothing pairs.
    del manifest["deploy_roles"]
    (run / "manifest.json").write_text(json.dumps(manifest, indent=2))
    again = run_cli("report", str(run))
    assert again.exit_code == 0, again.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["paired"] == []
