"""Issue 24: the next round of bad inputs, each through the CLI as a user types it.

Every case asserts the exit code and the one ``omni-stress: error:`` line (naming the file, field,
character or option), or, where the input is not an error (a read-only run directory, a Latin-1
terminal), that the run's output is printed and nothing measured is lost. The case numbers are
the issue's; docs/robustness.md has the same table.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_PROMPTS, invoke_cli, run_cli
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


# ----------------------------------------------------------------------------- run directories: 2, 3, 4, 5, 17


@pytest.fixture(scope="module")
def one_run(tmp_path_factory) -> Path:
    """A finished sim run of one cell (main x reference, one prompt), copied by the tests that spoil it."""
    tmp = tmp_path_factory.mktemp("round3-run")
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers", "0",
                     "--prompts", _one_prompt(tmp), "--out", str(tmp / "out"), "--run-id", "one")
    assert res.exit_code == 0, res.stderr
    return tmp / "out" / "one"


def _copy_run(run: Path, where: Path) -> Path:
    shutil.copytree(run, where)
    return where


def _as_nobody(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``omni-stress ARGS`` as user nobody (root writes into read-only folders)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv to drop root")
    mpl = cwd / "mplconfig"
    mpl.mkdir(exist_ok=True)
    mpl.chmod(0o777)
    return subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "harness.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "MPLCONFIGDIR": str(mpl), "PYTHONPATH": str(REPO), **(env or {})})


def test_2_report_on_a_read_only_run_directory_prints_the_tables(one_run):
    # tmp_path is private to root: a world-readable folder for user nobody
    base = Path(tempfile.mkdtemp(prefix="omni-stress-ro-"))
    try:
        base.chmod(0o755)
        run = _copy_run(one_run, base / "run")
        for path in [run, *run.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222 | 0o444 | (0o111 if path.is_dir() else 0))
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        if os.geteuid() == 0:
            proc = _as_nobody("report", str(run), cwd=base)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        else:
            res = run_cli("report", str(run))
            code, stdout, stderr = res.exit_code, res.stdout, res.stderr
        assert code == 0, stderr
        assert "Traceback" not in stderr
        assert "main" in stdout and "reference" in stdout and "WER" in stdout
        warnings = [ln for ln in stderr.splitlines() if ln.startswith("omni-stress: warning:")]
        assert len(warnings) == 1, stderr
        assert f"{run}: could not rewrite the report files ({run}/summary.csv: Permission denied)" in warnings[0]
        assert "the tables above are complete" in warnings[0]
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    finally:
        for path in base.rglob("*"):
            path.chmod(0o755)
        shutil.rmtree(base)


def test_3_out_path_that_is_not_utf8(tmp_path):
    out = Path(os.fsdecode(bytes(tmp_path) + b"/bad\xff-out"))
    res = run_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers", "0",
                  "--prompts", _one_prompt(tmp_path), "--out", os.fsdecode(out), "--run-id", "r",
                  env={"PYTHONIOENCODING": "utf-8"})  # strict errors: what a UTF-8 terminal has
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert f"results: {tmp_path}/bad?-out/r" in res.stdout
    written = os.listdir(bytes(tmp_path))
    assert b"bad\xff-out" in written
    run = Path(os.fsdecode(bytes(tmp_path) + b"/bad\xff-out/r"))
    for name in ("summary.csv", "summary.md", "report.html", "requests.jsonl", "manifest.json"):
        assert (run / name).is_file(), name
    # the report reads the run back, and prints through a strict UTF-8 stdout too
    res = run_cli("report", os.fsdecode(run), "--no-write", env={"PYTHONIOENCODING": "utf-8"})
    assert res.exit_code == 0, res.stderr


def test_4_spans_file_that_is_a_folder(one_run, tmp_path):
    run = _copy_run(one_run, tmp_path / "run")
    (run / "spans.jsonl").unlink()
    (run / "spans.jsonl").mkdir()
    for command in (["report"], ["gate"], ["compare", str(one_run)]):
        res = invoke_cli(*command, str(run))
        assert_one_line_error(res, f"{run}/spans.jsonl: is a folder; a run directory's spans.jsonl must be a "
                                   "regular file")


@pytest.mark.parametrize("command", ["run", "report"])
def test_5_latin1_terminal_prints_the_tables_with_replacements(one_run, tmp_path, command):
    env = {"PYTHONIOENCODING": "latin-1"}
    if command == "run":
        res = run_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers",
                      "0", "--prompts", _one_prompt(tmp_path), "--out", str(tmp_path / "out"), "--run-id", "r", env=env)
        run = tmp_path / "out" / "r"
    else:
        run = _copy_run(one_run, tmp_path / "run")
        res = run_cli("report", str(run), env=env)
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert "?" in res.stdout and "\u2013" not in res.stdout  # the tables' en dash, replaced
    assert (run / "summary.md").read_text(encoding="utf-8").count("\u2013") > 0  # the files keep it
    assert len((run / "requests.jsonl").read_text().splitlines()) == 1  # nothing measured lost


def _outside_file(tmp: Path) -> Path:
    victim = tmp / "outside.txt"
    victim.write_text("not part of any run\n")
    return victim


@pytest.mark.parametrize("name", ["requests.jsonl", "spans.jsonl", "manifest.json"])
def test_17_symlinked_run_file_is_refused(one_run, tmp_path, name):
    run = _copy_run(one_run, tmp_path / "run")
    victim = _outside_file(tmp_path)
    victim.write_bytes((run / name).read_bytes())
    (run / name).unlink()
    (run / name).symlink_to(victim)
    before = victim.read_bytes()
    needle = f"{run}/{name}: is a symbolic link to {victim}; refused"
    assert_one_line_error(invoke_cli("report", str(run)), needle)
    assert_one_line_error(invoke_cli("gate", str(run)), needle)
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference",
                     "--prompts", _one_prompt(tmp_path), "--resume", str(run))
    assert_one_line_error(res, needle)
    assert victim.read_bytes() == before


def test_17_symlinked_lock_file_is_refused(one_run, tmp_path):
    run = _copy_run(one_run, tmp_path / "run")
    victim = _outside_file(tmp_path)
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(victim)
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference",
                     "--prompts", _one_prompt(tmp_path), "--resume", str(run))
    assert_one_line_error(res, f"{run}/.lock: is a symbolic link to {victim}")
    assert victim.read_text() == "not part of any run\n"


def test_17_report_replaces_a_symlinked_summary_instead_of_writing_through_it(one_run, tmp_path):
    run = _copy_run(one_run, tmp_path / "run")
    victim = _outside_file(tmp_path)
    for name in ("summary.csv", "report.html"):
        (run / name).unlink()
        (run / name).symlink_to(victim)
    res = invoke_cli("report", str(run))
    assert res.exit_code == 0, res.stderr
    assert victim.read_text() == "not part of any run\n"
    for name in ("summary.csv", "report.html"):
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 0


# ----------------------------------------------------------------------------- 16: integrity of records


def _edit_first_record(run: Path, edit) -> None:
    path = run / "requests.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    edit(record)
    lines[0] = json.dumps(record)  # NaN and Infinity come out as JSON readers take them
    path.write_text("\n".join(lines) + "\n")


def _set_field(name, value):
    def edit(record):
        record[name] = value
    return edit


RANGE_CASES = [
    ("nan-oracle-wer", _set_field("oracle_wer", float("nan")), "oracle_wer: must be a finite number >= 0, got nan"),
    ("negative-oracle-wer", _set_field("oracle_wer", -0.5), "oracle_wer: must be a finite number >= 0, got -0.5"),
    ("infinite-wer", _set_field("wer", float("inf")), "wer: must be a finite number >= 0, got inf"),
    ("negative-wall", _set_field("wall_s", -1.0), "wall_s: must be a finite number >= 0, got -1.0"),
    ("negative-preemptions", _set_field("preemptions", -2), "preemptions: must be a count >= 0, got -2"),
    ("negative-event", lambda r: r["events"].update(nonzero_offset_chunks=-3),
     "events.nonzero_offset_chunks: must be a count >= 0, got -3"),
]


@pytest.mark.parametrize("case", RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_16_gate_range_checks_every_numeric_field(small_run, tmp_path, case):
    _, edit, needle = case
    run = _copy_run(small_run, tmp_path / "run")
    _edit_first_record(run, edit)
    assert_one_line_error(invoke_cli("gate", str(run)), f"{run}/requests.jsonl: line 1: {needle}")


def test_16_gate_refuses_event_counts_that_differ_from_the_spans(small_run, tmp_path):
    run = _copy_run(small_run, tmp_path / "run")
    assert invoke_cli("gate", str(run)).exit_code in (0, 1)  # the untouched run is gated
    first = json.loads((run / "requests.jsonl").read_text().splitlines()[0])
    was = first["events"]["talker_calls"]
    _edit_first_record(run, lambda r: r["events"].update(talker_calls=was + 7))
    key = f"{first['arm']}/{first['deploy']} repeat {first['repeat']} prompt {first['prompt_id']}"
    assert_one_line_error(invoke_cli("gate", str(run)), "1 request record in requests.jsonl whose event counts differ "
                          f"from their spans in spans.jsonl (first: {key}: events.talker_calls is {was + 7}, its spans "
                          f"count {was})", "not gated")


# ----------------------------------------------------------------------------- 15: references with no words


def test_15_a_reference_with_no_words_is_not_measurable(tmp_path):
    data = copy.deepcopy(SMALL)
    data["prompts"] = data["prompts"][:2]
    data["prompts"][1]["reply"] = "(laughs) \u266a \u266a \u266a"  # Whisper's normaliser keeps no word of it
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    run = tmp_path / "out" / "r"
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers", "0",
                     "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--run-id", "r")
    assert res.exit_code == 0, res.stderr
    assert "1 request not measurable (the reference text normalises to no words)" in res.stdout
    assert "| Not measurable |" in (run / "summary.md").read_text()  # the extended table's own column
    records = {json.loads(ln)["prompt_id"]: json.loads(ln) for ln in (run / "requests.jsonl").read_text().splitlines()}
    odd = records[data["prompts"][1]["id"]]
    assert odd["not_measurable"] is True and odd["oracle_wer"] is None and odd["wer"] is None  # never a 0
    assert records[data["prompts"][0]["id"]]["not_measurable"] is False
    summary = (run / "summary.csv").read_text().splitlines()
    assert "not_measurable" in summary[0].split(",")
    row = dict(zip(summary[0].split(","), summary[1].split(",")))
    assert row["not_measurable"] == "1" and row["scored"] == "1"
    assert_one_line_error(invoke_cli("gate", str(run)), f"{run}: 1 request not measurable", "normalises to no words",
                          f"prompt {data['prompts'][1]['id']}", "not gated")


# ----------------------------------------------------------------------------- 19: disk full at the first manifest


def test_19_disk_full_while_the_first_manifest_is_written(tmp_path, monkeypatch):
    import errno

    import harness.records

    real = harness.records.write_file_atomic
    calls = {"n": 0}

    def full_once(path, data):
        if Path(path).name == "manifest.json" and calls["n"] == 0:
            calls["n"] += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(harness.records, "write_file_atomic", full_once)
    args = ["run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers", "0",
            "--prompts", _one_prompt(tmp_path), "--out", str(tmp_path / "out"), "--run-id", "r"]
    run = tmp_path / "out" / "r"
    assert_one_line_error(invoke_cli(*args), f"no space left on device writing {run}/manifest.json: nothing was "
                          f"recorded and {run} was removed; free some space, then run the same command again")
    assert not run.exists()
    # what the message advises works
    res = invoke_cli(*args)
    assert res.exit_code == 0, res.stderr
    assert (run / "manifest.json").is_file() and len((run / "requests.jsonl").read_text().splitlines()) == 1


# ----------------------------------------------------------------------------- 11: an arm raising KeyboardInterrupt

_KI_PLUGIN = """\
from harness.talkers.pr import FixedTalker


