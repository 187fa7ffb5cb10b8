"""A bound subclass arm in a real ``vllm serve --omni`` on CPU (issue 24, case 21): one server start, in its own
module so that, under pytest-xdist, it may run beside the main real run (tests/test_real_cpu_e2e.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.records import read_requests
from harness.spanstore import read_spans

from conftest import REAL_PY

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def test_a_bound_subclass_arm_keeps_its_class_in_the_real_server(tmp_path: Path, tiny_model: Path) -> None:
    """Issue 24 case 21: an ordinary subclass of ``pr`` that calls ``super()`` (and reads a class
    attribute through a property) bound into the real Talker worker: the engine stays up, every
    request is answered, and it delivers the contract's rows and says each reply under stress.
    (Its own server, without the main run: under xdist it may run on the other worker.)"""
    model = tiny_model
    out = tmp_path / "subclass"
    run = subprocess.run(
        [*CLI, "run", "--backend", "vllm-omni", "--platform", "cpu", "--serve-python", str(REAL_PY),
         "--model", str(model), "--arm", "superpr=tests.fixtures.subclass_arm:SuperPr", "--deploy", "cpu-stress",
         "--prompts", "cpu_smoke", "--asr", "none", "--out", str(out), "--run-id", "sub", "--quiet",
         "--health-timeout", "900", "--request-timeout", "900"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800)  # cwd: the arm's module is importable from here
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    records = read_requests(out / "sub")
    assert sorted(r.prompt_id for r in records) == ["c01-tea", "c02-plants", "c03-run", "c04-stars"]
    assert all(r.error is None and r.oracle_wer == 0.0 for r in records), [(r.prompt_id, r.error) for r in records]
    spans = read_spans(out / "sub")
    assert spans and all(s.error is None and s.misaligned_text == 0 and s.misaligned_end == 0 for s in spans)
    manifest = json.loads((out / "sub" / "manifest.json").read_text())
    workers = manifest["cells"][0]["implementation"]["workers"]
    assert workers and all(w["arm"] == "tests.fixtures.subclass_arm:SuperPr" and "error" not in w for w in workers)
