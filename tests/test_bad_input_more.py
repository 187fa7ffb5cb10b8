"""Issue 15: the bad inputs a new user found beyond tests/test_bad_input.py, each through the CLI.

Every case asserts the exit code, the one ``omni-stress: error:`` line (naming the file, field or
arm) and, where the input could write somewhere, that nothing appeared outside the run directory.
Arm misbehaviour (rows of the wrong shape, ``sys.exit``, ``os._exit``, a call that never returns,
``print``) is not bad input: it fails that request, recorded, and the run goes on.

The table numbers (F1...) are the issue's; docs/robustness.md has the same table.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml
from conftest import REPO, SMALL_PROMPTS, invoke_cli, run_cli
from test_bad_input import _errors_column, assert_one_line_error

from harness.records import read_requests

SMALL = yaml.safe_load(SMALL_PROMPTS.read_text())
MIS = "tests.fixtures.misbehaving"
BAD_PROMPT = "p03-sleep"


def _bytes(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


def _prompts_with(tmp: Path, edit: Callable[[list[dict]], None]) -> str:
    data = copy.deepcopy(SMALL)
    edit(data["prompts"])
    path = tmp / "prompts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return str(path)


def _set(index: int, key: str, value: str) -> Callable[[list[dict]], None]:
    def edit(prompts: list[dict]) -> None:
        prompts[index][key] = value

    return edit


STRESS_TEXT = (REPO / "deploy_configs" / "stress.yaml").read_text()


def _deploy(tmp: Path, name: str = "bad", file: str | None = None, **sections: dict) -> str:
    """The stress deploy with ``sections`` merged in; a value of ``...`` deletes that key."""
    data = yaml.safe_load(STRESS_TEXT)
    data["name"] = name
    for section, values in sections.items():
        for key, value in values.items():
            if value is ...:
                data.setdefault(section, {}).pop(key, None)
            else:
                data.setdefault(section, {})[key] = value
    path = tmp / f"{file or name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)
DEEP = "[" * 100_000 + "]" * 100_000

# (case id, extra `run` args given tmp_path, substrings of the one error line)
CASES: list[tuple[str, Callable[[Path], list[str]], list[str]]] = [
    # F1: a file that is not UTF-8
    ("F1-latin1-deploy", lambda t: ["--deploy", _bytes(t, "latin.yaml", b"name: caf\xe9\n")],
     ["latin.yaml", "line 1", "not UTF-8", "0xe9"]),
    ("F1-binary-deploy", lambda t: ["--deploy", _bytes(t, "bin.yaml", bytes(range(256)) * 4)],
     ["bin.yaml", "not UTF-8"]),
    ("F1-latin1-prompts", lambda t: ["--prompts", _bytes(t, "p.yaml", b"system_prompt: s\nprompts:\n  - id: caf\xe9\n")],
     ["p.yaml", "line 3", "not UTF-8"]),
    ("F1-latin1-arms-file", lambda t: ["--arms-file", _bytes(t, "arms.yaml", b"arms:\n  caf\xe9: {talker: a:b}\n")],
     ["arms.yaml", "not UTF-8"]),
    # F2: nesting that would overflow the YAML reader's recursion
    ("F2-deeply-nested-deploy", lambda t: ["--deploy", _bytes(t, "deep.yaml", DEEP.encode())],
     ["deep.yaml", "nested too deeply"]),
    ("F2-deeply-nested-prompts", lambda t: ["--prompts", _bytes(t, "deep.yaml", ("prompts: " + DEEP).encode())],
     ["deep.yaml", "nested too deeply"]),
    # F3: numbers past what any deploy can mean, refused with the limit
    ("F3-huge-batched-tokens", lambda t: ["--deploy", _deploy(t, talker={"max_num_batched_tokens": 10**12})],
     ["bad.yaml", "talker.max_num_batched_tokens", "at most 262144 (8x vLLM-Omni's Talker default", "1000000000000"]),
    ("F3-huge-max-model-len", lambda t: ["--deploy", _deploy(t, talker={"max_model_len": 10**9})],
     ["bad.yaml", "talker.max_model_len", "at most 32768"]),
    ("F3-huge-kv-cache", lambda t: ["--deploy", _deploy(t, talker={"num_gpu_blocks_override": 10**9})],
     ["bad.yaml", "talker.num_gpu_blocks_override", "at most 262144"]),
    ("F3-huge-default-kv-cache", lambda t: ["--deploy", _deploy(t, talker={
        "num_gpu_blocks_override": ..., "block_size": 1, "max_model_len": 32768, "max_num_seqs": 1024,
        "max_num_batched_tokens": 32768})],
     ["bad.yaml", "talker:", "33554433 blocks", "over the limit of 262144"]),
    ("F3-huge-max-tokens", lambda t: ["--deploy", _deploy(t, sampling={"max_tokens": 10**7})],
     ["bad.yaml", "sampling.max_tokens", "at most 32768"]),
    ("F3-huge-max-steps", lambda t: ["--deploy", _deploy(t, sim={"max_steps": 10**12})],
     ["bad.yaml", "sim.max_steps", "at most 10000000"]),
    # F7: names that become file names
    ("F7-prompt-id-escapes", lambda t: ["--prompts", _prompts_with(t, _set(0, "id", "../../x/ESCAPED"))],
     ["prompts.yaml", "prompts[0].id", "'../../x/ESCAPED' is not a safe name"]),
    ("F7-prompt-id-absolute", lambda t: ["--prompts", _prompts_with(t, _set(1, "id", "/tmp/abs"))],
     ["prompts.yaml", "prompts[1].id", "not a safe name"]),
    ("F7-prompt-id-dotdot", lambda t: ["--prompts", _prompts_with(t, _set(2, "id", ".."))],
     ["prompts.yaml", "prompts[2].id", "not a safe name"]),
    ("F7-arm-name-escapes", lambda t: ["--arm", "../../x=tests.fixtures.plugins:raising_talker"],
     ["--arm '../../x=tests.fixtures.plugins:raising_talker'", "arm name", "not a safe name"]),
    ("F7-deploy-name-escapes", lambda t: ["--deploy", _deploy(t, name="../../x", file="ok")],
     ["ok.yaml", "name:", "'../../x' is not a safe name"]),
    # F8: --run-id is one folder inside --out
    ("F8-run-id-escapes", lambda t: ["--run-id", "../../escaped"], ["--run-id", "'../../escaped' is not a safe name"]),
    ("F8-run-id-absolute", lambda t: ["--run-id", str(t / "abs-run")], ["--run-id", "abs-run", "not a safe name"]),
    ("F8-run-id-dotdot", lambda t: ["--run-id", ".."], ["--run-id", "'..' is not a safe name"]),
    # the smaller ones
    ("kv-cache-too-small-for-one-request", lambda t: ["--deploy", _deploy(t, talker={"num_gpu_blocks_override": 100})],
     ["bad.yaml", "talker.num_gpu_blocks_override", "100 blocks", "talker.max_model_len 1984", "needs 124"]),
    ("kv-cache-without-max-model-len", lambda t: ["--deploy", _deploy(t, talker={"max_model_len": ...})],
     ["bad.yaml", "talker.num_gpu_blocks_override", "sim.default_max_model_len", "needs 2048"]),
    ("vllm-scheduler-rule-batched-below-seqs", lambda t: ["--deploy", _deploy(t, talker={"max_num_batched_tokens": 2})],
     ["bad.yaml", "talker.max_num_batched_tokens", "below talker.max_num_seqs 4"]),
    ("vllm-scheduler-rule-no-chunking", lambda t: ["--deploy", _deploy(t, talker={"enable_chunked_prefill": False})],
     ["bad.yaml", "talker.max_num_batched_tokens", "32 is below talker.max_model_len 1984",
      "enable_chunked_prefill false"]),
    ("block-size-7", lambda t: ["--deploy", _deploy(t, talker={"block_size": 7})],
     ["bad.yaml", "talker.block_size", "one of 1, 8, 16, 32, 64, 128, 256", "got 7"]),
    ("duplicate-yaml-key", lambda t: ["--deploy", _bytes(t, "dup.yaml", STRESS_TEXT.replace(
        "  max_num_seqs: 4\n", "  max_num_seqs: 4\n  max_num_seqs: 1\n", 1).encode())],
     ["dup.yaml", "duplicate key 'max_num_seqs'", "first given on line"]),
    ("duplicate-prompt-key", lambda t: ["--prompts", _bytes(t, "p.yaml", b"system_prompt: a\nsystem_prompt: b\n")],
     ["p.yaml", "line 2", "duplicate key 'system_prompt' (first given on line 1)"]),
    ("seed-negative-cli", lambda t: ["--seed", "-1"], ["'--seed'", "-1 is not in the range 0<=x<=4294967295"]),
    ("seed-too-large-deploy", lambda t: ["--deploy", _deploy(t, sampling={"seed": 2**40})],
     ["bad.yaml", "sampling.seed", "at most 4294967295"]),
    ("seed-negative-deploy", lambda t: ["--deploy", _deploy(t, sampling={"seed": -1})],
     ["bad.yaml", "sampling.seed", "an integer >= 0, got -1"]),
    ("reply-in-cyrillic", lambda t: ["--prompts", _prompts_with(t, _set(0, "reply", "Привет, как дела?"))],
     ["prompts.yaml", "prompts[0].reply", "'П'", "not Latin script", "English"]),
    ("reply-in-chinese", lambda t: ["--prompts", _prompts_with(t, _set(3, "reply", "The moon 月亮 is bright."))],
     ["prompts.yaml", "prompts[3].reply", "'月'", "not Latin script"]),
]


def _outside(tmp: Path, out: Path) -> set[str]:
    """Everything under tmp except the test's own inputs and the --out folder."""
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*") if out not in p.parents and p != out}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_more_bad_input_exits_2_with_one_line(case, tmp_path):
    _, make_args, needles = case
    inputs = tmp_path / "in"
    inputs.mkdir()
    out = tmp_path / "work" / "results"
    before = _outside(tmp_path, out)
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out),
            *make_args(inputs)]
    assert_one_line_error(invoke_cli(*args), *needles)
    assert not out.exists() or not any(out.iterdir()), "refused before a run directory exists"
    made = _outside(tmp_path, out) - before - {str(p.relative_to(tmp_path)) for p in inputs.rglob("*")}
    assert made == set(), f"written outside --out: {made}"
    assert not (tmp_path.parent / "escaped").exists() and not (tmp_path / "x").exists()


