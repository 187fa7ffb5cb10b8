"""Issue 24: the next round of bad inputs, each through the CLI as a user types it.

Every case asserts the exit code and the one ``omni-stress: error:`` line (naming the file, field,
character or option), or, where the input is not an error (a read-only run directory, a Latin-1
terminal), that the run's output is printed and nothing measured is lost. The case numbers are
the issue's; docs/robustness.md has the same table.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_PROMPTS, invoke_cli
from test_bad_input import assert_one_line_error

SMALL = yaml.safe_load(SMALL_PROMPTS.read_text())


def _one_prompt(tmp: Path) -> str:
    """The small prompt set cut to its first prompt: a sim run of one cell in a second or two."""
    data = copy.deepcopy(SMALL)
    data["prompts"] = data["prompts"][:1]
    path = tmp / "one-prompt.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _run_args(tmp: Path, *extra: str) -> list[str]:
    return ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp / "out"), *extra]


# ----------------------------------------------------------------------------- 1: control characters in YAML

STRESS_TEXT = (REPO / "deploy_configs" / "stress.yaml").read_text()
ARMS_TEXT = (REPO / "deploy_configs" / "arms.yaml").read_text()
GATES_TEXT = (REPO / "deploy_configs" / "gates.yaml").read_text()


def _with_char(text: str, ch: str, line: int) -> str:
    """``text`` with ``ch`` put at the end of its line ``line`` (1-based) (inside a comment or value)."""
    lines = text.split("\n")
    lines[line - 1] += ch
    return "\n".join(lines)


CONTROL = [("nul", "\x00", "U+0000 (NUL)"), ("ansi-escape", "\x1b[31m", "U+001B (ESC"),
           ("form-feed", "\x0c", "U+000C (form feed)")]


@pytest.mark.parametrize("which", ["deploy", "prompts", "arms-file"])
@pytest.mark.parametrize("name,ch,said", CONTROL, ids=[c[0] for c in CONTROL])
def test_1_control_character_in_a_config_names_file_line_and_character(tmp_path, which, name, ch, said):
    source = {"deploy": STRESS_TEXT, "prompts": SMALL_PROMPTS.read_text(), "arms-file": ARMS_TEXT}[which]
    path = tmp_path / f"{which}.yaml"
    path.write_bytes(_with_char(source, ch, 3).encode())
    res = invoke_cli(*_run_args(tmp_path, f"--{which}", str(path)))
    line = assert_one_line_error(res, f"{path}: line 3 column ", said, "not allowed in YAML")
    assert "\x1b" not in line and "\x00" not in line and "\x0c" not in line  # the character itself is never echoed
    assert not (tmp_path / "out").exists()


def test_1_control_character_in_gate_rules(tmp_path, small_run):
    rules = tmp_path / "gates.yaml"
    rules.write_bytes(_with_char(GATES_TEXT, "\x1b[31m", 2).encode())
    assert_one_line_error(invoke_cli("gate", str(small_run), "--rules", str(rules)),
                          f"{rules}: line 2 column ", "U+001B (ESC")


# ----------------------------------------------------------------------------- 9: --arm-timeout nan


@pytest.mark.parametrize("option,value", [("--arm-timeout", "nan"), ("--arm-timeout", "inf"), ("--arm-timeout", "-1"),
                                          ("--arm-timeout", "-inf"), ("--health-timeout", "nan"),
                                          ("--request-timeout", "inf"), ("--request-timeout", "-5")])
def test_9_timeouts_must_be_finite_numbers(tmp_path, option, value):
    res = invoke_cli(*_run_args(tmp_path, f"{option}={value}"))
    assert_one_line_error(res, f"Invalid value for '{option}'", "(see 'omni-stress run --help')")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 12: YAML values in messages


def _alias_bomb(levels: int) -> str:
    """``arms.x.talker`` a list that expands to 9**levels strings from a few hundred bytes."""
    lines = ["arms:", "  x:", '    talker: [&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"],']
    for k in range(1, levels + 1):
        lines.append(f"      &a{k} [" + ",".join([f"*a{k - 1}"] * 9) + "]" + ("," if k < levels else "]"))
    return "\n".join(lines) + "\n"


def test_12_alias_bomb_in_arms_file_gives_a_short_line(tmp_path):
    path = tmp_path / "arms.yaml"
    path.write_text(_alias_bomb(8))  # 9**8 = 43 million strings: a full repr is ~350 MB
    assert path.stat().st_size < 600
    res = invoke_cli(*_run_args(tmp_path, "--arms-file", str(path), "--arm", "x"))
    line = assert_one_line_error(res, f"{path}: arms.x.talker: must be a non-empty string, got [[")
    assert len(line) < 200 + len(f"omni-stress: error: {path}: arms.x.talker: must be a non-empty string, got ") + 10
    assert line.endswith("...")


def test_12_long_string_value_is_cut(tmp_path):
    deploy = yaml.safe_load(STRESS_TEXT)
    deploy["talker"]["max_num_seqs"] = "x" * 100_000
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(deploy))
    line = assert_one_line_error(invoke_cli(*_run_args(tmp_path, "--deploy", str(path))),
                                 "long.yaml: talker.max_num_seqs: must be a positive integer, got 'xxx")
    assert len(line) < 400


# ----------------------------------------------------------------------------- 18: unique default run ids


def test_18_two_runs_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    import datetime as real_dt

    import harness.pipeline

    frozen = real_dt.datetime(2026, 1, 2, 3, 4, 5)

    class _Frozen(real_dt.datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003 - the signature of datetime.now
            return frozen

    class _Module:
        datetime = _Frozen

    monkeypatch.setattr(harness.pipeline, "_dt", _Module)
    out = tmp_path / "out"
    args = ["run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers", "0",
            "--prompts", _one_prompt(tmp_path), "--out", str(out)]
    first, second = invoke_cli(*args), invoke_cli(*args)
    assert first.exit_code == 0, first.stderr
    assert second.exit_code == 0, second.stderr
    made = sorted(p.name for p in out.iterdir())
    assert len(made) == 2 and all(name.startswith("20260102-030405-main-") for name in made), made
    for name in made:
        assert f"results: {out / name}" in (first.stdout + second.stdout)


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
    arms = {"arms": {"main": {"talker": "harness.talkers.main:MainTalker",
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
