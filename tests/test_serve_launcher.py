"""The server launcher against the fake ``vllm`` executable: real processes and sockets on 127.0.0.1."""

from __future__ import annotations

import json
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_vllm"))
from fakekit import fake_argv

from harness.errors import UserError
from harness.serve import launcher as launcher_mod
from harness.serve.launcher import ServerLauncher, pid_alive

pytestmark = pytest.mark.slow


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


# Bounds that hold on a busy machine (load average 8 on 2 cores, issue 24 case 23): each wait ends on
# an event (a process's exit, a line on a pipe) as soon as it happens, and its bound only decides
# when a test gives up. The launcher's own stop takes at most its stop timeouts, plus the group
# sweep's 5 s grace and the reaper's 10 s; a script's interpreter start-up under load takes seconds.
SCRIPT_STOP_TIMEOUTS_S = (5.0, 5.0, 5.0)
STOP_BOUND_S = sum(SCRIPT_STOP_TIMEOUTS_S) + 5.0 + 10.0 + 60.0  # 90 s
START_BOUND_S = 120.0  # a python -c script importing the launcher, and the fake server, at load 8


def wait_gone(*pids: int, timeout: float = 60.0) -> bool:
    """True once every one of ``pids`` has exited; waits on each process's pidfd (Linux), which
    becomes readable when the process ends, and polls only where there is none."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        except ProcessLookupError:
            continue
        except OSError:
            fd = None
        try:
            if fd is not None:
                select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            else:
                while pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            if fd is not None:
                os.close(fd)
        if pid_alive(pid):
            return False
    return True


class Lines:
    """A child's stdout, line by line, through a reader thread: ``next(prefix)`` waits for the next
    line that starts with ``prefix`` (an event on the pipe, not a sleep)."""

    def __init__(self, stream) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)

    def next(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line starting {prefix!r} within {timeout:g} s; got {self.seen}") from None
            if line is None:
                raise AssertionError(f"the process ended before a line starting {prefix!r}; got {self.seen}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def rest(self, timeout: float) -> str:
        """Everything after, up to the end of the stream."""
        out = []
        deadline = time.monotonic() + timeout
        while (line := self.queue.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            out.append(line)
        return "".join(out)


def pids(pidfile: Path) -> tuple[int, int | None]:
    data = json.loads(pidfile.read_text())
    return data["server"], data["worker"]


def test_healthy_then_stopped_with_its_worker(tmp_path):
    pidfile = tmp_path / "pids.json"
    log = tmp_path / "server-main-stress.log"
    srv = ServerLauncher(fake_argv, log, env=env(FAKE_VLLM_WORKER="1", FAKE_VLLM_PIDFILE=str(pidfile)),
                         health_timeout_s=20, announce=None)
    with srv:
        assert httpx.get(srv.base_url + "/health", trust_env=False).json() == {"status": "healthy"}
        server, worker = pids(pidfile)
        assert srv.pid == server and pid_alive(worker)
    assert srv.returncode == 0  # SIGINT: graceful shutdown
    assert wait_gone(server, worker)  # the worker ignores SIGINT; the group sweep took it
    text = log.read_text()
    assert text.startswith("=== omni-stress: ") and "--omni --host 127.0.0.1 --port" in text
    assert "shutdown complete" in text


def test_never_healthy_times_out_and_reaps(tmp_path):
    pidfile = tmp_path / "pids.json"
    log = tmp_path / "server.log"
    srv = ServerLauncher(fake_argv, log, env=env(FAKE_VLLM_NEVER_HEALTHY="1", FAKE_VLLM_PIDFILE=str(pidfile)),
                         health_timeout_s=1.5, announce=None)
    t0 = time.monotonic()
    with pytest.raises(UserError) as exc, srv:
        pass
    assert time.monotonic() - t0 < 10
    msg = str(exc.value)
    assert "did not become healthy within 1.5 s" in msg and f"log: {log}" in msg
    server, _ = pids(pidfile)
    assert not pid_alive(server) and srv.returncode is not None


def test_early_death_names_exit_code_log_and_last_lines(tmp_path):
    log = tmp_path / "server.log"
    argv = lambda port: fake_argv(port)[:4] + ["--port", str(port)]
    with pytest.raises(UserError) as exc, ServerLauncher(argv, log, env=env(), health_timeout_s=20, announce=None):
        pass
    msg = str(exc.value)
    assert "exited with code 1 before becoming healthy" in msg
    assert f"log: {log}" in msg and "fake vllm: --omni missing" in msg


def test_missing_executable_is_a_user_error(tmp_path):
    srv = ServerLauncher(lambda port: ["/nonexistent/vllm", "serve"], tmp_path / "s.log", announce=None)
    with pytest.raises(UserError, match="cannot start '/nonexistent/vllm': not found"), srv:
        pass


def test_port_taken_before_the_server_binds_is_retried(tmp_path, monkeypatch):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    free = iter([taken])
    real_pick = launcher_mod.pick_free_port
    monkeypatch.setattr(launcher_mod, "pick_free_port", lambda host="127.0.0.1": next(free, None) or real_pick())
    monkeypatch.setattr(launcher_mod, "port_is_free", lambda port, host="127.0.0.1": True)  # lose the race
    log = tmp_path / "server.log"
    try:
        with ServerLauncher(fake_argv, log, env=env(), health_timeout_s=20, announce=None) as srv:
            assert srv.port != taken
            assert httpx.get(srv.base_url + "/health", trust_env=False).status_code == 200
    finally:
        blocker.close()
    assert "address already in use" in log.read_text().lower()


def test_fixed_port_in_use_is_refused(tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        srv = ServerLauncher(fake_argv, tmp_path / "s.log", port=port, announce=None)
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is already in use"), srv:
            pass
        assert srv.proc is None


def test_stop_escalates_to_sigkill(tmp_path):
    pidfile = tmp_path / "pids.json"
    srv = ServerLauncher(fake_argv, tmp_path / "s.log", env=env(FAKE_VLLM_IGNORE="INT,TERM", FAKE_VLLM_PIDFILE=str(pidfile)),
                         health_timeout_s=20, stop_timeouts_s=(0.3, 0.3, 5.0), announce=None)
    with srv:
        pass
    assert srv.returncode == -signal.SIGKILL
    assert not pid_alive(pids(pidfile)[0])


SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {fake_dir!r})
    from fakekit import fake_argv
    from harness.serve.launcher import ServerLauncher
    env = dict(os.environ, FAKE_VLLM_WORKER="1", FAKE_VLLM_PIDFILE={pidfile!r})
    # every announcement on stdout, "waiting for ..." on each turn of the health wait: the test's events
    with ServerLauncher(fake_argv, {log!r}, env=env, health_timeout_s=300, announce=lambda m: print(m, flush=True),
                        progress_every_s=0.0, stop_timeouts_s={stop!r}):
        print("READY", flush=True)
        time.sleep(600)
""")