def test_deep_nesting_is_fast(tmp_path):
    """F2: the refusal costs no more than reading the file (no 100,000-level recursion retried)."""
    import time

    from harness.config import load_yaml
    from harness.errors import ConfigError

    path = tmp_path / "deep.yaml"
    path.write_text(DEEP)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_yaml(path)
    assert time.perf_counter() - t0 < 10


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    """A '<<' merge overridden by an explicit key is YAML's intent, not a duplicate."""
    from harness.config import load_yaml

    path = tmp_path / "m.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nover:\n  <<: *b\n  x: 3\n")
    assert load_yaml(path) == {"base": {"x": 1, "y": 2}, "over": {"x": 3, "y": 2}}


def test_shipped_configs_still_load():
    from harness.config import load_arms, load_deploy, load_prompts

    for name in ("reference", "stress", "specdec"):
        load_deploy(name)
    for name in ("default", "long_inputs"):
        load_prompts(name)
    assert {"main", "pr"} <= set(load_arms())


def test_F1_gate_rules_file_not_utf8(tmp_path, small_run):
    rules = tmp_path / "rules.yaml"
    rules.write_bytes(b"rules:\n  - name: caf\xe9\n")
    res = invoke_cli("gate", str(small_run), "--rules", str(rules))
    assert_one_line_error(res, "rules.yaml", "line 2", "not UTF-8")


