"""Issue 34, item 2: ``--trace off|spans|contract`` reaches the real server's Talker worker, is recorded
per cell in the manifest, named by the report, and a cell run at ``off`` is never read as zero events
(the gate refuses the rules that need span facts). The sim refuses the option: it has no plugin."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from clikit import assert_one_line_error
from conftest import REPO, SMALL_PROMPTS, invoke_cli
from harness.config import ArmSpec, ServeSettings
from harness.serve.backend import ServeOptions, cell_trace_level, server_env, server_env_overrides


def test_a_bad_level_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = invoke_cli("run", "--backend", "vllm-omni", "--trace", "loud", "--out", str(tmp_path))
    assert_one_line_error(res, "--trace", "'loud'")


def test_the_sim_refuses_the_option(tmp_path: Path) -> None:
    res = invoke_cli("run", "--trace", "off", "--asr", "none", "--prompts", str(SMALL_PROMPTS), "--out",
                     str(tmp_path))
    assert_one_line_error(res, "--trace off applies to --backend vllm-omni")
    assert list(tmp_path.iterdir()) == []


def test_the_level_travels_in_the_server_environment(tmp_path: Path) -> None:
    arm = ArmSpec(name="pr", talker="harness.families.qwen2_5_omni.pr:FixedTalker")
    options = ServeOptions(model="m", platform="cpu", default_python=sys.executable)
    assert "OMNI_STRESS_TRACE_LEVEL" not in server_env_overrides(arm, tmp_path, options)  # the default
    for level in ("off", "spans", "contract"):
        env = server_env(arm, tmp_path, ServeOptions(model="m", platform="cpu", default_python=sys.executable,
                                                     trace_level=level), base={})
        assert cell_trace_level(env) == level
    # an arm whose serve env turns the check off (the older switch) runs at spans unless --trace says otherwise
    quiet = ArmSpec(name="q", talker="harness.families.qwen2_5_omni.pr:FixedTalker",
                    serve=ServeSettings(python=sys.executable, env={"OMNI_STRESS_CONTRACT": "0"}))
    assert cell_trace_level(server_env(quiet, tmp_path, options, base={})) == "spans"
    assert cell_trace_level(server_env(quiet, tmp_path, ServeOptions(model="m", platform="cpu", trace_level="contract"),
                                       base={})) == "spans"  # --trace contract is the default: the arm's env holds
    assert cell_trace_level(server_env(quiet, tmp_path, ServeOptions(model="m", platform="cpu", trace_level="off"),
                                       base={})) == "off"


def test_the_dry_run_shows_the_level(tmp_path: Path) -> None:
    res = invoke_cli("run", "--backend", "vllm-omni", "--dry-run", "--trace", "spans", "--arm", "pr", "--deploy",
                     "stress", "--platform", "gpu", "--out", str(tmp_path), "--run-id", "d")
    assert res.exit_code == 0, res.stderr
    assert "OMNI_STRESS_TRACE_LEVEL=spans" in res.stdout


@pytest.mark.slow
def test_a_run_at_off_is_recorded_reported_and_refused_by_the_gate(tmp_path: Path) -> None:
    fake = REPO / "tests" / "fake_vllm" / "fake_vllm_serve.py"
    arms = {"arms": {"main": {"talker": "harness.families.qwen2_5_omni.main:MainTalker",
                              "serve": {"command": [sys.executable, str(fake)], "bind_arm": False,
                                        "env": {"OMNI_STRESS_CONTRACT": "0"}}}}}
    arms_file = tmp_path / "arms.yaml"
    arms_file.write_text(yaml.safe_dump(arms))
    args = ["run", "--backend", "vllm-omni", "--model", "fake/model", "--arms-file", str(arms_file), "--arm", "main",
            "--deploy", "stress", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--request-timeout", "20"]
    res = invoke_cli(*args, "--out", str(tmp_path / "out"), "--run-id", "r", "--trace", "off")
    assert res.exit_code == 0, res.stderr
    assert "no Talker spans were traced" not in res.stderr  # off on purpose: no warning
    run = tmp_path / "out" / "r"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["trace"] == "off" and [c["trace"] for c in manifest["cells"]] == ["off"]
    assert "Trace level (--trace): off in every cell" in res.stdout and "read n/a (not 0)" in res.stdout
    seed_row = next(ln for ln in res.stdout.splitlines() if ln.startswith("main, stress deploy"))
    assert seed_row.split()[-2:] == ["n/a", "n/a"], seed_row  # the event columns: never traced, not 0
    gate = invoke_cli("gate", str(run))
    assert gate.exit_code == 2, gate.stdout + gate.stderr
    assert "ran with --trace off (no span facts); rerun with --trace spans or contract" in gate.stdout + gate.stderr
    resumed = invoke_cli(*args, "--resume", str(run), "--trace", "spans")
    assert_one_line_error(resumed, "trace differ from the manifest (was 'off', now 'spans')")
