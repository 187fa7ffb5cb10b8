"""Bad input to the commands that read finished runs: ``report``, ``compare``, ``gate``, ``fidelity``
(docs/robustness.md): incomplete runs, records of the wrong type or range, read-only directories, odd terminals.
Each through the CLI as a user types it."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from clikit import (
    SMALL, _copy_run, _copy_run_r3, _edit_record, _interrupt, _one_prompt, _with_char, assert_one_line_error,
)
from conftest import REPO, invoke_cli, run_cli


def test_F1_gate_rules_file_not_utf8(tmp_path, small_run):
    rules = tmp_path / "rules.yaml"
    rules.write_bytes(b"rules:\n  - name: caf\xe9\n")
    res = invoke_cli("gate", str(small_run), "--rules", str(rules))
    assert_one_line_error(res, "rules.yaml", "line 2", "not UTF-8")


def test_F9_report_and_compare_say_the_run_is_incomplete(tmp_path, small_run):
    run_dir = _copy_run(small_run, tmp_path)
    _interrupt(run_dir, 5)
    res = invoke_cli("report", "--no-write", str(run_dir))
    assert res.exit_code == 0, res.stderr
    assert "incomplete run" in res.stderr and "incomplete run" in res.stdout
    res = invoke_cli("compare", str(small_run), str(run_dir))
    assert res.exit_code == 0 and "incomplete run" in res.stderr
    res = invoke_cli("gate", str(run_dir))
    assert res.exit_code == 2 and "incomplete run" in res.stderr


@pytest.mark.parametrize("command", ["gate", "report", "compare"])
def test_F14_record_field_of_the_wrong_type(tmp_path, small_run, command):
    run_dir = _copy_run(small_run, tmp_path)
    _edit_record(run_dir, 3, lambda r: r.update(repeat="one"))
    args = [command, str(run_dir)] if command != "compare" else [command, str(small_run), str(run_dir)]
    assert_one_line_error(invoke_cli(*args), "requests.jsonl", "line 3", "repeat: expected int, got 'one'")


@pytest.mark.parametrize("field,value,needle", [
    ("events", {"talker_calls": "many"}, "events: expected an object of counts"),
    ("codec_tokens", [1, "x"], "codec_tokens: expected list[int]"),
    ("wer", "0.5", "wer: expected float | None, got '0.5'"),
    ("error", 3, "error: expected str | None, got 3"),
])
def test_F14_other_wrong_types(tmp_path, small_run, field, value, needle):
    run_dir = _copy_run(small_run, tmp_path)
    _edit_record(run_dir, 1, lambda r: r.update({field: value}))
    assert_one_line_error(invoke_cli("report", "--no-write", str(run_dir)), "requests.jsonl", "line 1", needle)


def test_F15_disk_full_under_report_prints_the_tables_and_warns(tmp_path, small_run, monkeypatch):
    # as for a read-only run directory (issue 24 case 2): the tables are complete, the report files
    # are written by rename (the old ones stay whole), so one warning line and exit 0
    from harness.report import tables as report

    run_dir = _copy_run(small_run, tmp_path)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "report.html"))

    monkeypatch.setattr(report, "write_reports", full)
    res = invoke_cli("report", str(run_dir))
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert "main" in res.stdout and "WER" in res.stdout
    assert res.stderr.splitlines() == [
        f"omni-stress: warning: {run_dir}: could not rewrite the report files ({run_dir / 'report.html'}: "
        "No space left on device); the tables above are complete (--no-write only prints)"]


GATES_TEXT = (REPO / "deploy_configs" / "gates.yaml").read_text()


def test_1_control_character_in_gate_rules(tmp_path, small_run):
    rules = tmp_path / "gates.yaml"
    rules.write_bytes(_with_char(GATES_TEXT, "\x1b[31m", 2).encode())
    assert_one_line_error(invoke_cli("gate", str(small_run), "--rules", str(rules)),
                          f"{rules}: line 2 column ", "U+001B (ESC")


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
        run = _copy_run_r3(one_run, base / "run")
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


@pytest.mark.parametrize("command", ["run", "report"])
def test_5_latin1_terminal_prints_the_tables_with_replacements(one_run, tmp_path, command):
    env = {"PYTHONIOENCODING": "latin-1"}
    if command == "run":
        res = run_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers",
                      "0", "--prompts", _one_prompt(tmp_path), "--out", str(tmp_path / "out"), "--run-id", "r", env=env)
        run = tmp_path / "out" / "r"
    else:
        run = _copy_run_r3(one_run, tmp_path / "run")
        res = run_cli("report", str(run), env=env)
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert "?" in res.stdout and "\u2013" not in res.stdout  # the tables' en dash, replaced
    assert (run / "summary.md").read_text(encoding="utf-8").count("\u2013") > 0  # the files keep it
    assert len((run / "requests.jsonl").read_text().splitlines()) == 1  # nothing measured lost


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
    run = _copy_run_r3(small_run, tmp_path / "run")
    _edit_first_record(run, edit)
    assert_one_line_error(invoke_cli("gate", str(run)), f"{run}/requests.jsonl: line 1: {needle}")


def test_16_gate_refuses_event_counts_that_differ_from_the_spans(small_run, tmp_path):
    run = _copy_run_r3(small_run, tmp_path / "run")
    assert invoke_cli("gate", str(run)).exit_code in (0, 1)  # the untouched run is gated
    first = json.loads((run / "requests.jsonl").read_text().splitlines()[0])
    was = first["events"]["talker_calls"]
    _edit_first_record(run, lambda r: r["events"].update(talker_calls=was + 7))
    key = f"{first['arm']}/{first['deploy']} repeat {first['repeat']} prompt {first['prompt_id']}"
    assert_one_line_error(invoke_cli("gate", str(run)), "1 request record in requests.jsonl whose event counts differ "
                          f"from their spans in spans/ (first: {key}: events.talker_calls is {was + 7}, its spans "
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


def _as_real(run: Path, where: Path) -> Path:
    """A copy of a sim run that says it came from the real backend (what fidelity's second run is)."""
    real = where / "real"
    shutil.copytree(run, real)
    for name in ("manifest.json", "requests.jsonl"):
        path = real / name
        path.write_text(path.read_text().replace('"backend": "sim"', '"backend": "vllm-omni"'))
    return real


# ----------------------------------------------------------------------------- fidelity of two runs of one backend


def test_fidelity_of_one_backend_twice_is_refused(small_run: Path, tmp_path: Path) -> None:
    """Issue 33, case 4: ``fidelity RUN RUN`` exited 0 with ratios of 1.00, as if the sim were exact."""
    assert_one_line_error(invoke_cli("fidelity", str(small_run), str(small_run)),
                          f"fidelity {small_run} {small_run}: the same run twice (backend sim); fidelity measures a "
                          "sim run against a real run (--backend vllm-omni) of the same work: give one of each, "
                          "or --same-backend for a self-check")
    other = tmp_path / "other"
    shutil.copytree(small_run, other)
    assert_one_line_error(invoke_cli("fidelity", str(small_run), str(other)), ": both sim runs (backend sim)")
    real = _as_real(small_run, tmp_path)
    assert_one_line_error(invoke_cli("fidelity", str(real), str(real)), ": the same run twice (backend vllm-omni)")
    assert_one_line_error(invoke_cli("fidelity", str(real), str(small_run)),
                          "the first run is the real one (backend vllm-omni) and the second the sim run: give the "
                          "sim run first")
    ok = invoke_cli("fidelity", str(small_run), str(real))  # one of each: measured, no label, no warning
    assert ok.exit_code == 0 and ok.stderr == "", ok.stderr
    assert ok.stdout.startswith("sim:  ")
    js = tmp_path / "f.json"
    labelled = invoke_cli("fidelity", str(small_run), str(other), "--same-backend", "--json", str(js))
    assert labelled.exit_code == 0, labelled.stderr
    assert labelled.stdout.startswith("self-check, not a fidelity measurement: both sim runs (backend sim, "
                                      "--same-backend)\n")
    assert json.loads(js.read_text())["self_check"].startswith("self-check, not a fidelity measurement")


# ----------------------------------------------------------------------------- fidelity of an incomplete run


def _killed(run: Path, where: Path, keep: int) -> Path:
    """``run`` as a kill leaves it: ``keep`` records, the manifest not finished."""
    dst = where / f"killed{keep}"
    shutil.copytree(run, dst)
    lines = (dst / "requests.jsonl").read_text().splitlines(keepends=True)
    (dst / "requests.jsonl").write_text("".join(lines[:keep]))
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["finished"] = None
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _torn(run: Path, where: Path) -> Path:
    dst = where / "torn"
    shutil.copytree(run, dst)
    raw = (dst / "requests.jsonl").read_bytes()
    last = raw.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    (dst / "requests.jsonl").write_bytes(raw[:len(raw) - len(last) - 1] + last[:40])  # the last line cut off
    return dst


@pytest.mark.parametrize("kind", ["killed", "torn"])
def test_fidelity_warns_on_an_incomplete_run_as_report_and_compare_do(small_run: Path, tmp_path: Path,
                                                                      kind: str) -> None:
    """Issue 33, case 5: ``fidelity`` of a killed run (9 of 15 records) or one with a torn last line exited 0 with
    nothing on stderr, where ``report`` and ``compare`` warn."""
    bad = _killed(small_run, tmp_path, keep=5) if kind == "killed" else _torn(small_run, tmp_path)
    real = _as_real(small_run, tmp_path)
    compared = invoke_cli("compare", str(small_run), str(bad))
    warning = [ln for ln in compared.stderr.splitlines() if ln.startswith("omni-stress: warning: ")]
    assert len(warning) == 1 and f"{bad}: incomplete run" in warning[0]
    res = invoke_cli("fidelity", str(bad), str(real))
    assert res.exit_code == 0, res.stderr
    assert res.stderr.splitlines() == warning  # the same check, the same line
    why = "the run did not finish" if kind == "killed" else "requests.jsonl: the last line is cut off"
    assert why in warning[0]
    strict = invoke_cli("fidelity", str(small_run), str(bad.parent / "real"), "--strict")
    assert strict.exit_code == 0, strict.stderr  # both complete
    assert_one_line_error(invoke_cli("fidelity", str(bad), str(real), "--strict"),
                          f"{bad}: incomplete run (", why, "; not compared (--strict)")