# ----------------------------------------------------------------------------- F4-F6: misbehaving arms


MISBEHAVING = {  # arm name -> (plugin attr, the error its p03-sleep record must carry)
    "width": ("WrongWidth", "ValueError: talker_preprocess returned rows of shape (", ", 32); expected (rows, 64)"),
    "flat": ("OneDim", "ValueError: talker_preprocess returned rows of shape (64,); expected (rows, 64)"),
    "exit0": ("ExitZero", "SystemExit: talker_preprocess called sys.exit(0)"),
    "exit3": ("ExitThree", "SystemExit: talker_preprocess called sys.exit(3)"),
    "hardexit": ("HardExit", "ArmExit: talker_preprocess called os._exit(0)"),
    "hang": ("NeverReturns", "ArmTimeout: talker_preprocess did not return within 1 s"),
}


def _check_misbehaving_records(run_dir: Path, arms: list[str]) -> None:
    by_arm: dict[str, dict] = {}
    for r in read_requests(run_dir):
        by_arm.setdefault(r.arm, {})[(r.deploy, r.prompt_id)] = r
    ids = [p["id"] for p in SMALL["prompts"]]
    for arm in arms:
        records = by_arm[arm]
        deploys = {d for d, _ in records}
        assert sorted(records) == sorted((d, pid) for d in deploys for pid in ids), arm  # every request recorded
        for (_deploy_name, pid), r in records.items():
            if pid == BAD_PROMPT:
                for part in MISBEHAVING[arm][1:]:
                    assert r.error is not None and part in r.error, (arm, r.error)
                assert r.finish_reason == "abort"
            else:  # the rest of the cell is untouched: correct rows, correct speech
                assert r.error is None and r.oracle_wer == 0.0, (arm, pid, r.error)


