"""Helpers shared by the bad-input tests (tests/test_bad_input_*.py, grouped by what they protect): what a
user sees of one failed command, the Errors column of the run table, the small prompt set, run directories
copied, interrupted and edited, plugin sources. The CLI runners themselves are in conftest.py."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import yaml

from conftest import CliResult, REPO, SMALL_PROMPTS


def assert_one_line_error(res: CliResult, *needles: str) -> str:
    """Exit 2, nothing on stderr but ``omni-stress: error: ...`` on one line, no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.stdout[-2000:])
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("omni-stress: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def errors_column(table: str) -> dict[str, int]:
    """The Errors column of the extended terminal table, by arm (cells sliced by the ``----`` rule)."""
    lines = table.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("Arm ") and "Errors" in ln)
    at = lines[header].index("Errors")
    spans = [m.span() for m in re.finditer(r"-+", lines[header + 1])]
    lo, hi = next((a, b) for a, b in spans if a <= at < b)
    out = {}
    for ln in lines[header + 2:]:
        if not ln.strip():
            break
        out[ln.split()[0]] = int(ln[lo:hi].split()[0])  # "3 (3 crashed)": the errors, of which crashed
    return out


SMALL = yaml.safe_load(SMALL_PROMPTS.read_text())


PLUGINS = "tests.fixtures.plugins"


def _copy_run(src: Path, tmp: Path, name: str = "copy") -> Path:
    dst = tmp / name
    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def as_jsonl_run(run_dir: Path) -> Path:
    """The run as one written before the span store (issue 48): its spans in spans.jsonl (the
    export, byte for byte that file), no spans/. Tests that edit span lines use it."""
    from harness.spanstore import SPANS_DIR, export_lines

    (run_dir / "spans.jsonl").write_text("".join(export_lines(run_dir)))
    shutil.rmtree(run_dir / SPANS_DIR)
    return run_dir


def _interrupt(run_dir: Path, keep: int) -> None:
    """What a kill leaves: `keep` records, a torn line after them, finished null."""
    lines = (run_dir / "requests.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "requests.jsonl").write_text("".join(lines[:keep]) + lines[keep][:30])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["finished"] = None
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def _edit_record(run_dir: Path, line: int, edit: Callable[[dict], None]) -> None:
    path = run_dir / "requests.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[line - 1])
    edit(record)
    lines[line - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


def _one_prompt(tmp: Path) -> str:
    """The small prompt set cut to its first prompt: a sim run of one cell in a second or two."""
    data = copy.deepcopy(SMALL)
    data["prompts"] = data["prompts"][:1]
    path = tmp / "one-prompt.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _run_args(tmp: Path, *extra: str) -> list[str]:
    return ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp / "out"), *extra]


def _with_char(text: str, ch: str, line: int) -> str:
    """``text`` with ``ch`` put at the end of its line ``line`` (1-based) (inside a comment or value)."""
    lines = text.split("\n")
    lines[line - 1] += ch
    return "\n".join(lines)


def _copy_run_r3(run: Path, where: Path) -> Path:
    shutil.copytree(run, where)
    return where


def _prompts(tmp: Path, count: int = 1) -> Path:
    """The small prompt set cut to its first ``count`` prompts."""
    data = copy.deepcopy(SMALL)
    data["prompts"] = data["prompts"][:count]
    path = tmp / f"prompts-{count}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cli_in(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
            preexec_fn=None) -> subprocess.CompletedProcess:
    """``omni-stress ARGS`` in a subprocess started in ``cwd`` (relative paths are the user's)."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, preexec_fn=preexec_fn,
                          env={**os.environ, "PYTHONPATH": f"{cwd.parent}{os.pathsep}{REPO}", **(env or {})})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "requests.jsonl").read_text().splitlines()]


_CHDIR_PLUGIN = """\
import os

from harness.families.qwen2_5_omni.pr import FixedTalker

os.chdir(os.environ["CHDIR_TO"])  # at import (the run's pre-flight imports it before any directory exists)


class ChangesDirectory(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        os.chdir(os.environ["CHDIR_TO"])  # and in every call, in the run's process or a sim worker
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""
