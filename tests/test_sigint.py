"""Issue 47, case 2: every SIGINT stops a run with exit 130 and one line saying what is on disk, and the
run stays resumable. Two ways lost it before: a process started with SIGINT ignored (a shell script's
background job) and a KeyboardInterrupt swallowed on the way (here: by the arm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO

E2E_PROMPTS = REPO / "tests" / "data" / "prompts_e2e.yaml"  # 3 prompts

_SWALLOW_PLUGIN = """\
import os
import signal
import time

from harness.families.qwen2_5_omni.pr import FixedTalker


class Swallows(FixedTalker):
    \"\"\"On its first call (when SWALLOW=1), sends its own process a SIGINT and swallows the KeyboardInterrupt.\"\"\"

    fired = False

    def talker_preprocess(self, input_ids, input_embeds, **info):
        if os.environ.get("SWALLOW") == "1" and not Swallows.fired:
            Swallows.fired = True
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(3000):  # bounded: the handler runs at the next bytecode
                    time.sleep(0.01)
            except KeyboardInterrupt:
                pass
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness.cli", *args]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{REPO}", **extra}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "requests.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_swallowed_sigint_still_stops_the_run_at_the_next_cell(tmp_path: Path) -> None:
    (tmp_path / "swallow_plugin.py").write_text(_SWALLOW_PLUGIN)
    run_dir = tmp_path / "out" / "r"
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(E2E_PROMPTS), "--sim-workers", "0",
            "--arm", "x=swallow_plugin:Swallows", "--deploy", "reference", "--deploy", "stress"]
    res = subprocess.run(_cmd(*args, "--out", str(tmp_path / "out"), "--run-id", "r"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=_env(tmp_path, SWALLOW="1"))
    assert res.returncode == 130, res.stderr
    assert res.stdout == ""
    assert res.stderr.splitlines()[-1] == (
        f"omni-stress: interrupted (SIGINT): {run_dir} holds 3 of 6 request records; "
        f"`omni-stress run --resume {run_dir}` (same options) completes it")
    assert "Traceback" not in res.stderr
    assert sorted((r["deploy"], r["prompt_id"]) for r in _records(run_dir)) == [
        ("reference", "p01-weather"), ("reference", "p03-sleep"), ("reference", "p05-garden")]
    assert json.loads((run_dir / "manifest.json").read_text())["finished"] is None
    # resumable: the rest runs, the run is complete
    res = subprocess.run(_cmd(*args, "--resume", str(run_dir)), cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env=_env(tmp_path, SWALLOW="0"))
    assert res.returncode == 0, res.stderr
    assert len(_records(run_dir)) == 6 and (run_dir / "summary.csv").is_file()


@pytest.mark.slow
def test_sigint_stops_a_run_started_with_sigint_ignored(tmp_path: Path) -> None:
    """The background job of a non-interactive shell starts with SIGINT ignored; `kill -INT` must still stop it."""
    out = tmp_path / "out"
    args = ["run", "--asr", "none", "--prompts", str(E2E_PROMPTS), "--sim-workers", "0", "--arm", "pr",
            "--deploy", "reference", "--deploy", "stress", "--out", str(out), "--run-id", "r"]
    proc = subprocess.Popen(_cmd(*args), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(tmp_path), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    seen: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("run directory: "):
                started.set()
        started.set()  # EOF: the run ended before saying where it writes

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(600) and any(ln.startswith("run directory: ") for ln in seen), "".join(seen)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(60)
    assert proc.returncode == 130, "".join(seen)
    last = seen[-1].rstrip("\n")
    assert last.startswith(f"omni-stress: interrupted (SIGINT): {out / 'r'} holds "), last
    assert json.loads((out / "r" / "manifest.json").read_text())["finished"] is None


def test_finish_sees_a_counted_or_a_pending_sigint() -> None:
    """``finish`` answers with SIGINT blocked: a signal that arrives after the last check is pending, not lost."""
    code = (
        "import os, signal\n"
        "from harness import interrupt\n"
        "interrupt.install()\n"
        "print(interrupt.received(), end=' ')\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"  # blocked: pending, the handler has not run
        "print(interrupt.received(), interrupt.finish(), end=' ')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.stdout == "0 0 True ", res.stderr
    code = (
        "import os, signal\n"
        "from harness import interrupt\n"
        "interrupt.install()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"  # swallowed: still counted
        "print(interrupt.received(), interrupt.finish(), end=' ')\n"
        "try:\n"
        "    interrupt.check()\n"
        "except KeyboardInterrupt:\n"
        "    print('raised', end='')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.stdout == "1 True raised", res.stderr