def test_F4_F5_F6_misbehaving_arms_fail_their_request_and_the_run_goes_on(tmp_path):
    """In the run's own process (the in-process CLI): wrong-width and 1-D rows, sys.exit(0/3),
    os._exit(0) and a call that never returns each fail p03-sleep's request only."""
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
            "--run-id", "r", "--deploy", "stress", "--sim-workers", "1", "--arm-timeout", "1"]
    for arm, (attr, *_rest) in MISBEHAVING.items():
        args += ["--arm", f"{arm}={MIS}:{attr}"]
    res = invoke_cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    _check_misbehaving_records(tmp_path / "r", list(MISBEHAVING))
    assert _errors_column(res.stdout) == {arm: 1 for arm in MISBEHAVING}
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["finished"] is not None


def test_F5_F6_in_sim_workers_and_stdout_is_the_table_alone(tmp_path):
    """The installed CLI in a subprocess, cells in two forked sim workers: os._exit and a hang fail
    their request there too; a plugin that prints (at import and on every call) prints to stderr,
    and stdout is exactly the tables."""
    res = run_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                  "--run-id", "r", "--deploy", "stress", "--sim-workers", "2", "--arm-timeout", "1",
                  "--arm", f"hardexit={MIS}:HardExit", "--arm", f"hang={MIS}:NeverReturns",
                  "--arm", f"noisy={MIS}:Prints", timeout=900)
    assert res.exit_code == 0, res.stderr[-3000:]
    _check_misbehaving_records(tmp_path / "r", ["hardexit", "hang"])
    assert all(r.error is None for r in read_requests(tmp_path / "r") if r.arm == "noisy")
    assert "plugin print" not in res.stdout and "plugin write" not in res.stdout and "misbehaving" not in res.stdout
    assert res.stdout.startswith("Run r: ")
    assert res.stdout.rstrip().endswith(f"results: {tmp_path / 'r'}")
    assert "plugin print: p01-weather" in res.stderr and "misbehaving plugin module imported" in res.stderr
    assert _errors_column(res.stdout) == {"hardexit": 1, "hang": 1, "noisy": 0}


def test_plugin_print_stays_off_stdout_in_process(tmp_path):
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                     "--run-id", "r", "--deploy", "reference", "--arm", f"noisy={MIS}:Prints")
    assert res.exit_code == 0, res.stderr
    assert "plugin print" not in res.stdout and "plugin write" not in res.stdout and res.stdout.startswith("Run r: ")
    assert "plugin print" in res.stderr


def test_arm_timeout_option_is_checked():
    res = invoke_cli("run", "--arm-timeout", "-1")
    assert_one_line_error(res, "'--arm-timeout'", "-1")


