"""Issue 47, case 7: with ``XDG_CACHE_HOME`` unwritable, every ASR process printed onnxruntime's telemetry
warning (from C++, on descriptor 2) despite ``--quiet``; it is imported with that line held back now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def _stderr(tmp_path: Path, code: str) -> str:
    (tmp_path / "afile").write_text("x")  # a cache folder under a file: unwritable, for root too
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "afile" / "cache")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_onnxruntime_says_nothing_about_an_unwritable_cache(tmp_path: Path) -> None:
    # Whether the bare import prints the warning depends on the onnxruntime build and on what it kept before
    # (CI's machine printed nothing), so the premise is not asserted; the quiet import must be silent either way.
    quiet = _stderr(tmp_path, "from harness.cachedirs import import_onnxruntime_quietly as q; q(); import onnxruntime")
    assert quiet == ""


def _noisy_import(lines: bytes) -> str:
    """A child whose ``import onnxruntime`` writes ``lines`` on descriptor 2, as the C++ library does."""
    return ("import os, sys, types\n"
            "sys.modules.pop('onnxruntime', None)\n"
            "from harness import cachedirs\n"
            "import builtins\n"
            "real = builtins.__import__\n"
            "def noisy(name, *a, **k):\n"
            "    if name == 'onnxruntime':\n"
            f"        os.write(2, {lines!r})\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = noisy\n"
            "cachedirs.import_onnxruntime_quietly()\n")


def test_the_telemetry_line_is_held_back_and_other_lines_are_passed_on(tmp_path: Path) -> None:
    telemetry = b"2026-12-05 [W:onnxruntime:Default, telemetry.cc:12] Failed to persist telemetry device ID: denied\n"
    assert _stderr(tmp_path, _noisy_import(telemetry + b"kept line\n")) == "kept line\n"


def test_other_lines_written_during_the_import_are_passed_on(tmp_path: Path) -> None:
    assert _stderr(tmp_path, _noisy_import(b"kept line\n")) == "kept line\n"
