""""Adding a metric" (docs/reports.md), followed as a contributor would (issue 46 item 2): one event
predicate and one ``Metric`` entry in harness/metrics.py, nothing else edited, and the new count is a
span flag, a column of every table (terminal, summary.md, summary.csv, requests.csv, summary.json,
report.html) and a gate metric, with the values the spans say.

The checkout is copied to a temporary folder, its harness/metrics.py edited there, and the copy's CLI
run from it (``python -m harness.cli`` imports the copy first)."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SMALL_PROMPTS

pytestmark = pytest.mark.slow

EVENT = '''    # 0 < c < P and n >= 16: a prefill chunk of at least 16 positions that does not start at row 0
    "long_chunk": lambda P, c, n, rows: (c > 0) & (c < P) & (n >= 16),
'''
METRIC = '''    Metric("long_prefill_chunks", "non-zero-offset prefill chunks of 16 positions or more", "Long prefill chunks",
           "long chunks", flags=("long_chunk",), table="Long prefill chunks", compact="Long chunks"),
'''


def _copy_with_the_metric(dst: Path) -> Path:
    for name in ("harness", "deploy_configs", "prompts"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    metrics = dst / "harness" / "metrics.py"
    text = metrics.read_text()
    anchor_event = '    # rows returned != n\n'
    anchor_metric = '    Metric("multi_position_decode_spans",'
    assert text.count(anchor_event) == 1 and text.count(anchor_metric) == 1
    text = text.replace(anchor_event, EVENT + anchor_event).replace(anchor_metric, METRIC + anchor_metric)
    metrics.write_text(text)
    return dst


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=root, capture_output=True, text=True,
                          timeout=900, check=False)


def test_a_new_metric_is_one_entry_and_appears_everywhere(tmp_path: Path) -> None:
    root = _copy_with_the_metric(tmp_path / "checkout")
    res = _cli(root, "run", "--asr", "none", "--no-cache", "--prompts", str(SMALL_PROMPTS), "--arm", "main", "--arm",
               "pr", "--deploy", "reference", "--deploy", "stress", "--out", str(tmp_path), "--run-id", "m")
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "m"
    export = _cli(root, "export-spans", str(run), "-o", str(tmp_path / "spans.jsonl"))
    assert export.returncode == 0, export.stderr[-3000:]

    # The spans carry the new flag, and it is the predicate's value.
    spans = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    assert all(s["long_chunk"] == (0 < s["c"] < s["P"] and s["n"] >= 16) for s in spans)
    expected: dict[tuple[str, str], int] = {}
    for s in spans:
        expected[(s["arm"], s["deploy"])] = expected.get((s["arm"], s["deploy"]), 0) + s["long_chunk"]
    assert expected[("pr", "reference")] == 0 and expected[("pr", "stress")] > 0

    # summary.csv and summary.json: the EventCounts field, per cell.
    with open(run / "summary.csv", newline="") as fh:
        cells = {(r["arm"], r["deploy"]): int(r["long_prefill_chunks"]) for r in csv.DictReader(fh)}
    assert cells == expected
    summary = json.loads((run / "summary.json").read_text())
    assert {(c["arm"], c["deploy"]): c["long_prefill_chunks"] for c in summary["cells"]} == expected
    # The per-request tables: requests.csv and summary.json's rows, per request.
    per_request: dict[tuple[str, str, str], int] = {}
    for s in spans:
        key = (s["arm"], s["deploy"], s["request"])
        per_request[key] = per_request.get(key, 0) + s["long_chunk"]
    with open(run / "requests.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["Arm"], r["Deploy"], r["Prompt"]): int(r["Long prefill chunks"]) for r in rows} == per_request
    assert list(summary["requests"][0])[9:12] == ["Non-zero-offset chunks", "Cross-boundary replays",
                                                  "Long prefill chunks"]
    # summary.md's extended table, the terminal's (its header may wrap: the column is found by its values),
    # and report.html's per-request table with the metric's compact heading and its label as the tooltip.
    markdown = (run / "summary.md").read_text()
    assert "| Cross-boundary replays | Long prefill chunks | Multi-position decode spans |" in markdown
    stress_row = next(line for line in markdown.splitlines() if line.startswith("| pr | stress | 1 |"))
    assert f"| {expected[('pr', 'stress')]} |" in stress_row
    assert "Long" in res.stdout and "prefill" in res.stdout
    html = (run / "report.html").read_text()
    assert '<th title="non-zero-offset prefill chunks of 16 positions or more">Long<br>chunks</th>' in html

    # The gate takes it as a metric (max_/min_), with its label in the verdict.
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: no-long-chunks\n    arm: pr\n    deploy: stress\n"
                     "    max_long_prefill_chunks: 0\n")
    gate = _cli(root, "gate", str(run), "--rules", str(rules))
    assert gate.returncode == 1, gate.stdout[-3000:]
    assert (f"FAIL  max_long_prefill_chunks: non-zero-offset prefill chunks of 16 positions or more = "
            f"{expected[('pr', 'stress')]} > 0") in gate.stdout
