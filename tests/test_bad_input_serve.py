"""Bad input to the real backend (``--backend vllm-omni``): a server that never becomes healthy or dies, malformed
responses (the fake server of tests/fake_vllm), the dry run without the real environment, stray environment
variables (docs/robustness.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from harness.records import read_requests

from clikit import _one_prompt, _run_args, assert_one_line_error, errors_column
from conftest import CliResult, REPO, SMALL_PROMPTS, invoke_cli


# ----------------------------------------------------------------------------- real backend, fake server


@pytest.fixture
def fake_arms(tmp_path):
    """An arms file whose arm ``main`` serves with the fake ``vllm`` of tests/fake_vllm (``FAKE_VLLM_*`` env)."""

    def write(**env: str) -> str:
        fake = REPO / "tests" / "fake_vllm" / "fake_vllm_serve.py"
        # the fake is "an installed vLLM-Omni as it is": no arm bound into it, no contract check on its rows
        arms = {"arms": {"main": {"talker": "harness.families.qwen2_5_omni.main:MainTalker",
                                  "serve": {"command": [sys.executable, str(fake)], "bind_arm": False,
                                            "env": {"OMNI_STRESS_CONTRACT": "0", **env}}}}}
        path = tmp_path / "arms.yaml"
        path.write_text(yaml.safe_dump(arms))
        return str(path)

    return write


def _serve(tmp: Path, arms_file: str, *extra: str) -> CliResult:
    return invoke_cli("run", "--backend", "vllm-omni", "--model", "fake/model", "--arms-file", arms_file,
                      "--arm", "main", "--deploy", "stress", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS),
                      "--out", str(tmp / "out"), "--run-id", "r", "--request-timeout", "20", *extra)


def _serve_error(res: CliResult) -> str:
    """The real backend's failures: exit 2, one ``omni-stress: error:`` line, then the server log's tail."""
    assert res.exit_code == 2, (res.stderr, res.stdout[-2000:])
    assert "Traceback" not in res.stderr + res.stdout
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("omni-stress: error: ")]
    assert len(errors) == 1, res.stderr
    tail = res.stderr.split(errors[0], 1)[1].splitlines()[1:]
    assert not tail or tail[0].startswith("--- last lines of server-main-stress.log"), res.stderr
    return errors[0]


@pytest.mark.slow
def test_vllm_omni_server_never_healthy(tmp_path, fake_arms):
    line = _serve_error(_serve(tmp_path, fake_arms(FAKE_VLLM_NEVER_HEALTHY="1"), "--health-timeout", "1.5"))
    assert "did not become healthy within 1.5 s" in line and "server-main-stress.log" in line


@pytest.mark.slow
def test_vllm_omni_server_crashing_mid_run_is_a_finding_not_the_end_of_the_run(tmp_path, fake_arms):
    """Issue 31: a crash takes the requests it was sent (errors naming its last traceback line), the run goes
    on, the table says crashed, the manifest keeps what the server said, and the gate fails the arm."""
    res = _serve(tmp_path, fake_arms(FAKE_VLLM_DIE_AFTER="1"))
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stdout
    run_dir = tmp_path / "out" / "r"
    records = read_requests(run_dir)
    log = run_dir / "server-main-stress.log"
    line = "RuntimeError: talker preprocess: index 37 is out of bounds for dimension 0 with size 32 (fake crash)"
    assert len(records) == 4 and sum(r.error is None for r in records) == 1
    assert {r.error for r in records if r.error} == {f"server crashed (exit code 3): {line}; log: {log}"}
    assert errors_column(res.stdout) == {"main": 3}
    assert "3 (3 crashed)" in res.stdout
    (cell,) = json.loads((run_dir / "manifest.json").read_text())["cells"]
    assert cell["crashes"] == [{"server": 1, "exit_code": 3, "error": line, "requests_in_flight": 3,
                                "requests_not_sent": 0}]
    gate = invoke_cli("gate", str(run_dir))
    # this run has no reference deploy for the stress rules, but what was measured failed: exit 1 (issue 47)
    assert gate.exit_code == 1, gate.stdout + gate.stderr
    lines = gate.stdout.splitlines()
    assert lines[0].startswith("FAILED candidate-contract: main/stress run 1 [candidate]: max_row_count_mismatches: ")
    assert "FAIL   candidate-contract: main/stress run 1 [candidate]" in lines
    assert lines.count("         FAIL  max_crashed: requests a server crash took down = 3 > 0 (the server crashed: see "
                       "the requests' errors and the manifest's cells[].crashes)") == 2  # on every rule of the cell
    assert ("         FAIL  max_crashed: requests a server crash took down = 3 > 0 (the server crashed: see the "
            "requests' errors and the manifest's cells[].crashes)") in gate.stdout.splitlines()


@pytest.mark.slow
def test_vllm_omni_malformed_body_and_undecodable_audio_are_request_errors(tmp_path, fake_arms):
    res = _serve(tmp_path, fake_arms(FAKE_VLLM_MALFORMED="p03-sleep", FAKE_VLLM_BAD_AUDIO="p05-garden"))
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    records = {r.prompt_id: r for r in read_requests(tmp_path / "out" / "r")}
    assert sorted(pid for pid, r in records.items() if r.error) == ["p03-sleep", "p05-garden"]
    assert errors_column(res.stdout) == {"main": 2}


# ----------------------------------------------------------------------------- 20: dry run without .venv-omni


def test_20_dry_run_without_the_real_environment_prints_what_would_run(tmp_path, monkeypatch):
    import harness.serve.backend as serve_backend

    monkeypatch.delenv(serve_backend.ENV_SERVE_PYTHON, raising=False)
    monkeypatch.setattr(serve_backend, "DEFAULT_SERVE_PYTHON", ".venv-not-installed/bin/python")
    args = _run_args(tmp_path, "--backend", "vllm-omni", "--arm", "main", "--deploy", "stress")
    res = invoke_cli(*args, "--dry-run")
    assert res.exit_code == 0, res.stderr
    assert "serve Qwen/Qwen2.5-Omni-7B --omni" in res.stdout
    assert ".venv-not-installed/bin/python' is not installed here: a real run on this machine refuses" in res.stdout
    assert not (tmp_path / "out").exists()
    # only a real run refuses
    assert_one_line_error(invoke_cli(*args), "arm 'main' has no 'serve' entry", "no default real environment")


def test_20_dry_run_with_a_missing_serve_python(tmp_path):
    res = invoke_cli(*_run_args(tmp_path, "--backend", "vllm-omni", "--arm", "pr", "--deploy", "reference",
                                "--serve-python", "/nonexistent/venv/bin/python", "--dry-run"))
    assert res.exit_code == 0, res.stderr
    assert "# interpreter '/nonexistent/venv/bin/python' is not installed here" in res.stdout
    assert "/nonexistent/venv/bin/python -m vllm.entrypoints.cli.main serve" in res.stdout


# ----------------------------------------------------------------------------- 22: stray OMNI_STRESS_* in the shell

_ENV_DUMPER = """\
import json, os, runpy, sys
with open(os.environ["ENV_DUMP_FILE"], "a", encoding="utf-8") as fh:
    fh.write(json.dumps({{k: v for k, v in os.environ.items() if k.startswith("OMNI_STRESS_")}}) + "\\n")
