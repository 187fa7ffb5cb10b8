"""End to end on a real ``vllm serve --omni``, on CPU: tiny random Qwen2.5-Omni, arms main and pr bound
into the real Talker worker, the CPU reference and stress deploys (``cpu-reference``: the reference
deploy with the stress deploy's Talker length), four prompts.

Runs the CLI as a user would (``omni-stress tiny-model``, then ``omni-stress run --backend vllm-omni``)
and asserts on the real trace: what vLLM-Omni 0.30.0's runner scheduled and what each arm returned.
Needs the real environment (``scripts/install-real-cpu.sh`` -> ``.venv-omni``); skipped without it,
except under ``OMNI_STRESS_REQUIRE_REAL=1`` (``.ci/run`` sets it), where its absence fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from harness.records import read_requests, read_spans

ROOT = Path(__file__).resolve().parents[1]
REAL_PY = ROOT / ".venv-omni" / "bin" / "python"
CLI = [sys.executable, "-m", "harness.cli"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not REAL_PY.exists():
        if os.environ.get("OMNI_STRESS_REQUIRE_REAL") == "1":
            pytest.fail(f"OMNI_STRESS_REQUIRE_REAL=1 but {REAL_PY} is missing (scripts/install-real-cpu.sh)")
        pytest.skip("no real CPU environment (.venv-omni): run scripts/install-real-cpu.sh")
    tmp = tmp_path_factory.mktemp("real")
    model = tmp / "tiny"
    t0 = time.monotonic()
    built = subprocess.run([*CLI, "tiny-model", str(model), "--python", str(REAL_PY)], cwd=tmp,
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    summary = json.loads(built.stdout.strip().splitlines()[-1])
    assert summary["vocab_size"] == 152064 and summary["hidden_size"] == 64
    sys.stderr.write(f"[real e2e] tiny model: {time.monotonic() - t0:.1f} s\n")
    t0 = time.monotonic()
    run = subprocess.run(
        [*CLI, "run", "--backend", "vllm-omni", "--platform", "cpu", "--serve-python", str(REAL_PY),
         "--model", str(model), "--arm", "main", "--arm", "pr", "--deploy", "cpu-reference", "--deploy", "cpu-stress",
         "--prompts", "cpu_smoke", "--asr", "none", "--out", str(tmp), "--run-id", "real", "--quiet",
         "--health-timeout", "900", "--request-timeout", "900"],
        cwd=tmp, capture_output=True, text=True, timeout=2700)
    sys.stderr.write(f"[real e2e] run: {time.monotonic() - t0:.1f} s\n{run.stdout}\n")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return tmp / "real"


def _spans(run_dir: Path) -> dict[tuple[str, str], list]:
    cells: dict[tuple[str, str], list] = defaultdict(list)
    for s in read_spans(run_dir):
        cells[(s.arm, s.deploy)].append(s)
    return cells


def test_every_request_answered_with_audio(real_run: Path) -> None:
    records = read_requests(real_run)
    by_cell = defaultdict(list)
    for r in records:
        by_cell[(r.arm, r.deploy)].append(r)
    assert sorted(by_cell) == [("main", "cpu-reference"), ("main", "cpu-stress"), ("pr", "cpu-reference"),
                               ("pr", "cpu-stress")]
    for cell, recs in by_cell.items():
        assert sorted(r.prompt_id for r in recs) == ["c01-tea", "c02-plants", "c03-run", "c04-stars"], cell
        for r in recs:
            assert r.error is None, (cell, r.prompt_id, r.error)
            assert r.backend == "vllm-omni"
            wav = real_run / r.audio_path
            assert wav.read_bytes()[:4] == b"RIFF", wav
            assert r.talker_prompt_len is not None and r.events.talker_calls > 0


def test_reference_deploy_has_no_stress_events(real_run: Path) -> None:
    cells = _spans(real_run)
    for arm in ("main", "pr"):
        spans = cells[(arm, "cpu-reference")]
        assert spans, arm
        assert sum(s.nonzero_offset for s in spans) == 0, arm
        assert sum(s.cross_boundary for s in spans) == 0, arm


def test_stress_deploy_chunks_and_replays_across_the_prompt(real_run: Path) -> None:
    cells = _spans(real_run)
    records = read_requests(real_run)
    for arm in ("main", "pr"):
        spans = cells[(arm, "cpu-stress")]
        assert sum(s.nonzero_offset for s in spans) > 0, arm
        assert sum(s.cross_boundary for s in spans) >= 1, arm
        assert all(s.n <= 32 for s in spans), arm  # max_num_batched_tokens
        assert sum(r.preemptions for r in records if (r.arm, r.deploy) == (arm, "cpu-stress")) > 0, arm


def test_main_mismatches_every_multi_row_prefill_call_and_misaligns(real_run: Path) -> None:
    spans = _spans(real_run)[("main", "cpu-stress")]
    prefill = [s for s in spans if s.c < s.P and s.n > 1]
    assert prefill
    assert all(s.rows != s.n for s in prefill), [(s.c, s.n, s.rows) for s in prefill if s.rows == s.n]
    assert all(s.rows == s.P for s in prefill)  # 0.30.0's prefill branch returns the whole prompt
    assert sum((s.misaligned_text or 0) for s in spans) > 0


def test_pr_conforms_in_the_real_server(real_run: Path) -> None:
    cells = _spans(real_run)
    for deploy in ("cpu-reference", "cpu-stress"):
        spans = cells[("pr", deploy)]
        assert all(s.misaligned_text is not None and s.misaligned_end is not None for s in spans), deploy
        assert sum(s.row_mismatch for s in spans) == 0, deploy
        assert sum(s.misaligned_text + s.misaligned_end for s in spans) == 0, deploy
        assert all(s.error is None for s in spans), deploy


def test_manifest_says_which_implementation_ran(real_run: Path) -> None:
    manifest = json.loads((real_run / "manifest.json").read_text())
    want = {"main": "harness.talkers.main:MainTalker", "pr": "harness.talkers.pr:FixedTalker"}
    for cell in manifest["cells"]:
        sys.stderr.write(f"[real e2e] {cell['arm']}/{cell['deploy']}: {json.dumps(cell['serve_seconds'])}\n")
        assert cell["serve_seconds"]["server_start_s"] > 0 and cell["serve_seconds"]["requests_s"] > 0
        impl = cell["implementation"]
        assert impl["platform"] == "cpu" and impl["arm"] == want[cell["arm"]]
        workers = impl["workers"]
        assert workers and all(w["arm"] == want[cell["arm"]] and "error" not in w for w in workers), workers
        assert all(w["vllm-omni_version"] == "0.30.0" and w["model_sha256"] for w in workers)
        assert "talker_preprocess" in workers[0]["bound_methods"]
