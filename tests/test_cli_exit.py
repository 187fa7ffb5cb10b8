"""The console script's exit (``harness.cli.entry``): the command's status, its output and the
``atexit`` handlers kept, the interpreter's teardown skipped only when nothing else is alive."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.cli import exit_status

PRELUDE = "import atexit, sys, threading\nsys.argv = ['omni-stress', *sys.argv[1:]]\n"
ENTRY = "from harness.cli import entry\nentry()\n"


def _cli(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + code + ENTRY, *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_exit_status_is_what_sys_exit_would_give(capsys: pytest.CaptureFixture) -> None:
    assert exit_status(None) == 0
    assert exit_status(0) == 0
    assert exit_status(2) == 2
    assert exit_status("bad thing") == 1
    assert capsys.readouterr().err == "bad thing\n"


def test_entry_keeps_output_status_and_atexit_handlers() -> None:
    ok = _cli("atexit.register(lambda: print('atexit ran', flush=True))\n", "list", "arms")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "atexit ran"
    assert "main" in ok.stdout and "pr" in ok.stdout
    bad = _cli("atexit.register(lambda: print('atexit ran', flush=True))\n", "gate", "/nonexistent-run-dir")
    assert bad.returncode == 2
    assert bad.stdout == "atexit ran\n"
    assert bad.stderr == "omni-stress: error: /nonexistent-run-dir: run directory not found\n"


def test_entry_waits_for_a_live_thread_as_python_does() -> None:
    # a non-daemon thread still running when the command returns: the ordinary exit joins it
    code = ("done = threading.Event()\n"
            "def late():\n    done.wait(1.0)\n    print('thread finished', flush=True)\n"
            "threading.Thread(target=late).start()\n")
    res = _cli(code, "list", "arms")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "thread finished"
