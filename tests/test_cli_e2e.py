"""End to end: the CLI as a user runs it, in a temp directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.records import read_requests
from harness.spanstore import read_spans

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
FAKE_VLLM = Path(__file__).parent / "fake_vllm" / "fake_vllm_serve.py"
CLI = [sys.executable, "-m", "harness.cli"]

pytestmark = pytest.mark.slow


def omni(*args: str, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "omni-stress"
    return subprocess.run([str(script), *args] if script.exists() else [*CLI, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    proc = omni("run", "--asr", "none", "--quiet", "--prompts", str(DATA / "prompts_e2e.yaml"),
                "--deploy", "reference", "--deploy", "stress", "--deploy", str(DATA / "deploy_tiny_kv.yaml"),
                "--out", str(out), "--run-id", "e2e", cwd=out)
    assert proc.returncode == 0, proc.stderr
    return out / "e2e", proc


def _cell(records, arm, deploy):
    return {r.prompt_id: r for r in records if r.arm == arm and r.deploy == deploy}


def test_sim_run_writes_the_run_directory(sim_run):
    run_dir, proc = sim_run
    for name in ("manifest.json", "requests.jsonl", "summary.csv", "summary.md", "report.html"):
        assert (run_dir / name).is_file(), name
    # spans: the span store, one compressed file per cell (issue 48); export-spans gives them as JSON lines
    assert not (run_dir / "spans.jsonl").exists()
    assert len(list((run_dir / "spans").glob("*.arrow"))) == 6
    export = omni("export-spans", str(run_dir), cwd=run_dir)
    assert export.returncode == 0, export.stderr
    lines = export.stdout.splitlines()
    assert len(lines) == len(read_spans(run_dir)) and all(line == json.dumps(json.loads(line), sort_keys=True)
                                                          for line in lines)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["span_store"] == "arrow-ipc-zstd/1"
    assert manifest["finished"] and manifest["backend"] == "sim"
    assert [(c["arm"], c["deploy"]) for c in manifest["cells"]] == [
        ("main", "reference"), ("main", "stress"), ("main", "tinykv"),
        ("pr", "reference"), ("pr", "stress"), ("pr", "tinykv")]
    assert len(read_requests(run_dir)) == 18
    assert "main, stress deploy" in proc.stdout and "pr, reference deploy" in proc.stdout
    assert "oracle transcript" in proc.stdout


def test_sim_events_zero_in_reference_nonzero_under_stress(sim_run):
    run_dir, _ = sim_run
    spans = read_spans(run_dir)
    for arm in ("main", "pr"):
        ref = [s for s in spans if s.arm == arm and s.deploy == "reference"]
        assert sum(s.nonzero_offset for s in ref) == 0 and sum(s.cross_boundary for s in ref) == 0
        stress = [s for s in spans if s.arm == arm and s.deploy == "stress"]
        assert sum(s.nonzero_offset for s in stress) > 0
        tiny = [s for s in spans if s.arm == arm and s.deploy == "tinykv"]
        assert sum(s.cross_boundary for s in tiny) > 0
    assert sum(s.misaligned for s in spans if s.arm == "pr") == 0
    assert sum(s.misaligned for s in spans if s.arm == "main" and s.deploy == "reference") > 0  # no EOS/PAD rows


def test_sim_pr_under_stress_speaks_exactly_what_it_speaks_in_reference(sim_run):
    run_dir, _ = sim_run
    records = read_requests(run_dir)
    ref = _cell(records, "pr", "reference")
    for deploy in ("stress", "tinykv"):
        got = _cell(records, "pr", deploy)
        assert {k: r.oracle_transcript for k, r in got.items()} == {k: r.oracle_transcript for k, r in ref.items()}
    # same frames per text token as the reference: the very same codec tokens (batch invariance)
    got = _cell(records, "pr", "stress")
    assert {k: r.codec_tokens for k, r in got.items()} == {k: r.codec_tokens for k, r in ref.items()}
    assert all(r.oracle_wer == 0.0 for r in ref.values())
    # both arms speak identical words on the reference deploy
    main_ref = _cell(records, "main", "reference")
    assert {k: r.oracle_transcript for k, r in main_ref.items()} == {k: r.oracle_transcript for k, r in ref.items()}


def test_sim_main_fails_under_stress(sim_run):
    run_dir, _ = sim_run
    records = read_requests(run_dir)
    for deploy in ("stress", "tinykv"):
        cell = _cell(records, "main", deploy)
        assert all(r.oracle_wer > 0.5 for r in cell.values())
    # as in the seed: on main under stress every prefill call returned a row count != the span, except
    # one-token prefill tails, which main routes to its decode branch (one row)
    cell = _cell(records, "main", "stress")
    ev = [r.events for r in cell.values()]
    assert all(e.prefill_row_count_mismatches == e.prefill_calls - e.one_token_tails > 0 for e in ev)


def test_gate_fails_a_stress_run_that_stressed_too_little(sim_run, tmp_path):
    run_dir, _ = sim_run
    proc = omni("gate", str(run_dir), "--junit", str(tmp_path / "gate.xml"), cwd=tmp_path)
    # three prompts fit the stress deploy's 127 blocks: nothing is preempted, so no replay crosses
    # the prompt boundary, and the default rules refuse to call that a stress run
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL  min_cross_boundary_replays: replays crossing the prompt boundary = 0 < 1" in proc.stdout
    assert (tmp_path / "gate.xml").is_file()


def test_list_shows_arms_deploys_prompts(tmp_path):
    proc = omni("list", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "harness.families.qwen2_5_omni.main:MainTalker" in proc.stdout
    assert "num_gpu_blocks_override=128" in proc.stdout
    assert "16 prompts" in proc.stdout


def test_real_backend_against_fake_server(tmp_path):
    arms = tmp_path / "arms.yaml"
    arms.write_text(
        "arms:\n"
        "  main:\n"
        "    talker: harness.families.qwen2_5_omni.main:MainTalker\n"
        f"    serve: {{command: [{json.dumps(sys.executable)}, {json.dumps(str(FAKE_VLLM))}], bind_arm: false}}\n"
    )
    common = ["--backend", "vllm-omni", "--arms-file", str(arms), "--arm", "main", "--deploy", "stress",
              "--prompts", str(DATA / "prompts_e2e.yaml"), "--model", "fake/Qwen2.5-Omni-7B"]
    dry = omni("run", *common, "--dry-run", "--out", str(tmp_path), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "--omni" in dry.stdout and "--stage-overrides" in dry.stdout and "127.0.0.1" in dry.stdout
    proc = omni("run", *common, "--asr", "none", "--quiet", "--out", str(tmp_path), "--run-id", "real",
                "--health-timeout", "60", "--request-timeout", "30", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "real"
    records = read_requests(run_dir)
    assert sorted(r.prompt_id for r in records) == ["p01-weather", "p03-sleep", "p05-garden"]
    assert all(r.backend == "vllm-omni" and r.audio_path and r.error is None for r in records)
    assert all((run_dir / r.audio_path).is_file() for r in records)
    spans = read_spans(run_dir)
    assert spans and all(s.arm == "main" and s.deploy == "stress" for s in spans)
    assert (run_dir / "server-main-stress.log").is_file()
    assert "main, stress deploy" in proc.stdout