# ----------------------------------------------------------------------------- F9-F15: run directories


def _copy_run(src: Path, tmp: Path, name: str = "copy") -> Path:
    dst = tmp / name
    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def _resume(run_dir: Path, *extra: str):
    return invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--resume", str(run_dir),
                      *extra)


def _interrupt(run_dir: Path, keep: int) -> None:
    """What a kill leaves: `keep` records, a torn line after them, finished null."""
    lines = (run_dir / "requests.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "requests.jsonl").write_text("".join(lines[:keep]) + lines[keep][:30])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["finished"] = None
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


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


def test_F10_a_second_run_in_the_same_directory_is_refused(tmp_path, small_run):
    """Another process holds the run directory (as a running `omni-stress run` does): `--resume`
    refuses, one line, exit 2, and appends nothing."""
    run_dir = _copy_run(small_run, tmp_path)
    _interrupt(run_dir, 3)
    before = (run_dir / "requests.jsonl").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from harness.rundir import locked\n"
         "with locked(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(60)", str(run_dir)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = _resume(run_dir)
        assert_one_line_error(res, str(run_dir), "another omni-stress run is writing this run directory",
                              f"(pid {holder.pid})")
        assert (run_dir / "requests.jsonl").read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
    res = _resume(run_dir)  # the holder is gone (its lock with it): the resume goes through
    assert res.exit_code == 0, res.stderr
    assert len(read_requests(run_dir)) == len(read_requests(small_run))


def test_F11_resume_with_other_asr_options_is_refused(tmp_path, small_run):
    run_dir = _copy_run(small_run, tmp_path)
    _interrupt(run_dir, 3)
    res = invoke_cli("run", "--asr", "faster-whisper", "--asr-model", "tiny.en", "--quiet", "--prompts",
                     str(SMALL_PROMPTS), "--resume", str(run_dir))
    assert_one_line_error(res, f"--resume {run_dir}", "asr differs from the manifest", "was --asr none",
                          "now --asr faster-whisper --asr-model tiny.en")
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 4  # untouched, torn line included


@pytest.mark.parametrize("manifest,needles", [
    ("[1, 2]", ["manifest.json", "expected a JSON object, got a list"]),
    ("null", ["manifest.json", "expected a JSON object, got null"]),
    ('{"cells": 3}', ["manifest.json", "cells: expected a list, got a number"]),
    ('{"cells": [1]}', ["manifest.json", "cells[0]: expected an object with arm, deploy and repeat"]),
    ('{"asr": "none"}', ["manifest.json", "asr: expected an object, got a string"]),
    ("[" * 100_000 + "]" * 100_000, ["manifest.json", "unreadable manifest (nested too deeply)"]),
    (b"{\"run_id\": \"caf\xe9\"}", ["manifest.json", "unreadable manifest", "utf-8"]),
], ids=["list", "null", "cells-number", "cell-not-object", "asr-string", "deep", "latin1"])
def test_F13_resume_with_a_malformed_manifest(tmp_path, small_run, manifest, needles):
    run_dir = _copy_run(small_run, tmp_path)
    if isinstance(manifest, bytes):
        (run_dir / "manifest.json").write_bytes(manifest)
    else:
        (run_dir / "manifest.json").write_text(manifest)
    assert_one_line_error(_resume(run_dir), str(run_dir), *needles)


def _edit_record(run_dir: Path, line: int, edit: Callable[[dict], None]) -> None:
    path = run_dir / "requests.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[line - 1])
    edit(record)
    lines[line - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


def test_F13_resume_with_a_record_missing_fields(tmp_path, small_run):
    run_dir = _copy_run(small_run, tmp_path)
    _edit_record(run_dir, 2, lambda r: (r.pop("prompt_id"), r.pop("repeat")))
    assert_one_line_error(_resume(run_dir), "requests.jsonl", "line 2", "missing fields 'prompt_id', 'repeat'")


def test_F13_resume_with_a_record_that_is_not_an_object(tmp_path, small_run):
    run_dir = _copy_run(small_run, tmp_path)
    path = run_dir / "requests.jsonl"
    path.write_text(path.read_text() + "[1, 2]\n")
    n = len(path.read_text().splitlines())
    assert_one_line_error(_resume(run_dir), "requests.jsonl", f"line {n}", "expected a request record", "a list")


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


def test_F15_disk_full_is_one_line_and_resume_finishes(tmp_path, small_run, monkeypatch):
    """ENOSPC on the fourth record write (a full disk, simulated in the writer): one line saying how
    many records are kept and that --resume continues; the resume then completes the run with the
    records an uninterrupted run writes."""
    from harness import records

    real_write = records.JsonlWriter.write
    calls = {"n": 0}

    def full(self, record):
        if self.path.name == "requests.jsonl":
            calls["n"] += 1
            if calls["n"] == 4:
                self._fh.write('{"arm": "ma')  # what a full disk leaves: part of a line
                self._fh.flush()
                raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        real_write(self, record)

    monkeypatch.setattr(records.JsonlWriter, "write", full)
    out = tmp_path / "out"
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out), "--run-id", "r"]
    res = invoke_cli(*args)
    run_dir = out / "r"
    assert_one_line_error(res, "no space left on device writing", "requests.jsonl", f"3 records kept in {run_dir}",
                          f"--resume {run_dir} continues")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.setattr(records.JsonlWriter, "write", real_write)
    res = _resume(run_dir)
    assert res.exit_code == 0, res.stderr
    got = {r.key: r.codec_tokens for r in read_requests(run_dir)}
    want = {r.key: r.codec_tokens for r in read_requests(small_run)}
    assert got == want


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


