"""Bad input around a run directory: ``--out``, ``--run-id``, ``--resume`` (other options, malformed manifests and
records, edited arm code), the lock, a full disk, symlinked or folder run files (docs/robustness.md). Each through
the CLI as a user types it: one line, exit 2, nothing measured lost."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.records import read_requests

from clikit import _copy_run, _copy_run_r3, _edit_record, _interrupt, _one_prompt, as_jsonl_run, assert_one_line_error
from conftest import REPO, SMALL_PROMPTS, invoke_cli, run_cli


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(ro))
        assert_one_line_error(res, "--out", "ro", "not writable")
    finally:
        ro.chmod(0o700)


def _resume(run_dir: Path, *extra: str):
    return invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--resume", str(run_dir),
                      *extra)


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


def test_F13_resume_with_a_span_missing_fields(tmp_path, small_run):
    run_dir = _copy_run(small_run, tmp_path)
    _interrupt(run_dir, 3)
    path = as_jsonl_run(run_dir) / "spans.jsonl"  # an old run's spans.jsonl, one line edited
    lines = path.read_text().splitlines()
    span = json.loads(lines[4])
    del span["P"]
    lines[4] = json.dumps(span)
    path.write_text("\n".join(lines) + "\n")
    assert_one_line_error(_resume(run_dir), "spans.jsonl", "line 5", "malformed span", "'P'")


def test_F13_resume_with_a_corrupt_span_file(tmp_path, small_run):
    """A file of the span store that is not one (edited, truncated by a copy): one line naming it."""
    run_dir = _copy_run(small_run, tmp_path)
    _interrupt(run_dir, 3)
    bad = sorted((run_dir / "spans").glob("*.arrow"))[0]
    bad.write_bytes(bad.read_bytes()[:100])
    assert_one_line_error(_resume(run_dir), f"{bad}: not a readable span file")


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
    run = _copy_run_r3(one_run, tmp_path / "run")
    (run / "spans.jsonl").mkdir()  # an old run's spans file
    for command in (["report"], ["gate"], ["compare", str(one_run)]):
        res = invoke_cli(*command, str(run))
        assert_one_line_error(res, f"{run}/spans.jsonl: is a folder; a run directory's spans.jsonl must be a "
                                   "regular file")


def test_4_span_store_that_is_a_file(one_run, tmp_path):
    run = _copy_run_r3(one_run, tmp_path / "run")
    shutil.rmtree(run / "spans")
    (run / "spans").write_text("not a folder\n")
    for command in (["report"], ["gate"], ["compare", str(one_run)], ["export-spans"]):
        res = invoke_cli(*command, str(run))
        assert_one_line_error(res, f"{run}/spans: is not a folder; a run directory's spans/ holds the run's files")


def _outside_file(tmp: Path) -> Path:
    victim = tmp / "outside.txt"
    victim.write_text("not part of any run\n")
    return victim


@pytest.mark.parametrize("name", ["requests.jsonl", "spans.jsonl", "manifest.json"])
def test_17_symlinked_run_file_is_refused(one_run, tmp_path, name):
    run = _copy_run_r3(one_run, tmp_path / "run")
    if name == "spans.jsonl":
        as_jsonl_run(run)  # an old run's
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


def test_17_symlinked_span_store_is_refused(one_run, tmp_path):
    run = _copy_run_r3(one_run, tmp_path / "run")
    victim = tmp_path / "elsewhere"
    shutil.move(run / "spans", victim)
    (run / "spans").symlink_to(victim)
    before = sorted(p.name for p in victim.iterdir())
    needle = f"{run}/spans: is a symbolic link to {victim}; refused"
    for command in (["report"], ["gate"], ["export-spans"]):
        assert_one_line_error(invoke_cli(*command, str(run)), needle)
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference",
                     "--prompts", _one_prompt(tmp_path), "--resume", str(run))
    assert_one_line_error(res, needle)
    assert sorted(p.name for p in victim.iterdir()) == before


def test_17_symlinked_lock_file_is_refused(one_run, tmp_path):
    run = _copy_run_r3(one_run, tmp_path / "run")
    victim = _outside_file(tmp_path)
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(victim)
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference",
                     "--prompts", _one_prompt(tmp_path), "--resume", str(run))
    assert_one_line_error(res, f"{run}/.lock: is a symbolic link to {victim}")
    assert victim.read_text() == "not part of any run\n"


def test_17_report_replaces_a_symlinked_summary_instead_of_writing_through_it(one_run, tmp_path):
    run = _copy_run_r3(one_run, tmp_path / "run")
    victim = _outside_file(tmp_path)
    for name in ("summary.csv", "report.html"):
        (run / name).unlink()
        (run / name).symlink_to(victim)
    res = invoke_cli("report", str(run))
    assert res.exit_code == 0, res.stderr
    assert victim.read_text() == "not part of any run\n"
    for name in ("summary.csv", "report.html"):
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 0


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


# ----------------------------------------------------------------------------- 13: --resume after the arm's code changed

_BASE = """\
from harness.families.qwen2_5_omni.pr import FixedTalker


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