sys.argv = [{fake!r}, *sys.argv[1:]]
runpy.run_path({fake!r}, run_name="__main__")
"""


def test_22_stray_omni_stress_variables_never_reach_the_server(tmp_path, monkeypatch):
    fake = str(REPO / "tests" / "fake_vllm" / "fake_vllm_serve.py")
    wrapper = tmp_path / "dump_env_then_fake.py"
    wrapper.write_text(_ENV_DUMPER.format(fake=fake))
    dump = tmp_path / "env.jsonl"
    arms = {"arms": {"main": {"talker": "harness.families.qwen2_5_omni.main:MainTalker",
                              "serve": {"command": [sys.executable, str(wrapper)], "bind_arm": False,
                                        "env": {"OMNI_STRESS_CONTRACT": "0", "ENV_DUMP_FILE": str(dump)}}}}}
    arms_file = tmp_path / "arms.yaml"
    arms_file.write_text(yaml.safe_dump(arms))
    # what a user's shell may still hold from an earlier session
    monkeypatch.setenv("OMNI_STRESS_ARM", "tests.fixtures.plugins:raising_talker")
    monkeypatch.setenv("OMNI_STRESS_TRACE_TARGET", "nowhere:Nothing")
    monkeypatch.setenv("OMNI_STRESS_SOMETHING_ELSE", "1")
    res = invoke_cli("run", "--backend", "vllm-omni", "--model", "fake/model", "--arms-file", str(arms_file),
                     "--arm", "main", "--deploy", "stress", "--asr", "none", "--quiet", "--prompts", _one_prompt(tmp_path),
                     "--out", str(tmp_path / "out"), "--run-id", "r", "--request-timeout", "20")
    assert res.exit_code == 0, res.stderr
    seen = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(seen) == 1
    assert sorted(seen[0]) == ["OMNI_STRESS_CONTRACT", "OMNI_STRESS_TRACE"], seen[0]
    assert seen[0]["OMNI_STRESS_TRACE"].startswith(str(tmp_path / "out" / "r" / "serve"))