def _script(tmp_path: Path, pidfile: Path) -> str:
    return SCRIPT.format(fake_dir=str(Path(__file__).resolve().parent / "fake_vllm"), pidfile=str(pidfile),
                         log=str(tmp_path / "s.log"), stop=SCRIPT_STOP_TIMEOUTS_S)


def test_sigint_while_waiting_for_health_reaps_the_server(tmp_path):
    pidfile = tmp_path / "pids.json"
    code = _script(tmp_path, pidfile).replace('FAKE_VLLM_WORKER="1"', 'FAKE_VLLM_NEVER_HEALTHY="1"')
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc.stdout)
        server = int(re.search(r"\(pid (\d+),", lines.next("started ", START_BOUND_S)).group(1))
        lines.next("waiting for ", START_BOUND_S)  # said inside the health wait's loop: the launcher is there now
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=STOP_BOUND_S)
        out, err = lines.rest(10.0), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0 and "READY" not in out
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
    assert wait_gone(server)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signal_to_the_launcher_process_reaps_the_server(tmp_path, sig):
    """SIGINT/SIGTERM: the launcher stops the server itself. SIGKILL: no code of the launcher runs; its
    reaper process (harness.serve.reaper) sees it gone and stops the server's group."""
    pidfile = tmp_path / "pids.json"
    proc = subprocess.Popen([sys.executable, "-c", _script(tmp_path, pidfile)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        Lines(proc.stdout).next("READY", START_BOUND_S)
        server, worker = pids(pidfile)
        assert pid_alive(server) and pid_alive(worker)
        proc.send_signal(sig)
        rc = proc.wait(timeout=STOP_BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == -signal.SIGKILL if sig == signal.SIGKILL else rc != 0
    assert wait_gone(server, worker, timeout=STOP_BOUND_S), "server or its worker survived the launcher"


def test_last_traceback_line_is_the_exception_that_ended_the_last_traceback():
    from harness.serve.launcher import last_traceback_line

    log = "\n".join([
        "INFO 12-05 starting",
        "Traceback (most recent call last):",
        '  File "a.py", line 3, in <module>',
        "ValueError: an earlier one, handled",
        "(EngineCore_DP0 pid=812) Traceback (most recent call last):",
        '(EngineCore_DP0 pid=812)   File "/venv/vllm_omni/worker/gpu_model_runner.py", line 1880, in _preprocess',
        "(EngineCore_DP0 pid=812)     req_embeds = self.model.talker_preprocess(**kw)",
        "(EngineCore_DP0 pid=812) torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
        "(APIServer pid=800) INFO shutting down",
    ])
    assert last_traceback_line(log) == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    dead = "\n".join([  # the engine core's traceback, then the API server's report that it is dead
        "(StageEngineCoreProc_stage1_replica0 pid=31898) ERROR 12-06 23:57:15 [stage_engine_core_proc.py:260] Traceback (most recent call last):",
        '(StageEngineCoreProc_stage1_replica0 pid=31898) ERROR 12-06 23:57:15 [stage_engine_core_proc.py:260]   File "r.py", line 1223, in execute_model',
        "(StageEngineCoreProc_stage1_replica0 pid=31898) ERROR 12-06 23:57:15 [stage_engine_core_proc.py:260] IndexError: index 7 is out of bounds for dimension 0 with size 6",
        "(APIServer pid=31885) ERROR 12-06 23:57:15 [stage_pool.py:1227] Traceback (most recent call last):",
        '(APIServer pid=31885) ERROR 12-06 23:57:15 [stage_pool.py:1227]   File "core_client.py", line 1175, in get_output_async',
        "(APIServer pid=31885) ERROR 12-06 23:57:15 [stage_pool.py:1227] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    ])
    assert last_traceback_line(dead) == "IndexError: index 7 is out of bounds for dimension 0 with size 6"
    assert last_traceback_line(dead.split("\n", 3)[3]) == ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
                                                           "encountered an issue.")  # the only one there is
    assert last_traceback_line("INFO no traceback\nERROR something else") is None
    assert last_traceback_line("Traceback (most recent call last):\n  File \"x\", line 1") is None  # cut off
