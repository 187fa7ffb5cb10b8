"""Bad input from the machine around a command: the interpreter it is told to use, a Ray cluster that does not
answer, cache folders it cannot write (docs/robustness.md). Each through the CLI as a user types it."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
from clikit import assert_one_line_error
from conftest import SMALL_PROMPTS, run_cli


# ----------------------------------------------------------------------------- tiny-model --python: not an interpreter


@pytest.mark.parametrize("kind", ["not-executable", "no-shebang"])
def test_tiny_model_python_that_is_not_an_interpreter(tmp_path: Path, kind: str) -> None:
    """Issue 33, case 6: a 33-line traceback (Exec format error, PermissionError) before."""
    fake = tmp_path / "python"
    fake.write_text("just text, not a program\n")
    if kind == "no-shebang":
        os.chmod(fake, 0o755)
    res = run_cli("tiny-model", str(tmp_path / "model"), "--python", str(fake))
    reason = "Permission denied" if kind == "not-executable" else "Exec format error"
    assert_one_line_error(res, f"tiny-model: --python {fake}: cannot run it ({reason})")
    assert not (tmp_path / "model").exists()


# ----------------------------------------------------------------------------- a cache folder that cannot be written


def test_unwritable_cache_folder_is_one_line_and_the_run_succeeds(tmp_path: Path) -> None:
    """Issue 33, case 8: with ``XDG_CACHE_HOME`` unwritable a run succeeded but printed 36 lines despite
    ``--quiet`` (four vLLM tracebacks from the sim workers, matplotlib's warning)."""
    (tmp_path / "a-file").write_text("not a folder\n")
    xdg = tmp_path / "a-file" / "cache"  # unwritable even for root: under a file
    own = tmp_path / "own-cache"
    res = run_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--arm", "main", "--deploy",
                  "reference", "--deploy", "stress", "--sim-workers", "2", "--out", str(tmp_path / "out"),
                  "--run-id", "r", env={"XDG_CACHE_HOME": str(xdg), "OMNI_STRESS_CACHE_DIR": str(own),
                                        "VLLM_CACHE_ROOT": "", "MPLCONFIGDIR": ""})
    assert res.exit_code == 0, res.stderr
    assert res.stderr.splitlines() == [
        f"omni-stress: warning: cache folder {xdg}/vllm cannot be written ({tmp_path / 'a-file'} is not a folder); "
        f"vLLM's and matplotlib's caches go to {own}/libraries for this command"], res.stderr
    assert (tmp_path / "out" / "r" / "report.html").is_file()
    # omni-stress's own cache cannot be written either: a temporary folder, said so
    env = {"XDG_CACHE_HOME": str(xdg), "OMNI_STRESS_CACHE_DIR": "", "VLLM_CACHE_ROOT": "", "MPLCONFIGDIR": ""}
    tmp = run_cli("report", "--no-write", str(tmp_path / "out" / "r"), env=env)
    assert tmp.exit_code == 0, tmp.stderr
    [line] = tmp.stderr.splitlines()
    assert line.startswith(f"omni-stress: warning: cache folder {xdg}/matplotlib cannot be written "
                           f"({tmp_path / 'a-file'} is not a folder); matplotlib's cache goes to "), line
    assert line.endswith(" (a temporary folder, removed at exit) for this command"), line
    # a command that uses neither library says nothing
    assert "cache folder" not in run_cli("gate", str(tmp_path / "out" / "r"), env=env).stderr


# ----------------------------------------------------------------------------- --ray-address that does not answer


@pytest.fixture
def silent_port():
    """A TCP port on 127.0.0.1 that accepts connections and never says a word (not a Ray cluster)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def test_ray_address_that_accepts_but_does_not_answer(tmp_path: Path, silent_port: int) -> None:
    """Issue 33, case 7: the right line and exit 2, but after ray.init's own wait (23-60 s) and Ray's GCS client
    log (20 lines) on the terminal."""
    pytest.importorskip("ray")
    address = f"127.0.0.1:{silent_port}"
    res = run_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--arm", "main", "--deploy",
                  "reference", "--out", str(tmp_path / "out"), "--executor", "ray", "--ray-address", address,
                  env={"OMNI_STRESS_RAY_PROBE_TIMEOUT": "2"})
    assert_one_line_error(res, f"--ray-address {address}: no Ray cluster answers at 127.0.0.1:{silent_port} (a "
                          "connection opens, but nothing answers in 2 s; $OMNI_STRESS_RAY_PROBE_TIMEOUT sets the wait)")
    assert not (tmp_path / "out").exists()