# ----------------------------------------------------------------------------- F12: transcribe


@pytest.mark.parametrize("name,data,needle", [
    ("empty.wav", b"", "empty file (0 bytes)"),
    ("random.wav", b"\x00\x17garbage" + bytes((i * 7919 + 13) % 251 for i in range(4000)),
     "not an audio file PyAV can decode"),
    ("notes.txt", b"hello, this is text\n", "not an audio file PyAV can decode"),
], ids=["zero-bytes", "random-bytes", "text"])
def test_F12_transcribe_refuses_what_is_not_audio(tmp_path, name, data, needle):
    path = tmp_path / name
    path.write_bytes(data)
    assert_one_line_error(invoke_cli("transcribe", "--asr-model", "tiny.en", str(path)), name, needle)


def test_F12_transcribe_missing_file(tmp_path):
    assert_one_line_error(invoke_cli("transcribe", str(tmp_path / "gone.wav")), "gone.wav", "not found")


def test_subprocess_one_line_for_a_latin1_deploy(tmp_path):
    """F1 through the installed entry point, not just the in-process runner."""
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    res = run_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path / "out"), "--deploy", str(path),
                  timeout=900)
    assert_one_line_error(res, "latin.yaml", "not UTF-8")
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == ["latin.yaml"]


def test_F13_resume_with_a_span_missing_fields(tmp_path, small_run):
    run_dir = _copy_run(small_run, tmp_path)
    _interrupt(run_dir, 3)
    path = run_dir / "spans.jsonl"
    lines = path.read_text().splitlines()
    span = json.loads(lines[4])
    del span["P"]
    lines[4] = json.dumps(span)
    path.write_text("\n".join(lines) + "\n")
    assert_one_line_error(_resume(run_dir), "spans.jsonl", "line 5", "malformed span", "'P'")


def test_vllm_scheduler_refusal_is_one_line_before_the_run_directory(tmp_path, monkeypatch):
    """Whatever else vLLM's SchedulerConfig refuses (its messages span lines) is found by the
    pre-flight, said on one line naming the deploy file, before any run directory exists."""
    import vllm.config

    def refuse(**_kwargs):
        raise ValueError("max_num_batched_tokens (32) is\nsmaller than something.\nPlease increase it.")

    monkeypatch.setattr(vllm.config, "SchedulerConfig", refuse)
    out = tmp_path / "out"
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out),
                     "--deploy", "stress")
    assert_one_line_error(res, "stress.yaml: talker: vLLM rejects these scheduler settings:",
                          "max_num_batched_tokens (32) is smaller than something. Please increase it.")
    assert not out.exists()