class RaisesKeyboardInterrupt(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == {bad!r}:
            raise KeyboardInterrupt
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_11_an_arm_raising_keyboard_interrupt_fails_its_request_only(tmp_path, monkeypatch, workers):
    bad = SMALL["prompts"][1]["id"]
    (tmp_path / "ki_plugin_round3.py").write_text(_KI_PLUGIN.format(bad=bad))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "ki=ki_plugin_round3:RaisesKeyboardInterrupt",
                     "--arm", "pr", "--deploy", "reference", "--deploy", "stress", "--sim-workers", workers,
                     "--prompts", str(SMALL_PROMPTS), "--out", str(out), "--run-id", "r")
    assert res.exit_code == 0, (res.stderr, res.stdout[-2000:])
    assert "Aborted" not in res.stderr
    records = [json.loads(ln) for ln in (out / "r" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * len(SMALL["prompts"])  # every request recorded
    failed = {(r["arm"], r["deploy"], r["prompt_id"]) for r in records if r["error"]}
    assert failed == {("ki", "reference", bad), ("ki", "stress", bad)}
    assert all(r["error"] == "KeyboardInterrupt: talker_preprocess raised KeyboardInterrupt (not a Ctrl-C)"
               for r in records if r["error"])


# ----------------------------------------------------------------------------- 7: an arm that leaves a thread running

_THREAD_PLUGIN = """\
import threading
import time

from harness.talkers.pr import FixedTalker

_started = []


class LeavesAThread(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if not _started:  # a non-daemon thread that outlives the run by far
            _started.append(threading.Thread(target=time.sleep, args=(600,), name="plugin-forever"))
            _started[0].start()
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_7_an_arm_that_leaves_a_thread_running_does_not_keep_the_run_alive(tmp_path, workers):
    (tmp_path / "thread_plugin_round3.py").write_text(_THREAD_PLUGIN)
    out = tmp_path / "out"
    res = run_cli("run", "--asr", "none", "--quiet", "--arm", "t=thread_plugin_round3:LeavesAThread", "--deploy",
                  "reference", "--sim-workers", workers, "--prompts", _one_prompt(tmp_path), "--out", str(out),
                  "--run-id", "r", timeout=900, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert res.exit_code == 0, res.stderr
    assert "omni-stress: warning: an arm left 1 thread running ('plugin-forever'); exiting without waiting for it" \
        in res.stderr
    assert "results: " in res.stdout
    assert len((out / "r" / "requests.jsonl").read_text().splitlines()) == 1


# ----------------------------------------------------------------------------- 13: --resume after the arm's code changed

_BASE = """\
from harness.talkers.pr import FixedTalker


class Base(FixedTalker):
    scale = 1.0
"""

_ARM = """\
from base_round3 import Base


class Arm(Base):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("edited", ["arm module", "base class module"])
def test_13_resume_refuses_an_arm_whose_code_changed(tmp_path, monkeypatch, edited):
    tag = edited.split()[0]  # module names of their own: this process keeps what it imported
    base, arm = f"base_round3_{tag}", f"arm_round3_{tag}"
    (tmp_path / f"{base}.py").write_text(_BASE)
    (tmp_path / f"{arm}.py").write_text(_ARM.replace("base_round3", base))
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["run", "--asr", "none", "--quiet", "--arm", f"x={arm}:Arm", "--deploy", "reference",
            "--sim-workers", "0", "--prompts", _one_prompt(tmp_path)]
    res = invoke_cli(*args, "--out", str(tmp_path / "out"), "--run-id", "r")
    assert res.exit_code == 0, res.stderr
    run = tmp_path / "out" / "r"
    assert invoke_cli(*args, "--resume", str(run)).exit_code == 0  # same code: resumes (nothing left to do)
    if edited == "arm module":
        (tmp_path / f"{arm}.py").write_text(_ARM.replace("base_round3", base) + "\n# edited\n")
    else:
        (tmp_path / f"{base}.py").write_text(_BASE.replace("scale = 1.0", "scale = 2.0"))
    before = (run / "requests.jsonl").read_bytes()
    assert_one_line_error(invoke_cli(*args, "--resume", str(run)), f"--resume {run}: arm 'x': its code changed since "
                          f"the run started (was {arm}:Arm@sha256:", "resuming would mix records of two "
                          "implementations; start a new run instead")
    assert (run / "requests.jsonl").read_bytes() == before


# ----------------------------------------------------------------------------- 8: an arm that defeats SIGALRM, then hangs

_SIGNAL_PLUGIN = """\
import signal
import time

from harness.talkers.pr import FixedTalker


class _Hangs(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == {bad!r}:
            self.defeat()
            while True:
                time.sleep(0.05)
        return super().talker_preprocess(input_ids, input_embeds, **info)


class IgnoresAlarm(_Hangs):
    def defeat(self):
        signal.signal(signal.SIGALRM, signal.SIG_IGN)


class ReplacesAlarm(_Hangs):
    def defeat(self):
        signal.signal(signal.SIGALRM, lambda *_: None)


class CancelsTimer(_Hangs):
    def defeat(self):
        signal.setitimer(signal.ITIMER_REAL, 0)

    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == {bad!r}:
            self.defeat()
            time.sleep(600)  # one long sleep: nothing but a signal wakes it
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_8_an_arm_that_defeats_sigalrm_still_times_out(tmp_path, monkeypatch, workers):
    bad = SMALL["prompts"][1]["id"]
    module = f"signal_plugin_round3_w{workers}"
    (tmp_path / f"{module}.py").write_text(_SIGNAL_PLUGIN.format(bad=bad))
    monkeypatch.syspath_prepend(str(tmp_path))
    arms = ["IgnoresAlarm", "ReplacesAlarm", "CancelsTimer"]
    args = ["run", "--asr", "none", "--quiet", "--deploy", "reference", "--sim-workers", workers, "--arm-timeout", "1",
            "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path / "out"), "--run-id", "r"]
    for attr in arms:
        args += ["--arm", f"{attr.lower()}={module}:{attr}"]
    res = invoke_cli(*args)
    assert res.exit_code == 0, res.stderr
    records = [json.loads(ln) for ln in (tmp_path / "out" / "r" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == len(arms) * len(SMALL["prompts"])
    failed = {(r["arm"], r["prompt_id"]): r["error"] for r in records if r["error"]}
    assert set(failed) == {(attr.lower(), bad) for attr in arms}
    assert all(e.startswith("ArmTimeout: talker_preprocess did not return within 1 s") for e in failed.values())
