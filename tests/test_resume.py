"""Crash-safe runs: a SIGKILLed ``omni-stress run`` leaves a valid run directory, ``--resume`` finishes
it with every (arm, deploy, repeat, prompt) record exactly once and identical to an uninterrupted
run, spans are neither duplicated nor lost, a torn last line is dropped, and a resume with another
configuration is refused. Also: what the run prints (progress only when asked, the stage times)."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, SMALL_PROMPTS, invoke_cli

from harness.records import read_manifest, read_requests
from harness.spanstore import read_spans

TIMING_FIELDS = {"wall_s", "asr_seconds"}
RUN_ARGS = ("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS))
CELLS = [(a, d, 1) for a in ("main", "pr") for d in ("reference", "stress")]


def _records(run_dir: Path) -> dict[tuple, dict]:
    """Records by key, timing fields removed; asserts each key occurs once."""
    records = read_requests(run_dir)
    keys = Counter(r.key for r in records)
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]
    return {r.key: {k: v for k, v in dataclasses.asdict(r).items() if k not in TIMING_FIELDS} for r in records}


def _spans(run_dir: Path) -> list[tuple]:
    spans = [tuple(dataclasses.asdict(s).values()) for s in read_spans(run_dir)]
    per_call = Counter(s[:5] for s in spans)  # (arm, deploy, repeat, request, step): one call each
    assert max(per_call.values()) == 1, "duplicated spans"
    return sorted(spans)


def assert_same_as_uninterrupted(run_dir: Path, reference: Path) -> None:
    got, want = _records(run_dir), _records(reference)
    assert sorted(got) == sorted(want)
    assert len(got) == len(CELLS) * 4
    for key in want:
        assert got[key] == want[key], key
    assert _spans(run_dir) == _spans(reference)
    for name in ("requests.jsonl", "spans.jsonl"):  # every line whole again (spans.jsonl: an old run's)
        for line in (run_dir / name).read_text().splitlines() if (run_dir / name).exists() else ():
            json.loads(line)
    assert not list((run_dir / "spans").glob(".*"))  # no temporary file of a killed write left
    manifest = read_manifest(run_dir)
    assert manifest["finished"] is not None
    assert set(manifest["cell_wall_s"]) <= {f"{a}/{d}/{r}" for a, d, r in CELLS}


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_records(tmp_path, small_run):
    run_dir = tmp_path / "killed"
    log = (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *RUN_ARGS, "--out", str(tmp_path),
                             "--run-id", "killed"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
    requests = run_dir / "requests.jsonl"
    deadline = time.monotonic() + 240
    try:
        while True:  # kill as soon as the first records are on disk (the first cell is done)
            if requests.exists() and requests.read_bytes().count(b"\n") >= 1:
                break
            assert proc.poll() is None, f"run ended before it could be killed: {(tmp_path / 'stderr.txt').read_text()}"
            assert time.monotonic() < deadline, "no record within 240 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    assert (tmp_path / "stderr.txt").read_text() == ""  # --quiet: no progress lines
    manifest = read_manifest(run_dir)  # written first, still valid
    assert manifest["finished"] is None
    kept = len(read_requests(run_dir))
    assert 1 <= kept < len(CELLS) * 4, kept

    res = invoke_cli(*RUN_ARGS, "--resume", str(run_dir))
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    assert "wall time per stage: sim" in res.stdout
    assert_same_as_uninterrupted(run_dir, small_run)
    assert len(read_manifest(run_dir)["resumed"]) == 1


def _cut(path: Path, whole_lines: int, torn: bool) -> None:
    """Keep ``whole_lines`` lines, plus half of the next one when ``torn`` (a kill mid-write)."""
    lines = path.read_text().splitlines(keepends=True)
    text = "".join(lines[:whole_lines])
    if torn:
        text += lines[whole_lines][: len(lines[whole_lines]) // 2]
    path.write_text(text)


def _span_lines_of_first_cells(run_dir: Path, cells: int) -> int:
    spans = read_spans(run_dir)
    order = list(dict.fromkeys((s.arm, s.deploy, s.repeat) for s in spans))
    return sum(1 for s in spans if (s.arm, s.deploy, s.repeat) in order[:cells])


def _store_files(run_dir: Path) -> list[Path]:
    files = sorted((run_dir / "spans").glob("*.arrow"))
    assert len(files) == len(CELLS)  # one whole file per cell
    return files


@pytest.mark.parametrize("state", ["torn-request-mid-cell", "spans-of-the-next-cell-cut-short",
                                   "old-run-torn-spans-jsonl"])
def test_resume_after_a_torn_last_line(tmp_path, small_run, state):
    """Killed while writing a record (cell 2 half reported), or while writing cell 2's span file (a
    temporary file is all it left), or an old run's spans.jsonl (written before the span store) cut
    mid-line: ``--resume`` completes each identically."""
    run_dir = tmp_path / "run"
    shutil.copytree(small_run, run_dir)
    manifest = read_manifest(run_dir)
    manifest["finished"] = None
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    files = _store_files(run_dir)
    if state == "torn-request-mid-cell":
        _cut(run_dir / "requests.jsonl", 6, torn=True)  # cell 1 complete, 2 of cell 2, a torn 3rd
        for path in files[2:]:
            path.unlink()
    elif state == "spans-of-the-next-cell-cut-short":
        _cut(run_dir / "requests.jsonl", 4, torn=False)  # cell 1 complete
        data = files[1].read_bytes()
        (run_dir / "spans" / f".{files[1].name}.4242.tmp").write_bytes(data[: len(data) // 2])
        for path in files[1:]:
            path.unlink()
    else:
        one_cell = _span_lines_of_first_cells(run_dir, 1)
        two_cells = _span_lines_of_first_cells(run_dir, 2)
        res = invoke_cli("export-spans", str(run_dir), "-o", str(run_dir / "spans.jsonl"))
        assert res.exit_code == 0, res.stderr
        shutil.rmtree(run_dir / "spans")
        _cut(run_dir / "requests.jsonl", 4, torn=False)  # cell 1 complete
        _cut(run_dir / "spans.jsonl", (one_cell + two_cells) // 2, torn=True)  # cell 2's spans cut short
    res = invoke_cli(*RUN_ARGS, "--resume", str(run_dir))
    assert res.exit_code == 0, res.stderr
    assert_same_as_uninterrupted(run_dir, small_run)
    if state == "old-run-torn-spans-jsonl":  # cell 1 stays in spans.jsonl, the rest went to the store
        assert _span_lines_of_first_cells(run_dir, 1) == len((run_dir / "spans.jsonl").read_text().splitlines())
        assert len(list((run_dir / "spans").glob("*.arrow"))) == len(CELLS) - 1


def test_resume_of_a_finished_run_runs_nothing(tmp_path, small_run):
    run_dir = tmp_path / "run"
    shutil.copytree(small_run, run_dir)
    def files() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in [run_dir / "requests.jsonl", *(run_dir / "spans").iterdir()]}

    before = files()
    res = invoke_cli(*[a for a in RUN_ARGS if a != "--quiet"], "--resume", str(run_dir))
    assert res.exit_code == 0, res.stderr
    assert files() == before
    # not a TTY and not --quiet: one plain line per cell instead of bars
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("[omni-stress]")]
    assert notes == [f"[omni-stress] {a} x {d} (run {r}): already complete, skipped" for a, d, r in CELLS]
    assert res.stderr.splitlines()[0] == f"run directory: {run_dir}"
    assert "wall time per stage: sim 0.0 s, TTS 0.0 s, ASR 0.0 s (0 transcribed, 0 cache hits)" in res.stdout


@pytest.mark.parametrize(("change", "field"), [
    (("--seed", "7"), "seed differ from the manifest (was 42, now 7)"),
    (("--deploy", "stress"), "differ from the manifest"),
    (("--arm", "pr", "--arm", "main"), "cells differ from the manifest"),
    (("--prompts", "CHANGED"), "config_hashes differ from the manifest"),
])
def test_resume_with_another_configuration_is_refused(tmp_path, small_run, change, field):
    run_dir = tmp_path / "run"
    shutil.copytree(small_run, run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    args = list(RUN_ARGS)
    if change[0] == "--prompts":  # same prompt set name and ids, one reply edited
        edited = tmp_path / SMALL_PROMPTS.name
        edited.write_text(SMALL_PROMPTS.read_text().replace("a warm coat", "a thick coat"))
        args[args.index("--prompts") + 1] = str(edited)
    else:
        args += change
    res = invoke_cli(*args, "--resume", str(run_dir))
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"omni-stress: error: --resume {run_dir}: "), res.stderr
    assert field in lines[0] and "start a new run instead" in lines[0]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # untouched


def test_resume_of_a_folder_that_is_not_a_run(tmp_path):
    res = invoke_cli(*RUN_ARGS, "--resume", str(tmp_path))
    assert res.exit_code == 2
    assert res.stderr == f"omni-stress: error: --resume {tmp_path}: not a run directory (no manifest.json)\n"


def test_progress_bar_per_cell_on_a_tty(monkeypatch):
    """On a terminal: a tqdm bar per cell with requests done / total; nothing at all when quiet."""
    from harness.pipeline import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    threads = threading.active_count()
    progress = Progress(quiet=False)
    progress.start("pr/stress/1", "pr x stress (run 1)", 4)
    progress.start("main/stress/1", "main x stress (run 1)", 2)  # Whisper overlaps cells: two bars open
    # no tqdm monitor thread: it would outlive the bars and rule out the forked plots and the quick exit
    assert threading.active_count() == threads
    for _ in range(4):
        progress.update("pr/stress/1", "WER 0.00")
    assert list(progress._bars) == ["main/stress/1"]  # a bar closes with its cell's last request
    progress.update("main/stress/1")
    progress.close()
    assert "pr x stress (run 1)" in err.getvalue() and "4/4" in err.getvalue()
    assert "main x stress (run 1)" in err.getvalue() and "1/2" in err.getvalue()

    quiet_err = Tty()
    monkeypatch.setattr(sys, "stderr", quiet_err)
    quiet = Progress(quiet=True)
    quiet.start("pr/stress/1", "pr x stress (run 1)", 4)
    quiet.update("pr/stress/1")
    quiet.note("anything")
    quiet.close()
    assert quiet_err.getvalue() == ""
